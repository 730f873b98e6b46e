"""Every prediction request counted by its answer's status, whichever protocol and wherever it was answered.

Why: counting inside a route misses what is answered before the route runs (a 413 while the body streams in, a
422 from request validation) and every route that forgets to count (/v2 infer was missing). This pure ASGI
middleware sees each response's status on its way out.

Example:
    >>> is_prediction("/v1/predict"), is_prediction("/v2/models/mepo/infer"), is_prediction("/v1/status")
    (True, True, False)
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.metrics import ServerMetrics

PREDICTION_PATHS = re.compile(r"^/v1/predict$|^/v2/models/[^/]+(/versions/[^/]+)?/infer$")


def is_prediction(path: str) -> bool:
    return PREDICTION_PATHS.match(path) is not None


class CountPredictions:
    """Adds one to ``mepo_predict_requests_total{status=...}`` per prediction request, by the status answered."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_prediction(scope["path"]):
            return await self.app(scope, receive, send)

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.predict_requests.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting)
