"""The typed answers of every route: what the OpenAPI schema promises and what the routes return.

Each route declares one of these as its return type, so FastAPI validates and serialises the answer against
the model the served schema shows; the fuzz test (``tests/test_reliability.py``, schemathesis's
``response_schema_conformance``) checks real answers against it. Errors are ``server.web.dependencies.ErrorBody``.

Example:
    >>> Label(label=3, name="cat", probability=0.91).model_dump()
    {'label': 3, 'name': 'cat', 'probability': 0.91}
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.status import Readiness, Status

__all__ = ["Readiness", "Status"]  # the operations routes' answers, which the roles build (server.status)


# --- /v1 ----------------------------------------------------------------------------------------------------------
class Label(BaseModel):
    """One of an image's top-k classes."""

    label: int = Field(description="The class's original label")
    name: str = Field(description="The class's name")
    probability: float = Field(ge=0, le=1)


class FilePrediction(BaseModel):
    filename: str = Field(description="The upload's file name (``body`` for a raw image body)")
    top_k: list[Label] = Field(description="Most probable classes first, over the classes seen so far")
    novelty: float | None = Field(description="How likely the image is of a class not learned yet: higher is more "
                                              "likely (the score the learner's --novelty.score names)")
    novel: bool | None = Field(description="The score is above the threshold calibrated on the stream to "
                                           "--novelty.false_alarm: answered as a class not learned yet")


class PredictResponse(BaseModel):
    """``POST /v1/predict``: the predictions and the model version that made them."""

    model_config = ConfigDict(protected_namespaces=())
    model_version: int = Field(description="The version of the model that answered")
    samples_seen: int = Field(description="Samples that model had learned")
    novelty_threshold: float | None = Field(description="Above it an image is answered as novel (null: not "
                                                        "calibrated yet, nothing is)")
    predictions: list[FilePrediction]


class Liveness(BaseModel):
    status: Literal["ok"]


class Action(BaseModel):
    """What an admin action did (``checkpoint requested``, ``paused``, ``resumed``)."""

    status: str


# --- /v2: the Open Inference Protocol (and Triton's extensions) ---------------------------------------------------
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
    novelty_threshold: float | None = Field(None, description="Above it ``novel`` is true (null: not calibrated "
                                                              "yet)")


class InferResponse(BaseModel):
    """``label`` (INT64 [N, k]), ``probability`` (FP32 [N, k]), ``novelty`` (FP32 [N]) and ``novel`` (BOOL [N])
    per request."""

    model_config = ConfigDict(protected_namespaces=())
    model_name: str
    model_version: str
    id: str | None
    parameters: InferParametersOut
    outputs: list[InferOutput]
