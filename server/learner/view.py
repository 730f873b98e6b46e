"""What a learner's state shows of itself: a read-only copy (``LearnerState.view``) the reporter turns into
``/v1/status`` and the Prometheus gauges, never holding the state itself."""

from __future__ import annotations

from dataclasses import dataclass

from mepo_stream.anytime import AnytimeCurve
from mepo_stream.label_join import LabelJoin


@dataclass(frozen=True)
class GroupView:
    """A learner in a group (``--kafka.state_topic``): who learns which partitions, and each partition's samples."""

    learner_id: str
    learners: dict[str, dict]  # per learner: its ``partitions``, ``samples_per_second`` and ``lag`` per partition
    partition_samples: dict[str, int]  # what the model holds of each partition: own sums, or another's newest state


@dataclass(frozen=True)
class LearnerView:
    """One learner's progress, accuracy and stream counters at one moment."""

    samples_seen: int
    version: int
    classes_seen: int
    class_names: dict[int, str]
    curve: AnytimeCurve  # the any-time accuracy curve (empty without a test set)
    class_accuracy: dict[int, float]  # per class id, of the latest evaluation
    idle_evaluation_due: bool  # the stream went idle after new learning and its accuracy there is not measured yet
    prequential_samples: int
    prequential_cumulative: float
    prequential_rolling: float
    drift_events: list[dict]
    dead_lettered: int
    replays_skipped: int
    last_checkpoint_time: float  # wall time (NaN before the first)
    last_learned_time: float  # wall time of the last learned mini-batch (NaN before the first)
    label_join: dict | None  # labels that come later (``join_summary``); None where they come with their images
    group: GroupView | None  # None for a learner alone
    corrections: dict | None = None  # changes applied and refused, and the sample table's size (None: not enabled)
    novelty: dict | None = None  # the novelty score, its calibrated threshold (None: not yet), target, detection rate


def join_summary(join: LabelJoin | None) -> dict | None:
    """Delayed accuracy, label delay and what became of every image and label (None: labels come attached)."""
    if join is None:
        return None
    counts = join.counts()
    return {"delayed_accuracy": join.delayed_accuracy, "scored": join.scored,
            "delay_p50_s": join.delay_quantile(0.5), "delay_p99_s": join.delay_quantile(0.99),
            "images": {"received": counts["images"], "joined": counts["joined"],
                       "in_flight": counts["in_flight"], "waiting": counts["waiting_images"],
                       "expired": counts["expired_images"], "deleted": counts["deleted_images"]},
            "labels": {"waiting": counts["waiting_labels"], "refused": counts["refused_labels"]}}
