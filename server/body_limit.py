"""Request-size limits that hold on every path: the body is counted as it streams in, not trusted by its header.

Why: a ``Content-Length`` check alone is bypassed by a chunked upload (no length), and a JSON body is parsed and
base64-decoded whole before any route code runs; a 300 MB chunked upload was read entirely into memory. This
pure ASGI middleware wraps ``receive`` and raises a 413 ``ApiError`` as soon as the bytes received pass the
request's limit, wherever the body is being read (``request.body()``, the multipart parser, FastAPI's JSON
parsing, which re-raises HTTP errors); the app's error handler turns it into the JSON 413, and nothing past the
limit is ever buffered.

Example:
    >>> limit_for("image/png", ImageLimits(max_bytes=100), max_files=4)
    100
    >>> limit_for("application/json", ImageLimits(max_bytes=100), max_files=4)  # base64: 4/3 of the bytes
    66069
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mepo_stream.images import ImageLimits
from server.dependencies import ApiError

ENVELOPE = 64 * 1024
"""Room for what is not image bytes: multipart headers and boundaries, the JSON around the base64 strings."""


def limit_for(content_type: str, limits: ImageLimits, max_files: int) -> int:
    """Most body bytes a request of ``content_type`` may send: one image raw, ``max_files`` images otherwise."""
    if content_type.startswith("image/"):
        return limits.max_bytes
    if content_type.startswith("multipart/"):
        return limits.max_bytes * max_files + ENVELOPE
    return limits.max_bytes * max_files * 4 // 3 + ENVELOPE


class BodyLimit:
    """Counts every request's body bytes and fails it with 413 once they pass ``limit_for`` its content type."""

    def __init__(self, app: ASGIApp, limits: ImageLimits, max_files: int):
        self.app, self.limits, self.max_files = app, limits, max_files

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        limit = limit_for(headers.get(b"content-type", b"").decode("latin-1"), self.limits, self.max_files)
        declared = headers.get(b"content-length", b"")
        too_large = declared.isdigit() and int(declared) > limit  # refused before a byte is read
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = {"body": b""} if too_large else await receive()
            seen += len(message.get("body", b""))
            if too_large or seen > limit:
                raise ApiError(413, f"request body larger than {limit} bytes", "too_large")
            return message

        return await self.app(scope, counted, send)
