"""The Open Inference Protocol (KServe v2) REST routes, for KServe/Triton-style clients.

Images travel as one ``BYTES`` input of shape ``[N]`` whose ``data`` holds base64-encoded JPEG/PNG files. The
response has two outputs per request: ``label`` (INT64 ``[N, k]``) and ``probability`` (FP32 ``[N, k]``),
plus ``parameters.names`` with the class names.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from mepo_stream import __version__
from server.config import ServeConfig
from server.serving import ServingModel
from server.web.dependencies import ApiError, errors, get_service, get_settings
from server.web.prediction import predict_uploads
from server.web.schemas import (
    InferResponse,
    ModelConfiguration,
    ModelMetadata,
    ModelReady,
    ModelStatistics,
    ModelStatisticsList,
    RepositoryModel,
    ServerLive,
    ServerMetadata,
    ServerReady,
)

router = APIRouter(prefix="/v2", tags=["open inference protocol"], strict_content_type=False)
INPUT_NAME = "image"
MAX_TOP_K = 100
ModelName = Annotated[str, Path(description="The served model's name (`--model_name`)", examples=["mepo"])]


class InferInput(BaseModel):
    """The images: a ``BYTES`` tensor of shape ``[N]``, one base64 string per encoded image (the schema says all
    it can; ``shape`` matching ``data`` and the strings decoding to images are checked by the route: 400, 422)."""

    name: str
    shape: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=1)
    datatype: Literal["BYTES"]
    parameters: dict[str, Any] | None = None
    data: list[str]


class InferParameters(BaseModel):
    """Request parameters: ``top_k``, strictly a JSON integer (never a string, float or bool to coerce); other
    parameters clients send (Triton's ``binary_data_output``) are ignored."""

    model_config = ConfigDict(extra="allow")
    top_k: int = Field(default=None, ge=1, le=MAX_TOP_K, strict=True,  # type: ignore[assignment]
                       description="labels per image; default the server's --top_k")


class InferRequest(BaseModel):
    id: str | None = None
    parameters: InferParameters | None = None
    inputs: list[InferInput] = Field(min_length=1)
    outputs: list[dict[str, Any]] | None = None


def _model(name: str, settings: ServeConfig) -> None:
    """404 for any model but the one served."""
    if name != settings.model_name:
        raise ApiError(404, f"unknown model {name!r}; this server serves {settings.model_name!r}", "unknown_model")


@router.get("", summary="Server metadata")
def server_metadata() -> ServerMetadata:
    return ServerMetadata(name="mepo-stream", version=__version__, extensions=[])


@router.get("/health/live", summary="Server liveness")
def live() -> ServerLive:
    return ServerLive(live=True)


@router.get("/health/ready", summary="Server readiness", responses=errors(503))
def ready(service: Annotated[ServingModel, Depends(get_service)]) -> ServerReady:
    if not all((checks := service.readiness()["checks"]).values()):
        raise ApiError(503, f"not ready: {', '.join(k for k, ok in checks.items() if not ok)} false", "not_ready")
    return ServerReady(ready=True)


def _statistics(name: str, service: ServingModel) -> ModelStatistics:
    """Triton's per-model statistics from the service's Prometheus series (both protocols: one model serves
    them); durations in nanoseconds, successes being the 200 answers."""
    metrics = service.metrics
    counts = [s for m in metrics.predict_requests.collect() for s in m.samples if s.name.endswith("_total")]
    success = int(sum(s.value for s in counts if s.labels["status"] == "200"))
    seconds = metrics.registry.get_sample_value("mepo_predict_duration_seconds_sum") or 0.0
    return ModelStatistics(
        name=name, version=str(service.snapshot.version), last_inference=0, inference_count=success,
        execution_count=success,
        inference_stats={"success": {"count": success, "ns": int(seconds * 1e9)},
                         "fail": {"count": int(sum(s.value for s in counts)) - success, "ns": 0}},
    )


# declared before /models/{name}, which would match it
@router.get("/models/stats", summary="Statistics of every model (Triton's statistics extension)",
            responses=errors(503))
def all_statistics(service: Annotated[ServingModel, Depends(get_service)],
                   settings: Annotated[ServeConfig, Depends(get_settings)]) -> ModelStatisticsList:
    return ModelStatisticsList(model_stats=[_statistics(settings.model_name, service)])


@router.get("/models/{name}", summary="Model metadata", responses=errors(404, 422))
def model_metadata(name: ModelName, settings: Annotated[ServeConfig, Depends(get_settings)]) -> ModelMetadata:
    _model(name, settings)
    return ModelMetadata(
        name=name, versions=[], platform="pytorch",
        inputs=[{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        outputs=[{"name": "label", "datatype": "INT64", "shape": [-1, -1]},
                 {"name": "probability", "datatype": "FP32", "shape": [-1, -1]}],
    )


@router.get("/models/{name}/ready", summary="Model readiness", responses=errors(404, 422, 503))
def model_ready(name: ModelName, service: Annotated[ServingModel, Depends(get_service)],
                settings: Annotated[ServeConfig, Depends(get_settings)]) -> ModelReady:
    _model(name, settings)
    return ModelReady(name=name, ready=bool(service.snapshot.exposed))


@router.get("/models/{name}/config", summary="Model configuration (Triton's model-configuration extension)",
            responses=errors(404, 422))
def model_config(name: ModelName, settings: Annotated[ServeConfig, Depends(get_settings)]) -> ModelConfiguration:
    _model(name, settings)
    return ModelConfiguration(
        name=name, platform="pytorch", backend="mepo-stream", max_batch_size=0,
        input=[{"name": INPUT_NAME, "data_type": "TYPE_STRING", "dims": [-1]}],
        output=[{"name": "label", "data_type": "TYPE_INT64", "dims": [-1, -1]},
                {"name": "probability", "data_type": "TYPE_FP32", "dims": [-1, -1]}],
        parameters={"top_k": {"string_value": str(settings.top_k)},
                    "max_images": {"string_value": str(settings.max_files)}},
    )


@router.get("/models/{name}/stats", summary="Model statistics (Triton's statistics extension)",
            responses=errors(404, 422, 503))
def model_statistics(name: ModelName, service: Annotated[ServingModel, Depends(get_service)],
                     settings: Annotated[ServeConfig, Depends(get_settings)]) -> ModelStatisticsList:
    _model(name, settings)
    return ModelStatisticsList(model_stats=[_statistics(name, service)])


@router.post("/repository/index", summary="Model repository index (Triton's model-repository extension)",
             responses=errors(503))
def repository_index(service: Annotated[ServingModel, Depends(get_service)],
                     settings: Annotated[ServeConfig, Depends(get_settings)]) -> list[RepositoryModel]:
    ready = bool(service.snapshot.exposed)
    return [RepositoryModel(name=settings.model_name, version=str(service.snapshot.version),
                            state="READY" if ready else "UNAVAILABLE",
                            reason="" if ready else "no classes learned yet")]


def _decode_b64(item: str, index: int) -> bytes:
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ApiError(400, f"inputs[0].data[{index}] is not valid base64", "invalid_request") from e


@router.post("/models/{name}/infer", summary="Inference", responses=errors(400, 404, 413, 422, 503))
async def infer(name: ModelName, request: InferRequest, service: Annotated[ServingModel, Depends(get_service)],
                settings: Annotated[ServeConfig, Depends(get_settings)]) -> InferResponse:
    _model(name, settings)
    top_k = (request.parameters and request.parameters.top_k) or settings.top_k
    tensor = request.inputs[0]
    if tensor.shape != [len(tensor.data)]:
        raise ApiError(400, f"shape {tensor.shape} does not match {len(tensor.data)} data items", "invalid_request")
    items = [(f"{tensor.name}[{i}]", _decode_b64(d, i)) for i, d in enumerate(tensor.data)]
    meta, rows = await run_in_threadpool(predict_uploads, service, items, settings, top_k)
    k = len(rows[0])
    return InferResponse(
        model_name=name, model_version=str(meta["model_version"]), id=request.id,
        parameters={"samples_seen": meta["samples_seen"], "names": [[c["name"] for c in r] for r in rows]},
        outputs=[
            {"name": "label", "datatype": "INT64", "shape": [len(rows), k],
             "data": [c["label"] for r in rows for c in r]},
            {"name": "probability", "datatype": "FP32", "shape": [len(rows), k],
             "data": [c["probability"] for r in rows for c in r]},
        ],
    )
