"""``POST /v1/predict``: one or more images as a multipart upload, or one image as the raw request body."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from server.config import ServeConfig
from server.serving import ServingModel
from server.web.dependencies import ApiError, errors, get_service, get_settings
from server.web.prediction import predict_uploads
from server.web.schemas import PredictResponse

router = APIRouter(tags=["predict"])
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
             responses=errors(400, 413, 415, 422, 503))
async def predict(
    request: Request,
    service: Annotated[ServingModel, Depends(get_service)],
    settings: Annotated[ServeConfig, Depends(get_settings)],
    top_k: Annotated[int | None, Query(ge=1, le=100, description="labels per image")] = None,
) -> PredictResponse:
    """Top-k labels (with names and probabilities) over the classes seen so far, from the current model."""
    items = await read_uploads(request, settings)
    meta, rows = await run_in_threadpool(predict_uploads, service, items, settings, top_k or settings.top_k)
    return PredictResponse(**meta, predictions=[{"filename": name, "top_k": row}
                                                for (name, _), row in zip(items, rows, strict=True)])
