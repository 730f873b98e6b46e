"""What a running service says of itself, typed: ``/v1/status`` and ``/readyz``, one model per role, told apart
by ``role``; here, so that the roles that build them need not import the web layer.

Example:
    >>> from pydantic import TypeAdapter
    >>> answer = {"role": "replica", "checks": {"snapshot_loaded": False}, "follower_error": None}
    >>> ready = TypeAdapter(Readiness).validate_python(answer)
    >>> type(ready).__name__, ready.status
    ('ReplicaReadiness', 'not_ready')
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

CHILD_ERROR = ("Why a process this command started (mepo demo's producer or broker) stopped before its work was "
               "done, if one did")


class AnytimeAccuracy(BaseModel):
    """Accuracy on the held-out images of the classes seen so far, at each scheduled evaluation."""

    last: float | None
    a_auc: float | None = Field(description="Area under the any-time accuracy curve (the paper's A_AUC)")
    evaluations: int
    samples: list[int] = Field(description="Samples seen at each evaluation")
    accuracy: list[float]
    novelty_auroc: list[float | None] = Field(description="At each evaluation: the AUROC of the novelty score "
                                              "telling test images of classes not learned yet from learned ones "
                                              "(null while no class, or every class, is learned)")
    novelty_auroc_mean: float | None = Field(description="Their mean over the stream so far")


class NoveltyStatus(BaseModel):
    """The novelty score the answers carry, and its threshold calibrated on the stream."""

    score: str = Field(description="The score answered with (--novelty.score, or energy without the LDA)")
    threshold: float | None = Field(description="Above it an answer is novel (null: not calibrated yet)")
    false_alarm: float = Field(description="The target share of learned classes' images answered as novel")
    detection: float | None = Field(description="Share of the stream's images of a class new to the learner that "
                                                "it would have flagged just before learning them (recent ones "
                                                "weigh more)")


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


class HeldSample(BaseModel):
    """``GET /v1/samples/{id}``: what the learner holds of a learned id, which a correction or deletion acts on."""

    id: str
    label: int = Field(description="The label it is learned with now (its latest correction's)")
    class_name: str
    time: float = Field(description="Record time (s since the epoch) of its latest label: retention counts from it")
    file: str | None = Field(description="Its image's file, relative to the dataset's root, where its id names one "
                                         "(a replayed image's: ``<stream id>/<file>``)")


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


class ServiceStatus(BaseModel):
    """What every role reports: the model it serves and the health of its Kafka thread."""

    model_config = ConfigDict(protected_namespaces=())
    samples_seen: int
    classes_seen: int
    model_version: int
    paused: bool
    kafka_connected: bool
    consumer_lag: dict[str, int] = Field(description="Records not yet learned (or snapshots not yet read), per "
                                                     "topic:partition")


class LearnerStatus(ServiceStatus):
    """``GET /v1/status`` of a learner: its learning, accuracy and stream health (and, in a group, its learners and
    partitions)."""

    role: Literal["learner"] = "learner"
    learner_error: str | None = Field(description="Why the learning thread stopped, if it did")
    child_error: str | None = Field(default=None, description=CHILD_ERROR)
    anytime_accuracy: AnytimeAccuracy
    a_last: float | None
    novelty: NoveltyStatus
    prequential_accuracy: PrequentialAccuracy
    drift_events: list[DriftEvent]
    dead_lettered: int
    replays_skipped: int
    checkpoint_age_seconds: float | None
    idle_seconds: float | None
    class_accuracy: dict[str, float]
    label_join: LabelJoinStatus | None = Field(description="Labels that come later; null where they come inline")
    corrections: CorrectionsStatus | None = Field(description="null unless --corrections.enabled")
    learner_id: str | None = Field(None, description="In a group (--kafka.state_topic): this learner")
    learners: dict[str, GroupLearner] | None = None
    partition_samples: dict[str, int] | None = None


class ReplicaStatus(ServiceStatus):
    """``GET /v1/status`` of a prediction replica: the snapshot it serves, its age and lag."""

    role: Literal["replica"] = "replica"
    follower_error: str | None = Field(description="Why the thread following the snapshots stopped, if it did")
    snapshot_loaded: bool
    lag_versions: int | None = Field(description="Versions the learner published past the one served")
    snapshot_age_seconds: float | None
    replicas: dict[str, ReplicaView]


Status = Annotated[LearnerStatus | ReplicaStatus, Field(discriminator="role")]
"""``GET /v1/status``: a learner's or a replica's, told apart by ``role``."""


class ServiceReadiness(BaseModel):
    """``GET /readyz``: 200 when every check is true, else 503 with the same body."""

    checks: dict[str, bool]

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented use on a property
    @property
    def status(self) -> Literal["ready", "not_ready"]:
        return "ready" if self.ready else "not_ready"

    @property
    def ready(self) -> bool:
        return all(self.checks.values())


class LearnerReadiness(ServiceReadiness):
    role: Literal["learner"] = "learner"
    learner_error: str | None = Field(description="Why the learning thread stopped, if it did")
    publisher_error: str | None = Field(description="Why the snapshot publisher stopped, if a bug stopped it")
    child_error: str | None = Field(default=None, description=CHILD_ERROR)


class ReplicaReadiness(ServiceReadiness):
    role: Literal["replica"] = "replica"
    follower_error: str | None = Field(description="Why the thread following the snapshots stopped, if it did")


Readiness = Annotated[LearnerReadiness | ReplicaReadiness, Field(discriminator="role")]
"""``GET /readyz``: a learner's or a replica's, told apart by ``role``."""
