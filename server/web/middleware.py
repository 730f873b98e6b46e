"""Pure ASGI middleware: the request-body limits and the prediction-request counter, below the routers so that they
hold on every path, before FastAPI reads a body or refuses a request (docs/reliability.md)."""

from __future__ import annotations

import math
import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.config import ServeConfig
from server.metrics import ServerMetrics
from server.oip import raw_request_limit
from server.web.dependencies import ApiError, error_response

JSON_OVERHEAD = 64 * 1024
"""Bytes a JSON request may hold besides its base64 images (ids, names, shapes, parameters)."""
PREDICT_ROUTES = {"v1": re.compile(r"/v1/predict/?"), "v2": re.compile(r"/v2/models/[^/]+/infer/?")}


def body_limit(settings: ServeConfig, headers: Headers) -> int:
    """The most bytes a body may have: one image raw, else ``max_files`` images (base64 in JSON) and some JSON."""
    image, content_type = settings.limits.max_bytes, headers.get("content-type", "")
    if content_type.startswith("image/"):
        return image
    if content_type.startswith("multipart/form-data"):
        return settings.max_files * (image + JSON_OVERHEAD)
    if "inference-header-content-length" in headers:
        return raw_request_limit(settings, JSON_OVERHEAD)
    return settings.max_files * math.ceil(image * 4 / 3) + JSON_OVERHEAD


class BodyLimit:
    """413 for a body over ``body_limit`` (declared, or as it arrives), 503 with Retry-After for one that would pass
    ``max_inflight_bytes`` beside others in flight. Counts run on the event loop: no lock."""

    RETRY_AFTER_S = 1

    def __init__(self, app: ASGIApp, settings: ServeConfig) -> None:
        self.app, self.settings = app, settings
        self.inflight = 0  # body bytes held by the requests in flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = body_limit(self.settings, headers)
        declared = int(headers["content-length"]) if headers.get("content-length", "").isdigit() else None
        if declared is not None and declared > limit:
            await error_response(413, f"request body of {declared} bytes exceeds the limit of {limit}",
                                 "too_large")(scope, receive, send)
            return
        if declared is not None and not self._room(declared):
            await error_response(*self._busy(), headers={"Retry-After": str(self.RETRY_AFTER_S)})(scope, receive, send)
            return
        held = declared or 0
        self.inflight += held
        received = 0

        async def counted() -> Message:
            nonlocal received, held
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # raised inside the route's read: the app's error handler renders it
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "too_large")
            if received > held:  # a chunked body (or one longer than declared): count what arrived
                if not self._room(received - held, holding=held):
                    raise ApiError(*self._busy(), headers={"Retry-After": str(self.RETRY_AFTER_S)})
                self.inflight += received - held
                held = received
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            self.inflight -= held

    def _room(self, more: int, holding: int = 0) -> bool:
        """Whether ``more`` bytes fit beside the others in flight (a request alone always fits: its limit holds)."""
        others = self.inflight - holding
        return others == 0 or self.inflight + more <= self.settings.max_inflight_bytes

    def _busy(self) -> tuple[int, str, str]:
        return (503, f"the server holds {self.inflight} bytes of requests in flight (limit "
                     f"{self.settings.max_inflight_bytes}): retry shortly", "overloaded")


class PredictCounter:  # pragma: no mutate block (metrics: tests/test_http_api.py)
    """Counts every prediction request, those refused before their route ran included (not an unhandled 500)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

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
