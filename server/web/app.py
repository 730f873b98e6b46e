"""The FastAPI application: routers, and a lifespan that starts the service it is given (a learner or a replica,
seen only as a ``ServingModel``), with ``--grpc_port`` the Open Inference Protocol over gRPC beside it.

Example (without ``with``, the test client runs no lifespan: no model is loaded and no broker is needed):
    >>> from fastapi.testclient import TestClient
    >>> client = TestClient(create_app(ServeConfig()))
    >>> client.get("/livez").json()
    {'status': 'ok'}
    >>> client.get("/readyz").status_code, client.get("/readyz").json()
    (503, {'error': 'the model is still loading', 'reason': 'not_ready'})
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import iter_route_contexts
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from mepo_stream import __version__
from mepo_stream.errors import ConfigError
from server.config import ServeConfig
from server.grpc_service import serve_grpc
from server.metrics import ServerMetrics
from server.serving import Starter
from server.web.dependencies import error_response
from server.web.middleware import BodyLimit, PredictCounter
from server.web.openapi import serve_bounded_schema
from server.web.routers import inference_v2, ops, page, predict, samples

log = logging.getLogger(__name__)


def allowed_methods(app: FastAPI, path: str) -> str:
    """Every method served at ``path``, for a 405's ``Allow`` (Starlette names only the first matching route's)."""
    return ", ".join(sorted({method for route in iter_route_contexts(app.routes) if route.methods
                             and route.path_regex.match(path) for method in route.methods}))


def create_app(settings: ServeConfig, start: Starter | None = None) -> FastAPI:
    """The app for ``settings``; ``start`` starts the service in the lifespan (without it, only liveness is served),
    which then freezes the heap so full collections skip it, not holding the GIL from learning (docs/performance.md)."""
    metrics = ServerMetrics(settings.role)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if start is None:
            yield
            return
        try:
            app.state.service = service = start(settings, metrics)
        except ConfigError as e:  # a configuration or a saved state this version refuses: one clear line
            log.error("refused to start: %s", e)
            raise
        grpc = None if settings.grpc_port is None else serve_grpc(service, settings)
        gc.collect()
        gc.freeze()
        yield
        if grpc is not None:
            grpc.stop(grace=2).wait()
        service.stop()
        gc.unfreeze()

    # FastAPIOffline: /docs and /redoc serve their assets from the installed fastapi-offline package, no CDN
    app = FastAPIOffline(title="mepo-stream", version=__version__, lifespan=lifespan,
                  description="Streaming continual learner (MePo) with a real-time prediction API.")
    app.state.settings, app.state.metrics = settings, metrics
    app.add_middleware(BodyLimit, settings=settings)
    app.add_middleware(PredictCounter, metrics=metrics)  # added last, so outside the limit: it counts its 413s
    for module in (predict, inference_v2, ops, samples, page):
        app.include_router(module.router)
    serve_bounded_schema(app)

    @app.get("/metrics", include_in_schema=False)
    def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:
            headers = {**(headers or {}), "Allow": allowed_methods(app, request.scope["path"])}
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "reason", "http_error"), headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()),
                     "invalid_request")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal error", "internal_error")

    return app
