"""FastAPI dependencies shared by the routers: settings, the running service, admin auth, errors."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from kafka.errors import KafkaError
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from server.config import ServeConfig
from server.serving import ServingModel
from server.uploads import LabelsOff


class ApiError(HTTPException):
    """An HTTP error with a short machine-readable reason, rendered as {"error": ..., "reason": ...}."""

    def __init__(self, status: int, message: str, reason: str, headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.reason = reason


class ErrorBody(BaseModel):
    """The body of every error answer (the OpenAPI schema lists it for each error a route can give)."""

    error: str
    reason: str


ERROR_DESCRIPTIONS = {400: "Bad request", 401: "Missing bearer token", 403: "Forbidden", 404: "Not found",
                      409: "Not possible in this service's configuration", 413: "Request body or image too large",
                      415: "Unsupported media type", 422: "Invalid request",
                      503: "Not ready, or too many request bytes in flight (Retry-After)"}


def errors(*statuses: int) -> dict[int | str, dict]:  # pragma: no mutate block (OpenAPI: the fuzzer test)
    """OpenAPI ``responses`` entries for a route's error statuses (for 422, instead of FastAPI's, never sent)."""
    return {s: {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[s]} for s in statuses}


def digits_only(value: object) -> object:
    """A query's integer as its digits alone (pydantic's lax parsing would read ``3.0``, ``+3`` or ``3_0`` as one).
    Put it after the integer's bounds in ``Annotated`` (it still runs first), or the schema loses them."""
    if isinstance(value, str) and not (value.isascii() and value.isdigit()):
        raise ValueError("should be an integer, in digits alone")
    return value


def error_response(status: int, message: str, reason: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "reason": reason}, status_code=status, headers=headers)


@contextmanager
def writing(what: str) -> Iterator[None]:
    """A write to the broker for a client: 409 where labels do not come later, 503 when the broker cannot take it."""
    try:
        yield
    except LabelsOff as e:
        raise ApiError(409, str(e), "labels_not_later") from e
    except KafkaError as e:
        raise ApiError(503, f"the broker did not take {what}: {e}", "kafka_unavailable",
                       headers={"Retry-After": "1"}) from e


def get_settings(request: Request) -> ServeConfig:
    """The service settings (tests override this with ``app.dependency_overrides[get_settings]``)."""
    return request.app.state.settings


def get_service(request: Request) -> ServingModel:
    """The running service; 503 while the lifespan is still loading the model."""
    service = getattr(request.app.state, "service", None)
    if service is None:
        raise ApiError(503, "the model is still loading", "not_ready")
    return service


Settings = Annotated[ServeConfig, Depends(get_settings)]
Service = Annotated[ServingModel, Depends(get_service)]


def served_model(name: str, settings: ServeConfig) -> None:
    """404 for any model but the one served (both Open Inference Protocol transports)."""
    if name != settings.model_name:
        raise ApiError(404, f"unknown model {name!r}; this server serves {settings.model_name!r}", "unknown_model")


ADMIN_TOKEN = HTTPBearer(auto_error=False, scheme_name="AdminToken",
                         description="The service's --admin_token, as `Authorization: Bearer <token>`")
"""Declared on each admin route, so clients and the fuzz test know which need the token; ``require_admin`` decides."""


def require_admin(settings: Settings,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Security(ADMIN_TOKEN)]) -> None:
    """Bearer-token check for admin routes, compared in constant time."""
    token = settings.admin_token
    if not token:
        raise ApiError(403, "admin routes are disabled: no admin token is configured", "admin_disabled")
    if credentials is None or not credentials.credentials:
        raise ApiError(401, "missing bearer token", "unauthorized")
    if not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
        raise ApiError(403, "invalid bearer token", "forbidden")


ADMIN = [Depends(require_admin)]  # an admin route's dependencies
