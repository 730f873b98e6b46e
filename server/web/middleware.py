"""Pure ASGI middleware around every route: the request-body limit and the prediction-request counter.

Both sit below the routers so that they hold on every path: a limit checked in a route runs after FastAPI has
already read (and, for JSON, parsed) the body, and a counter in a route misses the requests refused before it
runs (body too large, invalid JSON).
"""

from __future__ import annotations

import math
import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.config import ServeConfig
from server.metrics import ServerMetrics
from server.web.dependencies import ApiError, error_response

JSON_OVERHEAD = 64 * 1024
"""Bytes a JSON request may hold besides its base64 images (ids, names, shapes, parameters)."""
PREDICT_ROUTES = {"v1": re.compile(r"/v1/predict/?"), "v2": re.compile(r"/v2/models/[^/]+/infer/?")}


def body_limit(settings: ServeConfig, content_type: str) -> int:
    """The most bytes a request body may have: one image for a raw image body, ``max_files`` images for a
    multipart upload, and as many base64-encoded images (4/3 of their size) plus some JSON for anything else."""
    image = settings.limits.max_bytes
    if content_type.startswith("image/"):
        return image
    if content_type.startswith("multipart/form-data"):
        return settings.max_files * (image + JSON_OVERHEAD)
    return settings.max_files * math.ceil(image * 4 / 3) + JSON_OVERHEAD


class BodyLimit:
    """Refuses a body over ``body_limit`` with 413: at once from its Content-Length, else as soon as the running
    byte count of what arrives passes the limit (a chunked upload has no Content-Length), before the route has
    parsed or buffered more than the limit."""

    def __init__(self, app: ASGIApp, settings: ServeConfig) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = body_limit(self.settings, headers.get("content-type", ""))
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await error_response(413, f"request body of {declared} bytes exceeds the limit of {limit}",
                                 "too_large")(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # raised inside the route's read: the app's error handler renders it
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "too_large")
            return message

        await self.app(scope, counted, send)


class PredictCounter:  # pragma: no mutate block (metrics: tests/test_http_api.py)
    """Counts every prediction request in ``mepo_predict_requests_total{protocol, status}``, those refused before
    their route ran included (not an unhandled error's 500: Starlette renders it outside every middleware)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        protocol = next((p for p, route in PREDICT_ROUTES.items()
                         if scope["type"] == "http" and scope["method"] == "POST" and route.fullmatch(scope["path"])),
                        None)
        if protocol is None:
            await self.app(scope, receive, send)
            return

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.predict_requests.labels(protocol, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting)
