"""``POST /v1/predict``: one or more images as a multipart upload, or one image as the raw request body."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BeforeValidator, Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from mepo_stream.records import MAX_ID
from server.config import ServeConfig
from server.oip import MAX_TOP_K
from server.web.dependencies import ApiError, Service, Settings, digits_only, errors, writing
from server.web.prediction import predict_uploads
from server.web.schemas import FilePrediction, Label, PredictResponse

router = APIRouter(tags=["predict"])
TopK = Annotated[int, Field(ge=1, le=MAX_TOP_K), BeforeValidator(digits_only)]
BINARY = {"type": "string", "format": "binary"}
UPLOAD_SCHEMA = {"requestBody": {"content": {
    "multipart/form-data": {"schema": {"type": "object", "required": ["files"],
                                       "properties": {"files": {"type": "array", "minItems": 1, "items": BINARY}}}},
    "image/jpeg": {"schema": BINARY}, "image/png": {"schema": BINARY}}, "required": True}}


async def read_uploads(request: Request, settings: ServeConfig) -> list[tuple[str, bytes]]:
    """(name, bytes) of every uploaded image (``server.web.middleware.BodyLimit`` has bounded the body's size)."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form(max_files=settings.max_files + 1)
        files = [v for _, v in form.multi_items() if isinstance(v, UploadFile)]
        if len(files) > settings.max_files:
            raise ApiError(413, f"more than {settings.max_files} files in one request", "too_many_files")
        return [(f.filename or "upload", await f.read(settings.limits.max_bytes + 1)) for f in files]
    if content_type.startswith("image/"):
        return [("body", await request.body())]
    raise ApiError(415, f"unsupported content type {content_type or '(none)'!r}: send multipart/form-data "
                        "files or a raw image/* body", "unsupported_media_type")


@router.post("/v1/predict", openapi_extra=UPLOAD_SCHEMA, summary="Predict the classes of images",
             responses=errors(400, 409, 413, 415, 422, 503))
async def predict(request: Request, service: Service, settings: Settings,
                  top_k: Annotated[TopK | None, Query(description="labels per image")] = None,
                  id: Annotated[str | None, Query(min_length=1, max_length=MAX_ID, description=(
                      "Keep this one image for a label that comes later: a label with this id on the labels topic "
                      "teaches the model with it, and scores this answer (needs the learner's --kafka.labels_topic)"
                  ))] = None) -> PredictResponse:
    """Top-k labels (with names and probabilities) over the classes seen so far, from the current model."""
    items = await read_uploads(request, settings)
    if id is not None and len(items) != 1:
        raise ApiError(422, f"an id names one image; this request has {len(items)}", "one_image_per_id")
    meta, rows = await run_in_threadpool(predict_uploads, service, items, settings, top_k or settings.top_k)
    if id is not None:
        content_type = request.headers["content-type"] if items[0][0] == "body" else "application/octet-stream"
        with writing("the upload for its later label"):
            await run_in_threadpool(service.keep_for_label, id, items[0][1], content_type, rows[0]["top_k"][0]["label"])
    return PredictResponse(**meta, predictions=[
        FilePrediction(filename=name, top_k=[Label(**c) for c in row["top_k"]], novelty=row["novelty"],
                       novel=row["novel"]) for (name, _), row in zip(items, rows, strict=True)])
