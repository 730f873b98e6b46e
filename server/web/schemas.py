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


# --- /v1 ----------------------------------------------------------------------------------------------------------
class Label(BaseModel):
    """One of an image's top-k classes."""

    label: int = Field(description="The class's original label")
    name: str = Field(description="The class's name")
    probability: float = Field(ge=0, le=1)


class FilePrediction(BaseModel):
    filename: str = Field(description="The upload's file name (``body`` for a raw image body)")
    top_k: list[Label] = Field(description="Most probable classes first, over the classes seen so far")


class PredictResponse(BaseModel):
    """``POST /v1/predict``: the predictions and the model version that made them."""

    model_config = ConfigDict(protected_namespaces=())
    model_version: int = Field(description="The version of the model that answered")
    samples_seen: int = Field(description="Samples that model had learned")
    predictions: list[FilePrediction]


class AnytimeAccuracy(BaseModel):
    """Accuracy on the held-out images of the classes seen so far, at each scheduled evaluation."""

    last: float | None
    a_auc: float | None = Field(description="Area under the any-time accuracy curve (the paper's A_AUC)")
    evaluations: int
    samples: list[int] = Field(description="Samples seen at each evaluation")
    accuracy: list[float]


class PrequentialAccuracy(BaseModel):
    """Test-then-train accuracy on the stream itself: each mini-batch predicted before it is learned."""

    cumulative: float | None
    rolling: float | None
    samples: int


class DriftEvent(BaseModel):
    samples_seen: int
    detector: str
    rolling_accuracy: float


class JoinImages(BaseModel):
    """What became of the images that came without a label: received = joined + in_flight + waiting + expired +
    deleted."""

    received: int
    joined: int = Field(description="Learned with their label")
    in_flight: int = Field(description="Joined, waiting for their mini-batch")
    waiting: int = Field(description="Kept (feature or image) until their label comes")
    expired: int = Field(description="Let go unlearned: their label did not come within --join.image_ttl_s, or "
                                     "--join.max_images newer images waited")
    deleted: int = Field(description="Deleted by a tombstone while they waited (--corrections.enabled)")


class JoinLabels(BaseModel):
    waiting: int = Field(description="Labels waiting for their image")
    refused: int = Field(description="Labels sent to the dead-letter topic: duplicate, or no image within "
                                     "--join.label_ttl_s")


class LabelJoinStatus(BaseModel):
    """Labels that come later (``--kafka.labels_topic``): each prediction made when an image arrived, scored when
    its label came, and the join's backlog."""

    delayed_accuracy: float | None = Field(description="Accuracy of the arrival predictions, scored at the join")
    scored: int = Field(description="Joined images that had a prediction (none before the first class is known)")
    delay_p50_s: float | None = Field(description="Median seconds from an image to its label (recent joins)")
    delay_p99_s: float | None
    images: JoinImages
    labels: JoinLabels


class CorrectionsStatus(BaseModel):
    """Corrections and deletions of learned samples (``--corrections.enabled``): the model as the view of the table
    of the latest label of every id that still exists."""

    corrections_applied: int = Field(description="Learned samples moved to their corrected label")
    corrections_refused: int = Field(description="Corrections of ids not correctable (past --corrections.retention_s"
                                                 ", or deleted first): dead-lettered as not_correctable")
    deletions_applied: int = Field(description="Learned samples taken out of the model, and waiting images or labels "
                                               "let go, by a tombstone")
    deletions_refused: int = Field(description="Tombstones of ids not correctable: dead-lettered as not_correctable")
    ids: int = Field(description="Learned ids that can still be corrected or deleted (the sample table's)")
    bytes_on_disk: int = Field(description="The sample table's pages in use")
    retention_s: float


class GroupLearner(BaseModel):
    """A learner of a group (``--kafka.state_topic``): its partitions, learning rate and lag."""

    partitions: list[str]
    samples_per_second: float
    lag: dict[str, int]


class ReplicaView(BaseModel):
    model_config = ConfigDict(protected_namespaces=())
    model_version: int
    samples_seen: int
    lag_versions: int | None
    snapshot_age_seconds: float | None


class Status(BaseModel):
    """``GET /v1/status``. Both roles give the first group of fields; a learner adds its learning and stream
    health (and, in a group, its learners and partitions), a replica its snapshot's age and lag."""

    model_config = ConfigDict(protected_namespaces=())
    samples_seen: int
    classes_seen: int
    model_version: int
    paused: bool
    kafka_connected: bool
    consumer_lag: dict[str, int] = Field(description="Records not yet learned (or snapshots not yet read), per "
                                                     "topic:partition")
    learner_error: str | None = Field(description="Why the Kafka thread stopped, if it did")
    anytime_accuracy: AnytimeAccuracy | None = None
    a_last: float | None = None
    prequential_accuracy: PrequentialAccuracy | None = None
    drift_events: list[DriftEvent] | None = None
    dead_lettered: int | None = None
    replays_skipped: int | None = None
    checkpoint_age_seconds: float | None = None
    idle_seconds: float | None = None
    class_accuracy: dict[str, float] | None = None
    label_join: LabelJoinStatus | None = None
    corrections: CorrectionsStatus | None = None
    learner_id: str | None = None
    learners: dict[str, GroupLearner] | None = None
    partition_samples: dict[str, int] | None = None
    role: Literal["replica"] | None = None
    snapshot_loaded: bool | None = None
    lag_versions: int | None = None
    snapshot_age_seconds: float | None = None
    replicas: dict[str, ReplicaView] | None = None


class Liveness(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    """``GET /readyz``: 200 when every check is true, else 503 with the same body."""

    status: Literal["ready", "not_ready"]
    checks: dict[str, bool]
    learner_error: str | None
    publisher_error: str | None = Field(None, description="Why the snapshot publisher stopped, if a bug stopped it")


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
    datatype: Literal["INT64", "FP32"]
    shape: list[int]
    data: list[int] | list[float] | None = None
    parameters: RawSize | None = None


class InferParametersOut(BaseModel):
    samples_seen: int
    names: list[list[str]] = Field(description="The class name of each label, per image")


class InferResponse(BaseModel):
    """``label`` (INT64 [N, k]) and ``probability`` (FP32 [N, k]) per request."""

    model_config = ConfigDict(protected_namespaces=())
    model_name: str
    model_version: str
    id: str | None
    parameters: InferParametersOut
    outputs: list[InferOutput]
