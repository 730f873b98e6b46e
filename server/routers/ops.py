"""Operations routes: liveness, readiness, status, and the admin actions (bearer token)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from server.dependencies import errors, get_service, require_admin
from server.service import Service

router = APIRouter(tags=["operations"])
ADMIN_ERRORS = errors(401, 403, 503)


@router.get("/livez", summary="Liveness: the process serves HTTP")
def livez() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: a learner's model loaded and connected to Kafka; a replica's snapshot "
                               "loaded",
            responses={503: {"description": "Not ready: the failing checks, or the error model while loading"}})
def readyz(service: Annotated[Service, Depends(get_service)]) -> JSONResponse:
    readiness = service.readiness()
    ok = all(readiness["checks"].values())
    return JSONResponse({"status": "ready" if ok else "not_ready", **readiness}, status_code=200 if ok else 503)


@router.get("/v1/status", summary="Learning progress, accuracy and stream health", responses=errors(503))
def status(service: Annotated[Service, Depends(get_service)]) -> dict:
    health = service.loop.health()
    return {**service.state.status(), "paused": health.paused, "kafka_connected": health.kafka_connected,
            "consumer_lag": health.consumer_lag, "learner_error": health.error}


@router.post("/v1/admin/checkpoint", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS,
             summary="Checkpoint now")
def checkpoint(service: Annotated[Service, Depends(get_service)]) -> dict:
    service.loop.request_checkpoint()
    return {"status": "checkpoint requested"}


@router.post("/v1/admin/pause", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS,
             summary="Pause learning")
def pause(service: Annotated[Service, Depends(get_service)]) -> dict:
    service.loop.pause()
    return {"status": "paused"}


@router.post("/v1/admin/resume", dependencies=[Depends(require_admin)], responses=ADMIN_ERRORS,
             summary="Resume learning")
def resume(service: Annotated[Service, Depends(get_service)]) -> dict:
    service.loop.resume()
    return {"status": "resumed"}
