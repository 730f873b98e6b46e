"""Corrections and deletions over HTTP, for people who do not write Kafka records (admin token).

A label or tombstone is written to the labels topic (or the image topic, where labels come inline), answered 202
with where the broker put it, and learned as every label: with the stream's guarantees. A replayed image's id is
``<stream id>/<file>`` (``mepo_stream.records.stream_id``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from mepo_stream.records import MAX_ID
from server.serving import CorrectionsOff, HoldsSamples, ServingModel
from server.status import HeldSample
from server.web.dependencies import ADMIN, ApiError, Service, Settings, errors, writing

router = APIRouter(tags=["samples"])
Id = Annotated[str, Path(min_length=1, max_length=MAX_ID, description="The sample's id, as its image record named it")]


class NewLabel(BaseModel):
    """A label, strictly a JSON integer: a boolean, string or float is a typo in an operator's script, and taking
    it would relabel a sample; its upper bound, the class count, is the running service's (``server.web.openapi``
    writes it into the served schema)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    label: int = Field(ge=0, description="The label the sample should have: below the class count")


class Written(BaseModel):
    """Where the broker put the record; the learner applies it in its place in the labels topic."""

    id: str
    topic: str
    partition: int
    offset: int


@router.post("/v1/labels/{id:path}", dependencies=ADMIN, status_code=202,
             responses=errors(400, 401, 403, 409, 413, 422, 503),
             summary="Label a sample by id, or correct its label (a record on the labels topic)")
def label(id: Id, body: NewLabel, service: Service) -> Written:
    if body.label >= len(service.class_names):
        raise ApiError(422, f"label {body.label} is outside the label space [0, {len(service.class_names)})",
                       "label_out_of_range")
    return _write(service, id, body.label)


@router.get("/v1/samples/{id:path}", dependencies=ADMIN, responses=errors(401, 403, 404, 503),
            summary="What the learner holds of a learned id: its label, time and file (--corrections.enabled)")
def held(id: Id, service: Service) -> HeldSample:
    try:
        sample = service.sample(id) if isinstance(service, HoldsSamples) else None
    except CorrectionsOff as e:
        raise ApiError(404, f"{e}: it holds nothing by id", "corrections_off") from e
    if sample is None:
        raise ApiError(404, f"no learned sample {id!r}: never learned, deleted, or past --corrections.retention_s",
                       "unknown_id")
    return sample


@router.delete("/v1/samples/{id:path}", dependencies=ADMIN, status_code=202, responses=errors(401, 403, 409, 422, 503),
               summary="Delete a sample by id from the model and every store (a tombstone on the labels topic)")
def delete(id: Id, service: Service, settings: Settings) -> Written:
    if not settings.corrections.enabled:
        raise ApiError(409, "deletions need the learner started with --corrections.enabled", "corrections_off")
    return _write(service, id, None)


def _write(service: ServingModel, id: str, label: int | None) -> Written:
    with writing("the record"):
        meta = service.write_label(id, label)
    return Written(id=id, topic=meta.topic, partition=meta.partition, offset=meta.offset)
