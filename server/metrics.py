"""Prometheus metrics of the service, on their own registry (one per app, so tests can run several).

A series a role never updates (a learner's learning series, a replica's following ones) is not exported there, so
no dashboard or alert mistakes a replica's zeros for a learner's.

Example:
    >>> from prometheus_client import generate_latest
    >>> text = generate_latest(ServerMetrics("replica").registry).decode()
    >>> "mepo_replica_lag_versions" in text, "mepo_model_version" in text, "mepo_samples_learned_total" in text
    (True, True, False)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Literal

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
PREDICT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
NOVELTY_BUCKETS = (-3000, -1000, -300, -100, -30, -10, 0, 10, 30, 100, 300, 1000, 3000)
"""Novelty scores are differences of squared distances (or minus log-sums): signed, spread over decades."""
SNAPSHOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


def in_registry(registry: CollectorRegistry | None) -> tuple[partial[Counter], partial[Gauge], partial[Histogram]]:
    """Counter, Gauge and Histogram constructors bound to ``registry`` (None: not exported)."""
    return (partial(Counter, registry=registry), partial(Gauge, registry=registry),
            partial(Histogram, registry=registry))


class LiveRegistry(CollectorRegistry):
    """A registry that calls ``refresh`` each time it is read: ``/metrics`` says what ``/v1/status`` says."""

    def __init__(self) -> None:
        super().__init__()
        self.refresh: Callable[[], None] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.refresh is not None:
            self.refresh()
        yield from super().collect()


class Totals(Collector):
    """A counter set to counts kept elsewhere (restored from a checkpoint), exported as ``<name>_total``."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry | None):
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def set(self, labels: Sequence[str], value: float) -> None:
        with self._lock:
            self._values[tuple(labels)] = value

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            for labels, value in sorted(self._values.items()):
                family.add_metric(list(labels), value)
        yield family


class ServerMetrics:
    """Named after Prometheus conventions: base units, ``_total`` counters, ``_ratio`` for 0-1 values."""

    def __init__(self, role: Literal["learner", "replica"] = "learner") -> None:
        self.registry = r = LiveRegistry()
        lr = r if role == "learner" else None  # a metric with no registry works but is not exported
        counter, gauge, histogram = in_registry(lr)  # the learner's own series
        self.samples_learned = counter("mepo_samples_learned", "Samples learned from the stream")
        self.learn_steps = counter("mepo_learn_steps", "Stream mini-batches learned")
        self.records_consumed = counter("mepo_kafka_records_consumed", "Records read from Kafka")
        self.dead_lettered = counter("mepo_records_dead_lettered", "Records sent to the dead-letter topic", ["reason"])
        self.replays_skipped = counter("mepo_replayed_samples_skipped", "Samples of a stream already learned, skipped")
        self.drift = counter("mepo_drift_detections", "Drift detections on the prequential error stream", ["detector"])
        self.step_seconds = histogram("mepo_learn_step_duration_seconds", "Time to learn one stream mini-batch",
                                      buckets=STEP_BUCKETS)
        self.predict_seconds = Histogram("mepo_predict_duration_seconds", "Prediction request latency",
                                         buckets=PREDICT_BUCKETS, registry=r)
        self.predict_requests = Counter("mepo_predict_requests",
                                        "Prediction requests (v1 and v2 protocol), refused ones included",
                                        ["protocol", "status"], registry=r)
        self.prequential = gauge("mepo_prequential_accuracy_ratio", "Cumulative test-then-train accuracy")
        self.rolling = gauge("mepo_rolling_accuracy_ratio", "Test-then-train accuracy over the last samples")
        self.anytime = gauge("mepo_anytime_accuracy_ratio", "Last any-time accuracy on seen-class test images")
        self.a_auc = gauge("mepo_anytime_accuracy_auc_ratio", "A_AUC: mean of the any-time accuracies so far")
        self.last_accuracy = gauge("mepo_last_accuracy_ratio",
                                   "Accuracy on seen-class test images when the stream last went idle (A_last)")
        self.class_accuracy = gauge("mepo_class_accuracy_ratio",
                                    "Accuracy per seen class on its test images, at the latest evaluation",
                                    ["class_name"])
        for g in (self.prequential, self.rolling, self.anytime, self.a_auc, self.last_accuracy):
            g.set(float("nan"))  # not measured yet: a dashboard must not read 0 % accuracy
        self.anytime_evals = counter("mepo_anytime_evaluations", "Any-time evaluations run")
        self.seen_classes = Gauge("mepo_seen_classes", "Classes seen in the stream", registry=r)
        self.lag = gauge("mepo_kafka_consumer_lag_records",
                         "Records not yet learned: behind the high watermark or waiting in a mini-batch", ["partition"])
        self._joining(lr)
        self.last_learned = gauge("mepo_last_learned_timestamp_seconds", "Time the last mini-batch was learned")
        self.checkpoint_seconds = histogram("mepo_checkpoint_duration_seconds", "Checkpoint write time",
                                            buckets=STEP_BUCKETS)
        self.last_checkpoint = gauge("mepo_last_checkpoint_timestamp_seconds", "Time of the last checkpoint")
        self.model_version = Gauge("mepo_model_version", "Version of the served model snapshot", registry=r)
        self.learner_up = gauge("mepo_learner_up", "1 while the learner loop runs and reaches the broker")
        self.info = Info("mepo_model", "Backbone and MePo bundle of the served model", registry=r)
        self._novelty(r, lr)
        self._publishing(lr)
        self._following(r if role == "replica" else None)
        self._grouping(lr)

    def _joining(self, r: CollectorRegistry | None) -> None:
        """Labels that come later (``--kafka.labels_topic``): the join's checkpointed counts, set from it."""
        counter, gauge, _ = in_registry(r)
        self.predictions_published = counter("mepo_predictions_published", "Predictions of images without a label "
                                             "sent to the predictions topic")
        self.delayed_accuracy = gauge("mepo_delayed_accuracy_ratio", "Accuracy of the predictions made when images "
                                      "arrived, scored when their labels were joined")
        self.label_delay = gauge("mepo_label_delay_seconds", "Time from an image's arrival to its label's, over the "
                                 "recent joins", ["quantile"])
        self.join_images = Totals("mepo_label_join_images", "Images that came without a label, by what became of "
                                  "them (received, joined, expired, deleted)", ["outcome"], registry=r)
        self.join_pending = gauge("mepo_label_join_images_pending", "Images without their label now: waiting for it, "
                                  "or joined and in a mini-batch not yet learned", ["state"])
        self.join_labels_waiting = gauge("mepo_label_join_labels_waiting", "Labels waiting for their image")
        self.join_labels_refused = Totals("mepo_label_join_labels_refused", "Labels refused (their image never came, "
                                          "or another label of the id came first)", [], registry=r)
        self.changes = Totals("mepo_sample_changes", "Corrections and deletions of learned samples, applied or "
                              "refused (--corrections.enabled)", ["kind", "outcome"], registry=r)
        self.table_ids = gauge("mepo_sample_table_ids", "Learned ids that can still be corrected or deleted")
        self.table_bytes = gauge("mepo_sample_table_bytes", "Pages of the sample table in use")

    def _novelty(self, r: CollectorRegistry, lr: CollectorRegistry | None) -> None:
        """"Not seen yet" (``mepo_stream.novelty``): what the answers said, and how well the score tells."""
        self.answers = Counter("mepo_predicted_images", "Images answered, by whether they were answered as of a "
                               "class not learned yet", ["novel"], registry=r)
        self.novelty_score = Histogram("mepo_prediction_novelty_score", "Novelty scores of the images answered",
                                       buckets=NOVELTY_BUCKETS, registry=r)
        self.novelty_threshold = Gauge("mepo_novelty_threshold", "The threshold calibrated on the stream: above it "
                                       "an image is answered as novel (NaN: not calibrated yet)", registry=r)
        self.novelty_auroc = Gauge("mepo_anytime_novelty_auroc_ratio", "AUROC of the novelty score telling the "
                                   "test images of classes not learned yet from the learned ones, at the latest "
                                   "any-time evaluation", registry=lr)
        self.novelty_threshold.set(float("nan"))
        self.novelty_auroc.set(float("nan"))

    def observe_novelty(self, scores: torch.Tensor | None, novel: torch.Tensor | None, threshold: float) -> None:
        """Count answered images by their flag, and their scores (None: none); ``threshold``: the snapshot's."""
        if scores is None or novel is None:
            return
        self.novelty_threshold.set(threshold if math.isfinite(threshold) else float("nan"))
        flagged = int(novel.sum())
        self.answers.labels("true").inc(flagged)
        self.answers.labels("false").inc(len(novel) - flagged)
        for score in scores.tolist():
            self.novelty_score.observe(score)

    def read_from(self, refresh: Callable[[], None]) -> None:
        """Bring the series up to date with ``refresh`` whenever ``/metrics`` is read (``LiveRegistry``)."""
        self.registry.refresh = refresh

    def _publishing(self, r: CollectorRegistry | None) -> None:
        """The learner's snapshot publisher (``server.learner.publisher``)."""
        counter, gauge, histogram = in_registry(r)
        self.snapshots_published = counter("mepo_snapshots_published", "Snapshots published to the snapshot topic")
        self.snapshot_publish_errors = counter("mepo_snapshot_publish_errors",
                                               "Snapshot publications that failed (retried with the newest)")
        self.snapshot_publish_seconds = histogram("mepo_snapshot_publish_duration_seconds",
                                                  "Time to encode and publish one snapshot, acknowledged",
                                                  buckets=SNAPSHOT_BUCKETS)
        self.snapshot_bytes = gauge("mepo_snapshot_bytes", "Size of the last published snapshot")
        self.published_version = gauge("mepo_snapshot_published_version", "Version of the last published snapshot")
        self.publisher_crashes = counter("mepo_snapshot_publisher_crashes", "Times the snapshot publisher stopped on "
                                         "an error that was not the broker's (readiness then fails)")

    def _grouping(self, r: CollectorRegistry | None) -> None:
        """A learner in a group (``--kafka.state_topic``: ``server.learner.partitioned``)."""
        counter, gauge, histogram = in_registry(r)
        self.partitions_owned = gauge("mepo_partitions_owned", "Partitions of the image topic this learner learns")
        self.partition_samples = gauge("mepo_partition_samples", "Samples learned from each partition (all "
                                       "learners'), as this learner's merged model holds them", ["partition"])
        self.state_writes = counter("mepo_state_records_written", "Partition states written to the state topic")
        self.state_bytes = counter("mepo_state_written_bytes", "Bytes of partition states written")
        self.state_merges = counter("mepo_state_merges", "Other learners' partition states added to the model")
        self.merge_seconds = histogram("mepo_state_merge_duration_seconds", "Time to add the partitions' sums "
                                       "into the model", buckets=SNAPSHOT_BUCKETS)

    def _following(self, r: CollectorRegistry | None) -> None:
        """A replica following the snapshot topic (``server.replica.follower``)."""
        counter, gauge, histogram = in_registry(r)
        self.replica_up = gauge("mepo_replica_up", "1 while the replica follows the snapshot topic and reaches the "
                                "broker")
        self.snapshots_loaded = counter("mepo_replica_snapshots_loaded", "Snapshots loaded and swapped in")
        self.snapshots_refused = counter("mepo_replica_snapshots_refused",
                                         "Snapshot records or snapshots refused, never loaded", ["reason"])
        self.snapshot_load_seconds = histogram("mepo_replica_snapshot_load_duration_seconds",
                                               "Time to decode, load and swap in one snapshot",
                                               buckets=SNAPSHOT_BUCKETS)
        self.snapshot_age = gauge("mepo_replica_snapshot_age_seconds",
                                  "Seconds since the learner published the served snapshot")
        self.replica_lag = gauge("mepo_replica_lag_versions",
                                 "Newest version seen on the snapshot topic minus the served version")
