"""Operations routes: liveness, readiness, status, and the admin actions (bearer token)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from server.serving import Checkpointing
from server.status import LearnerStatus, ReplicaStatus
from server.web.dependencies import ADMIN, ApiError, ErrorBody, Service, errors
from server.web.schemas import Action, Liveness, Readiness, Status

router = APIRouter(tags=["operations"])
ADMIN_ERRORS = errors(401, 403, 503)


@router.get("/livez", summary="Liveness: the process serves HTTP")
def livez() -> Liveness:
    return Liveness(status="ok")


@router.get("/readyz", summary="Readiness: a learner's model loaded and connected to Kafka; a replica's snapshot "
                               "loaded", response_model=Readiness, responses={503: {"model": Readiness | ErrorBody,
                             "description": "Not ready: the checks and the error, or the error while loading"}})
def readyz(service: Service) -> JSONResponse:
    readiness = service.readiness()
    return JSONResponse(readiness.model_dump(), status_code=200 if readiness.ready else 503)


@router.get("/v1/status", summary="Learning progress, accuracy and stream health (a learner's), or the snapshot "
                                   "served (a replica's)", response_model=Status, responses=errors(503))
def status(service: Service) -> LearnerStatus | ReplicaStatus:
    return service.status()


@router.post("/v1/admin/checkpoint", dependencies=ADMIN, responses=errors(401, 403, 409, 503), summary="Checkpoint now")
def checkpoint(service: Service) -> Action:
    if not isinstance(service, Checkpointing):
        raise ApiError(409, "a replica keeps no checkpoint: the learner's is the source of truth", "not_a_learner")
    service.request_checkpoint()
    return Action(status="checkpoint requested")


@router.post("/v1/admin/pause", dependencies=ADMIN, responses=ADMIN_ERRORS, summary="Pause learning")
def pause(service: Service) -> Action:
    service.pause()
    return Action(status="paused")


@router.post("/v1/admin/resume", dependencies=ADMIN, responses=ADMIN_ERRORS, summary="Resume learning")
def resume(service: Service) -> Action:
    service.resume()
    return Action(status="resumed")
