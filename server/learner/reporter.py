"""What a learner shows of itself: ``/v1/status`` and the Prometheus series, read from its state's view.

It reads a ``LearnerView`` the state makes on demand and writes nothing back; every read of ``/metrics`` exports
first, so ``/metrics`` and ``/v1/status`` say the same at every moment.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from mepo_stream.anytime import AnytimeCurve
from server.consumer import LoopHealth
from server.learner.consumer import PartitionKey
from server.learner.view import LearnerView
from server.metrics import ServerMetrics
from server.status import LearnerStatus


class StateReporter:
    """Status and metrics of one learner, from the views ``view`` makes."""

    def __init__(self, view: Callable[[], LearnerView], metrics: ServerMetrics):
        self.view, self.metrics = view, metrics
        metrics.read_from(self.export)  # /metrics reads the view /v1/status reads, when it is read

    @property
    def curve(self) -> AnytimeCurve:
        """The any-time accuracy curve of the stream so far (empty without a test set)."""
        return self.view().curve

    @property
    def idle_evaluation_due(self) -> bool:
        """The stream went idle after new learning: measure the accuracy there (A_last of the stream so far)."""
        return self.view().idle_evaluation_due

    def settled(self, expected: int) -> bool:
        """``expected`` samples are learned and the accuracy is measured where they end (``mepo demo``'s exit)."""
        v = self.view()
        return v.samples_seen >= expected and not v.idle_evaluation_due

    def export(self) -> None:  # pragma: no mutate block (reporting: tests/test_deploy.py, test_streaming.py)
        v, m = self.view(), self.metrics
        m.seen_classes.set(v.classes_seen)
        m.model_version.set(v.version)
        if v.prequential_samples:
            m.prequential.set(v.prequential_cumulative)
            m.rolling.set(v.prequential_rolling)
        if v.curve.accuracy:
            m.anytime.set(v.curve.accuracy[-1])
            m.a_auc.set(v.curve.a_auc)
        if v.curve.novelty_auroc and v.curve.novelty_auroc[-1] is not None:
            m.novelty_auroc.set(v.curve.novelty_auroc[-1])
        if v.novelty is not None and v.novelty["threshold"] is not None:
            m.novelty_threshold.set(v.novelty["threshold"])
        if v.curve.task_accuracy:
            m.last_accuracy.set(v.curve.a_last)
        for c, acc in v.class_accuracy.items():
            m.class_accuracy.labels(v.class_names.get(c, str(c))).set(acc)
        if not math.isnan(v.last_learned_time):
            m.last_learned.set(v.last_learned_time)
        if (join := v.label_join) is not None:
            self._export_join(join)
        if (corrections := v.corrections) is not None:
            for kind in ("corrections", "deletions"):
                for outcome in ("applied", "refused"):
                    m.changes.set((kind, outcome), corrections[f"{kind}_{outcome}"])
            m.table_ids.set(corrections["ids"])
            m.table_bytes.set(corrections["bytes_on_disk"])
        if v.group is not None:
            for key, n in v.group.partition_samples.items():
                m.partition_samples.labels(PartitionKey.parse(key).partition).set(n)

    def _export_join(self, join: dict) -> None:  # pragma: no mutate block (reporting: tests/test_labels_later.py)
        m = self.metrics
        if join["delayed_accuracy"] is not None:
            m.delayed_accuracy.set(join["delayed_accuracy"])
        for q in ("p50", "p99"):
            if join[f"delay_{q}_s"] is not None:
                m.label_delay.labels(f"0.{q[1:]}").set(join[f"delay_{q}_s"])
        for outcome in ("received", "joined", "expired", "deleted"):
            m.join_images.set((outcome,), join["images"][outcome])
        for state in ("waiting", "in_flight"):
            m.join_pending.labels(state).set(join["images"][state])
        m.join_labels_waiting.set(join["labels"]["waiting"])
        m.join_labels_refused.set((), join["labels"]["refused"])

    def status(self, health: LoopHealth) -> LearnerStatus:  # pragma: no mutate block (reporting: test_streaming.py)
        """``/v1/status``: the view, with the learning thread's ``health``."""
        v = self.view()
        curve, seen = v.curve, v.prequential_samples
        group = {} if v.group is None else {  # each learner's partitions, rate and lag, and each partition's samples
            "learner_id": v.group.learner_id, "learners": v.group.learners,
            "partition_samples": dict(sorted(v.group.partition_samples.items()))}
        return LearnerStatus.model_validate({
            **health.status_fields(), "learner_error": health.error,
            "samples_seen": v.samples_seen, "classes_seen": v.classes_seen, "model_version": v.version,
            "anytime_accuracy": {"last": curve.accuracy[-1] if curve.accuracy else None,
                                 "a_auc": curve.a_auc if curve.accuracy else None,
                                 "evaluations": len(curve.accuracy), "samples": curve.samples,
                                 "accuracy": curve.accuracy, "novelty_auroc": curve.novelty_auroc,
                                 "novelty_auroc_mean": None if math.isnan(curve.novelty_auroc_mean)
                                 else curve.novelty_auroc_mean},
            "a_last": curve.a_last if curve.task_accuracy else None, "novelty": v.novelty,
            "prequential_accuracy": {"cumulative": v.prequential_cumulative if seen else None,
                                     "rolling": v.prequential_rolling if seen else None, "samples": seen},
            "drift_events": v.drift_events, "dead_lettered": v.dead_lettered, "replays_skipped": v.replays_skipped,
            "checkpoint_age_seconds": None if math.isnan(v.last_checkpoint_time)
            else round(time.time() - v.last_checkpoint_time, 1),
            "idle_seconds": None if math.isnan(v.last_learned_time) else round(time.time() - v.last_learned_time, 1),
            "class_accuracy": {v.class_names.get(c, str(c)): acc for c, acc in sorted(v.class_accuracy.items())},
            "label_join": v.label_join, "corrections": v.corrections, **group})
