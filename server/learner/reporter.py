"""What a learner shows of itself: ``/v1/status`` and the Prometheus gauges, read from its state.

The state (``server.learner.state``) learns and checkpoints; its reporter reads the fields the state keeps
(learner, monitor, curve, book counts, clocks) and writes nothing back. The state tells it to ``export`` when
the model changed; ``status`` is read by the routers (``/v1/status``) and by ``mepo demo``'s summary.

Example (a learner in a group reports its partitions: ``PartitionedReporter``)::

    reporter = state.reporter
    reporter.status()["samples_seen"], reporter.settled(expected=1000)
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from mepo_stream.anytime import AnytimeCurve

if TYPE_CHECKING:
    from server.learner.partitioned import PartitionedState
    from server.learner.state import ServiceState


class StateReporter:
    """Status and metrics of one learner's state."""

    def __init__(self, state: ServiceState):
        self.state = state

    @property
    def curve(self) -> AnytimeCurve:
        """The any-time accuracy curve of the stream so far (empty without a test set)."""
        s = self.state
        return AnytimeCurve() if s.evaluation is None else s.evaluation.curves[s.cfg.alignment.inference_mode]

    @property
    def idle_evaluation_due(self) -> bool:
        """The stream went idle after new learning: measure the accuracy there (A_last of the stream so far)."""
        s = self.state
        return s.evaluation is not None and bool(s.learner.exposed) and s.idle_evaluated_at != s.learner.samples_seen

    def settled(self, expected: int) -> bool:
        """``expected`` samples are learned and the accuracy is measured where they end (``mepo demo``'s exit)."""
        return self.state.samples_seen >= expected and not self.idle_evaluation_due

    def export(self) -> None:  # pragma: no mutate block (reporting: tests/test_deploy.py, test_streaming.py)
        s, m, curve = self.state, self.state.metrics, self.curve
        m.seen_classes.set(len(s.learner.exposed))
        m.model_version.set(s.version)
        if s.monitor.total:
            m.prequential.set(s.monitor.cumulative)
            m.rolling.set(s.monitor.rolling)
        if curve.accuracy:
            m.anytime.set(curve.accuracy[-1])
            m.a_auc.set(curve.a_auc)
        if curve.task_accuracy:
            m.last_accuracy.set(curve.a_last)
        for c, acc in s.class_accuracy.items():
            m.class_accuracy.labels(s.class_names.get(c, str(c))).set(acc)
        if not math.isnan(s.last_learned_time):
            m.last_learned.set(s.last_learned_time)
        if (join := self.label_join()) is not None:
            if join["delayed_accuracy"] is not None:
                m.delayed_accuracy.set(join["delayed_accuracy"])
            for q in ("p50", "p99"):
                if join[f"delay_{q}_s"] is not None:
                    m.label_delay.labels(f"0.{q[1:]}").set(join[f"delay_{q}_s"])
            for state in ("joined", "in_flight", "waiting", "expired"):
                m.join_images.labels(state).set(join["images"][state])
            for state in ("waiting", "refused"):
                m.join_labels.labels(state).set(join["labels"][state])

    def label_join(self) -> dict | None:
        """Labels that come later: delayed accuracy, label delay and what became of every image and label (None:
        labels come with their images)."""
        join = self.state.join
        if join is None:
            return None
        counts = join.counts()
        return {"delayed_accuracy": join.delayed_accuracy, "scored": join.scored,
                "delay_p50_s": join.delay_quantile(0.5), "delay_p99_s": join.delay_quantile(0.99),
                "images": {"received": counts["images"], "joined": counts["joined"],
                           "in_flight": counts["in_flight"], "waiting": counts["waiting_images"],
                           "expired": counts["expired_images"]},
                "labels": {"waiting": counts["waiting_labels"], "refused": counts["refused_labels"]}}

    def status(self) -> dict:  # pragma: no mutate block (reporting: tests/test_streaming.py, test_page.py)
        s, curve = self.state, self.curve
        return {
            "samples_seen": s.samples_seen,
            "classes_seen": len(s.learner.exposed),
            "model_version": s.version,
            "anytime_accuracy": {"last": curve.accuracy[-1] if curve.accuracy else None,
                                 "a_auc": curve.a_auc if curve.accuracy else None,
                                 "evaluations": len(curve.accuracy), "samples": curve.samples,
                                 "accuracy": curve.accuracy},
            "a_last": curve.a_last if curve.task_accuracy else None,
            "prequential_accuracy": {"cumulative": s.monitor.cumulative if s.monitor.total else None,
                                     "rolling": s.monitor.rolling if s.monitor.total else None,
                                     "samples": s.monitor.total},
            "drift_events": s.monitor.events,
            "dead_lettered": s.book.dead_lettered,
            "replays_skipped": s.book.replays_skipped,
            "checkpoint_age_seconds": None if math.isnan(s.last_checkpoint_time)
            else round(time.time() - s.last_checkpoint_time, 1),
            "idle_seconds": None if math.isnan(s.last_learned_time) else round(time.time() - s.last_learned_time, 1),
            "class_accuracy": {s.class_names.get(c, str(c)): acc for c, acc in sorted(s.class_accuracy.items())},
            "label_join": self.label_join(),
        }


class PartitionedReporter(StateReporter):
    """A learner in a group also reports each learner's partitions, rate and lag, and each partition's samples."""

    state: PartitionedState

    def partition_samples(self) -> dict[str, int]:
        """What the model holds of each partition: its own sums, or the newest state another learner wrote."""
        s = self.state
        return {k: st.stats.samples for k, st in s.remote.items()} | {k: st.samples for k, st in s.own.items()}

    def export(self) -> None:  # pragma: no mutate block (reporting: tests/test_scale_out.py)
        super().export()
        for key, n in self.partition_samples().items():
            self.state.metrics.partition_samples.labels(key.rsplit(":", 1)[1]).set(n)

    def status(self) -> dict:  # pragma: no mutate block (reporting: tests/test_scale_out.py)
        """The merged model's status, each learner's partitions, rate and lag, and each partition's samples."""
        s = self.state
        with s.lock:
            samples = self.partition_samples()
            then, learned = s.rate_mark
            rate = round((s.learned_here - learned) / max(time.monotonic() - then, 1e-3), 1)  # since the last persist
            learners = {s.learner_id: {"partitions": sorted(s.own), "samples_per_second": rate,
                                       "lag": {k: int(s.lag.get(k, 0)) for k in sorted(s.own)}}}
            for key, state in sorted(s.remote.items()):
                entry = learners.setdefault(state.learner, {"partitions": [], "samples_per_second": state.rate,
                                                            "lag": {}})
                entry["partitions"].append(key)
                entry["lag"][key] = state.lag
        return {**super().status(), "learner_id": s.learner_id, "learners": learners,
                "partition_samples": dict(sorted(samples.items()))}
