"""The Open Inference Protocol (KServe v2) REST routes, for KServe/Triton-style clients.

Images travel as one ``BYTES`` input of shape ``[N]`` whose ``data`` holds base64-encoded JPEG/PNG files. The
response has two outputs per request: ``label`` (INT64 ``[N, k]``) and ``probability`` (FP32 ``[N, k]``),
plus ``parameters.names`` with the class names.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from server.config import ServeConfig
from server.dependencies import ApiError, get_service, get_settings
from server.prediction import decode_all, predict_images
from server.service import Service

router = APIRouter(prefix="/v2", tags=["open inference protocol"])
INPUT_NAME = "image"


class InferInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any]


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[InferInput] = Field(min_length=1)
    outputs: list[dict[str, Any]] | None = None


def _model(name: str, settings: ServeConfig) -> None:
    if name != settings.model_name:
        raise ApiError(404, f"unknown model {name!r}; this server serves {settings.model_name!r}", "unknown_model")


@router.get("", summary="Server metadata")
def server_metadata() -> dict:
    return {"name": "mepo-stream", "version": "0.1.0", "extensions": []}


@router.get("/health/live", summary="Server liveness")
def live() -> dict:
    return {"live": True}


@router.get("/health/ready", summary="Server readiness")
def ready(service: Annotated[Service, Depends(get_service)]) -> dict:
    if not all((checks := service.readiness()["checks"]).values()):
        raise ApiError(503, f"not ready: {', '.join(k for k, ok in checks.items() if not ok)} false", "not_ready")
    return {"ready": True}


@router.get("/models/{name}", summary="Model metadata")
def model_metadata(name: str, settings: Annotated[ServeConfig, Depends(get_settings)]) -> dict:
    _model(name, settings)
    return {
        "name": name, "versions": [], "platform": "pytorch",
        "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1, -1]},
                    {"name": "probability", "datatype": "FP32", "shape": [-1, -1]}],
    }


@router.get("/models/{name}/ready", summary="Model readiness")
def model_ready(name: str, service: Annotated[Service, Depends(get_service)],
                settings: Annotated[ServeConfig, Depends(get_settings)]) -> dict:
    _model(name, settings)
    return {"name": name, "ready": bool(service.state.snapshot.exposed)}


def _decode_b64(item: Any, index: int) -> bytes:
    if not isinstance(item, str):
        raise ApiError(400, f"inputs[0].data[{index}] must be a base64 string", "invalid_request")
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"inputs[0].data[{index}] is not valid base64", "invalid_request") from e


@router.post("/models/{name}/infer", summary="Inference")
async def infer(name: str, request: InferRequest, service: Annotated[Service, Depends(get_service)],
                settings: Annotated[ServeConfig, Depends(get_settings)]) -> dict:
    _model(name, settings)
    tensor = request.inputs[0]
    if tensor.datatype != "BYTES":
        raise ApiError(400, f"input {tensor.name!r} must have datatype BYTES (encoded images)", "invalid_request")
    if tensor.shape != [len(tensor.data)]:
        raise ApiError(400, f"shape {tensor.shape} does not match {len(tensor.data)} data items", "invalid_request")
    items = [(f"{tensor.name}[{i}]", _decode_b64(d, i)) for i, d in enumerate(tensor.data)]
    images = await run_in_threadpool(decode_all, items, settings)
    top_k = int((request.parameters or {}).get("top_k", settings.top_k))
    meta, rows = await run_in_threadpool(predict_images, service, images, max(1, min(top_k, 100)))
    k = len(rows[0])
    return {
        "model_name": name, "model_version": str(meta["model_version"]), "id": request.id,
        "parameters": {"samples_seen": meta["samples_seen"], "names": [[c["name"] for c in r] for r in rows]},
        "outputs": [
            {"name": "label", "datatype": "INT64", "shape": [len(rows), k],
             "data": [c["label"] for r in rows for c in r]},
            {"name": "probability", "datatype": "FP32", "shape": [len(rows), k],
             "data": [c["probability"] for r in rows for c in r]},
        ],
    }
