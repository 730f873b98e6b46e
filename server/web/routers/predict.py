"""``POST /v1/predict``: one or more images as a multipart upload, or one image as the raw request body."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from kafka.errors import KafkaError
from pydantic import BeforeValidator, Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from mepo_stream.records import MAX_ID
from server.config import ServeConfig
from server.serving import ServingModel
from server.uploads import LabelsOff
from server.web.dependencies import ApiError, digits_only, errors, get_service, get_settings
from server.web.prediction import predict_uploads
from server.web.schemas import FilePrediction, Label, PredictResponse

router = APIRouter(tags=["predict"])
TopK = Annotated[int, Field(ge=1, le=100), BeforeValidator(digits_only)]


def keep_for_label(service: ServingModel, id: str, image: bytes, content_type: str, prediction: int) -> None:
    """Hand an answered upload to the image topic for its later label; 409 where labels do not come later, 503
    when the broker cannot take it."""
    try:
        service.keep_for_label(id, image, content_type, prediction)
    except LabelsOff as e:
        raise ApiError(409, str(e), "labels_not_later") from e
    except KafkaError as e:
        raise ApiError(503, f"the broker did not take the upload for its later label: {e}", "kafka_unavailable",
                       headers={"Retry-After": "1"}) from e
UPLOAD_SCHEMA = {
    "requestBody": {
        "content": {
            "multipart/form-data": {"schema": {"type": "object", "required": ["files"], "properties": {
                "files": {"type": "array", "minItems": 1, "items": {"type": "string", "format": "binary"}}}}},
            "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
            "image/png": {"schema": {"type": "string", "format": "binary"}},
        },
        "required": True,
    }
}


async def read_uploads(request: Request, settings: ServeConfig) -> list[tuple[str, bytes]]:
    """(name, bytes) of every uploaded image (``server.web.middleware.BodyLimit`` has bounded the body's size)."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form(max_files=settings.max_files + 1)
        files = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
        if len(files) > settings.max_files:
            raise ApiError(413, f"more than {settings.max_files} files in one request", "too_many_files")
        items = []
        for f in files:
            data = await f.read(settings.limits.max_bytes + 1)
            items.append((f.filename or "upload", data))
        return items
    if content_type.startswith("image/"):
        body = await request.body()
        return [("body", body)]
    raise ApiError(415, f"unsupported content type {content_type or '(none)'!r}: send multipart/form-data "
                        "files or a raw image/* body", "unsupported_media_type")


@router.post("/v1/predict", openapi_extra=UPLOAD_SCHEMA, summary="Predict the classes of images",
             responses=errors(400, 409, 413, 415, 422, 503))
async def predict(
    request: Request,
    service: Annotated[ServingModel, Depends(get_service)],
    settings: Annotated[ServeConfig, Depends(get_settings)],
    top_k: Annotated[TopK | None, Query(description="labels per image")] = None,
    id: Annotated[str | None, Query(min_length=1, max_length=MAX_ID, description=(
        "Keep this one image for a label that comes later: a label with this id on the labels topic teaches the "
        "model with it, and scores this answer (needs the learner's --kafka.labels_topic)"))] = None,
) -> PredictResponse:
    """Top-k labels (with names and probabilities) over the classes seen so far, from the current model."""
    items = await read_uploads(request, settings)
    if id is not None and len(items) != 1:
        raise ApiError(422, f"an id names one image; this request has {len(items)}", "one_image_per_id")
    meta, rows = await run_in_threadpool(predict_uploads, service, items, settings, top_k or settings.top_k)
    if id is not None:
        content_type = request.headers["content-type"] if items[0][0] == "body" else "application/octet-stream"
        await run_in_threadpool(keep_for_label, service, id, items[0][1], content_type, rows[0]["top_k"][0]["label"])
    return PredictResponse(**meta, predictions=[
        FilePrediction(filename=name, top_k=[Label(**c) for c in row["top_k"]], novelty=row["novelty"],
                       novel=row["novel"]) for (name, _), row in zip(items, rows, strict=True)])
