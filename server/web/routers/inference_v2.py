"""The Open Inference Protocol (KServe v2) REST routes and their models, for KServe/Triton-style clients.

Images travel as one ``BYTES`` input (``server.oip``): in JSON, ``data`` holds base64-encoded files; in Triton's
binary tensor data extension (``tritonclient.http``'s default), they follow a JSON header of
``Inference-Header-Content-Length`` bytes whose input gives ``parameters.binary_data_size``. An output asked for with
``binary_data`` (or every output, with ``parameters.binary_data_output``) comes back raw after a JSON header alike.
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.config import JsonDict
from starlette.concurrency import run_in_threadpool

from mepo_stream import __version__
from server import oip
from server.serving import ServingModel
from server.web.dependencies import ApiError, Service, Settings, errors, served_model
from server.web.prediction import predict_uploads

router = APIRouter(prefix="/v2", tags=["open inference protocol"], strict_content_type=False)
HEADER_LENGTH = "inference-header-content-length"
ModelName = Annotated[str, Path(description="The served model's name (`--model_name`)", examples=["mepo"])]
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]
"""The protocol's extensions (Triton's names) that ``GET /v2`` tells clients they may call (of the model repository's,
only the index is here)."""


BASE64 = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
"""Standard padded base64: the schema tells clients, and the validation refuses, what the route could not decode."""


class TensorParameters(BaseModel):
    """A tensor's parameters: ``binary_data_size`` (an input's raw bytes after the JSON header) and
    ``binary_data`` (an output wanted raw); others are ignored, as the protocol lets parameters carry any key."""

    model_config = ConfigDict(extra="allow", strict=True)
    binary_data_size: int = Field(default=None, ge=0)  # type: ignore[assignment]  # absent, never null
    binary_data: bool = Field(default=None)  # type: ignore[assignment]


DATA_OR_RAW: JsonDict = {"oneOf": [{"required": ["data"]}, {"required": ["parameters"], "properties": {
    "parameters": {"type": "object", "required": ["binary_data_size"]}}}]}
"""An input's data is in ``data`` or raw after the JSON header, never both (``InferInput``'s check, in JSON Schema)."""


class InferInput(BaseModel):
    """The images: a ``BYTES`` tensor of shape ``[N]``, one base64 string per encoded image in ``data``, or its
    raw form after the JSON header (``parameters.binary_data_size``). The schema says all it can; ``shape``
    matching the data and the data decoding to images are checked by the route: 400, 422. The protocol names a
    tensor's fields, so any other is refused."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=DATA_OR_RAW)
    name: str
    shape: list[Annotated[int, Field(ge=1)]] = Field(min_length=1, max_length=1)
    datatype: Literal["BYTES"]
    parameters: TensorParameters = Field(default=None)  # type: ignore[assignment]
    data: list[Annotated[str, Field(pattern=BASE64)]] = Field(default=None, min_length=1)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def data_or_raw(self) -> InferInput:
        """Both, or neither, would leave the route guessing which bytes are the images."""
        if (self.data is None) == (self.raw_size is None):
            raise ValueError("an input needs either data or parameters.binary_data_size, not both")
        return self

    @property
    def raw_size(self) -> int | None:
        """The bytes of this input after the JSON header (None: its data is in ``data``)."""
        return None if self.parameters is None else self.parameters.binary_data_size


class RequestedOutput(BaseModel):
    """An output the answer should hold (all of them when none is named), raw with ``parameters.binary_data``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: Literal["label", "probability", "novelty", "novel"]
    parameters: TensorParameters = Field(default=None)  # type: ignore[assignment]


class InferParameters(BaseModel):
    """Request parameters: ``top_k``, strictly a JSON integer (never a string, float or bool to coerce), and
    ``binary_data_output`` (every output raw); other parameters clients send are ignored."""

    model_config = ConfigDict(extra="allow", strict=True)
    top_k: int = Field(default=None, ge=1, le=oip.MAX_TOP_K,  # type: ignore[assignment]
                       description="labels per image; default the server's --top_k")
    binary_data_output: bool = Field(default=False)


class InferRequest(BaseModel):
    """An inference request. Fields besides the protocol's are ignored, not refused: KServe's own client sends
    ``model_name`` here."""

    model_config = ConfigDict(strict=True)
    id: str | None = None
    parameters: InferParameters = Field(default=None)  # type: ignore[assignment]
    inputs: list[InferInput] = Field(min_length=1, max_length=1)
    outputs: list[RequestedOutput] = Field(default=None)  # type: ignore[arg-type]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ServerLive(BaseModel):
    live: bool


class ServerReady(BaseModel):
    ready: bool


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ModelReady(BaseModel):
    name: str
    ready: bool


class ConfigTensor(BaseModel):
    name: str
    data_type: str
    dims: list[int]


class StringValue(BaseModel):
    string_value: str


class ModelConfiguration(BaseModel):
    """Triton's model-configuration extension."""

    name: str
    platform: str
    backend: str
    max_batch_size: int
    input: list[ConfigTensor]
    output: list[ConfigTensor]
    parameters: dict[str, StringValue]


class Duration(BaseModel):
    count: int
    ns: int


class InferenceStatistics(BaseModel):
    success: Duration
    fail: Duration


class ModelStatistics(BaseModel):
    name: str
    version: str
    last_inference: int
    inference_count: int
    execution_count: int
    inference_stats: InferenceStatistics


class ModelStatisticsList(BaseModel):
    """Triton's statistics extension."""

    model_stats: list[ModelStatistics]


class RepositoryModel(BaseModel):
    """An entry of Triton's model-repository index."""

    name: str
    version: str
    state: Literal["READY", "UNAVAILABLE"]
    reason: str


class RawSize(BaseModel):
    binary_data_size: int = Field(description="Bytes of this output in the raw data after the JSON header")


class InferOutput(BaseModel):
    """An output in JSON (``data``, row-major), or raw after the JSON header (``parameters.binary_data_size``)."""

    name: str
    datatype: Literal["INT64", "FP32", "BOOL"]
    shape: list[int]
    data: list[int] | list[float] | list[bool] | None = None
    parameters: RawSize | None = None


class InferParametersOut(BaseModel):
    samples_seen: int
    names: list[list[str]] = Field(description="The class name of each label, per image")
    novelty_threshold: float | None = Field(None, description="Above it ``novel`` is true (null: not calibrated yet)")


class InferResponse(BaseModel):
    """``label`` (INT64 [N, k]), ``probability`` (FP32 [N, k]), ``novelty`` (FP32 [N]) and ``novel`` (BOOL [N])
    per request."""

    model_config = ConfigDict(protected_namespaces=())
    model_name: str
    model_version: str
    id: str | None
    parameters: InferParametersOut
    outputs: list[InferOutput]


def inline_schema(model: type[BaseModel]) -> dict:
    """``model``'s JSON schema with every ``$ref`` replaced by its definition (an OpenAPI ``requestBody`` written
    by hand cannot point into pydantic's ``$defs``)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "").removeprefix("#/$defs/")
            return resolve(defs[ref]) if ref else {k: resolve(v) for k, v in node.items()}
        return [resolve(v) for v in node] if isinstance(node, list) else node

    return resolve(schema)


INFER_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": inline_schema(
    InferRequest)}}}}
"""The infer route reads its body itself (a binary-extension body is not JSON), so the schema is declared here."""


@router.get("", summary="Server metadata")
def server_metadata() -> ServerMetadata:
    return ServerMetadata(name="mepo-stream", version=__version__, extensions=EXTENSIONS)


@router.get("/health/live", summary="Server liveness")
def live() -> ServerLive:
    return ServerLive(live=True)


@router.get("/health/ready", summary="Server readiness", responses=errors(503))
def ready(service: Service) -> ServerReady:
    if not (readiness := service.readiness()).ready:
        failed = ", ".join(k for k, ok in readiness.checks.items() if not ok)
        raise ApiError(503, f"not ready: {failed} false", "not_ready")
    return ServerReady(ready=True)


def _statistics(name: str, service: ServingModel) -> ModelStatistics:
    """Triton's per-model statistics from the Prometheus series of both protocols; successes are the 200 answers."""
    metrics = service.metrics
    counts = [s for m in metrics.predict_requests.collect() for s in m.samples if s.name.endswith("_total")]
    success = int(sum(s.value for s in counts if s.labels["status"] == "200"))
    ns = int((metrics.registry.get_sample_value("mepo_predict_duration_seconds_sum") or 0.0) * 1e9)
    failed = int(sum(s.value for s in counts)) - success
    stats = InferenceStatistics(success=Duration(count=success, ns=ns), fail=Duration(count=failed, ns=0))
    return ModelStatistics(name=name, version=str(service.snapshot.version), last_inference=0, inference_count=success,
                           execution_count=success, inference_stats=stats)


# declared before /models/{name}, which would match it
@router.get("/models/stats", summary="Statistics of every model (Triton's statistics extension)", responses=errors(503))
def all_statistics(service: Service, settings: Settings) -> ModelStatisticsList:
    return ModelStatisticsList(model_stats=[_statistics(settings.model_name, service)])


@router.get("/models/{name}", summary="Model metadata", responses=errors(404, 422))
def model_metadata_route(name: ModelName, settings: Settings) -> ModelMetadata:
    served_model(name, settings)
    return ModelMetadata(**oip.model_metadata(name))


@router.get("/models/{name}/ready", summary="Model readiness", responses=errors(404, 422, 503))
def model_ready(name: ModelName, service: Service, settings: Settings) -> ModelReady:
    served_model(name, settings)
    return ModelReady(name=name, ready=bool(service.snapshot.exposed))


@router.get("/models/{name}/config", summary="Model configuration (Triton's model-configuration extension)",
            responses=errors(404, 422))
def model_config(name: ModelName, settings: Settings) -> ModelConfiguration:
    served_model(name, settings)
    return ModelConfiguration(
        name=name, platform="pytorch", backend="mepo-stream", max_batch_size=0,
        input=[ConfigTensor(name=oip.INPUT_NAME, data_type=oip.TRITON_TYPES["BYTES"], dims=[-1])],
        output=[ConfigTensor(name=out, data_type=oip.TRITON_TYPES[kind], dims=oip.SHAPES[out])
                for out, kind in oip.OUTPUTS.items()],
        parameters={"top_k": StringValue(string_value=str(settings.top_k)),
                    "max_images": StringValue(string_value=str(settings.max_files))})


@router.get("/models/{name}/stats", summary="Model statistics (Triton's statistics extension)",
            responses=errors(404, 422, 503))
def model_statistics(name: ModelName, service: Service, settings: Settings) -> ModelStatisticsList:
    served_model(name, settings)
    return ModelStatisticsList(model_stats=[_statistics(name, service)])


@router.post("/repository/index", summary="Model repository index (Triton's model-repository extension)",
             responses=errors(503))
def repository_index(service: Service, settings: Settings) -> list[RepositoryModel]:
    ready = bool(service.snapshot.exposed)
    return [RepositoryModel(name=settings.model_name, version=str(service.snapshot.version),
                            state="READY" if ready else "UNAVAILABLE",
                            reason="" if ready else "no classes learned yet")]


def parse_infer(body: bytes, header_length: str | None) -> tuple[InferRequest, list[bytes]]:
    """The request and its images' bytes, from a JSON body or a binary-extension one (``header_length`` bytes of
    JSON, then the raw input): 422 for a request the schema refuses, 400 for parts that disagree."""
    if header_length is not None and not (header_length.isdigit() and int(header_length) <= len(body)):
        raise ApiError(400, f"Inference-Header-Content-Length {header_length!r} is not a length within the "
                            f"{len(body)}-byte body", "invalid_request")
    split = len(body) if header_length is None else int(header_length)
    try:
        request = InferRequest.model_validate_json(body[:split])
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e
    tensor, raw = request.inputs[0], memoryview(body)[split:]
    if tensor.data is not None:  # base64 (``BASE64``), and no binary_data_size (``InferInput.data_or_raw``)
        items = [base64.b64decode(d) for d in tensor.data]
    elif tensor.raw_size != len(raw):
        raise ApiError(400, f"inputs[0] says {tensor.raw_size} binary bytes but {len(raw)} follow the JSON header",
                       "invalid_request")
    else:
        try:
            items = oip.deserialize_bytes(raw, tensor.shape[0])
        except oip.TensorError as e:
            raise ApiError(400, f"inputs[0]: {e}", "invalid_request") from e
    if tensor.shape != [len(items)]:
        raise ApiError(400, f"shape {tensor.shape} does not match {len(items)} data items", "invalid_request")
    return request, items


def infer_answer(name: str, request: InferRequest, meta: dict, rows: list[dict]) -> InferResponse | Response:
    """The outputs asked for (all by default), in JSON, or with the raw ones after a JSON header."""
    arrays, default_raw = oip.output_arrays(rows), bool(request.parameters and request.parameters.binary_data_output)
    asked = request.outputs or [RequestedOutput.model_validate({"name": out}) for out in oip.OUTPUTS]
    outputs: list[InferOutput] = []
    raw: list[bytes] = []
    for out in asked:
        array = arrays[out.name]  # [N, k]
        tensor = InferOutput.model_validate({"name": out.name, "datatype": oip.OUTPUTS[out.name],
                                             "shape": list(array.shape)})
        wants_raw = out.parameters and out.parameters.binary_data  # None: as ``binary_data_output`` says
        if default_raw if wants_raw is None else wants_raw:
            raw.append(array.tobytes())
            tensor.parameters = RawSize(binary_data_size=len(raw[-1]))
        else:
            tensor.data = array.ravel().tolist()
        outputs.append(tensor)
    answer = InferResponse(model_name=name, model_version=str(meta["model_version"]), id=request.id,
                           parameters=InferParametersOut(samples_seen=meta["samples_seen"],
                                                         names=[[c["name"] for c in r["top_k"]] for r in rows],
                                                         novelty_threshold=meta["novelty_threshold"]),
                           outputs=outputs)
    if not raw:
        return answer
    header = json.dumps(answer.model_dump(exclude_none=True)).encode()
    return Response(header + b"".join(raw), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(header))})


@router.post("/models/{name}/infer", summary="Inference", response_model=InferResponse, openapi_extra=INFER_BODY,
             response_model_exclude_none=True, responses=errors(400, 404, 413, 422, 503))
async def infer(name: ModelName, raw: Request, service: Service, settings: Settings) -> Any:
    served_model(name, settings)
    request, items = parse_infer(await raw.body(), raw.headers.get(HEADER_LENGTH))
    top_k = (request.parameters and request.parameters.top_k) or settings.top_k
    named = [(f"{request.inputs[0].name}[{i}]", data) for i, data in enumerate(items)]
    meta, rows = await run_in_threadpool(predict_uploads, service, named, settings, top_k)
    return infer_answer(name, request, meta, rows)
