"""Prometheus metrics of the service, on their own registry (one per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
PREDICT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServerMetrics:
    """Named after Prometheus conventions: base units, ``_total`` counters, ``_ratio`` for 0-1 values."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.samples_learned = Counter("mepo_samples_learned", "Samples learned from the stream", registry=r)
        self.learn_steps = Counter("mepo_learn_steps", "Stream mini-batches learned", registry=r)
        self.records_consumed = Counter("mepo_kafka_records_consumed", "Records read from Kafka", registry=r)
        self.dead_lettered = Counter("mepo_records_dead_lettered", "Records sent to the dead-letter topic",
                                     ["reason"], registry=r)
        self.replays_skipped = Counter("mepo_replayed_samples_skipped",
                                       "Samples of a stream already learned, skipped", registry=r)
        self.drift = Counter("mepo_drift_detections", "Drift detections on the prequential error stream",
                             ["detector"], registry=r)
        self.step_seconds = Histogram("mepo_learn_step_duration_seconds", "Time to learn one stream mini-batch",
                                      buckets=STEP_BUCKETS, registry=r)
        self.predict_seconds = Histogram("mepo_predict_duration_seconds", "Prediction request latency",
                                         buckets=PREDICT_BUCKETS, registry=r)
        self.predict_requests = Counter("mepo_predict_requests", "Prediction requests", ["status"], registry=r)
        self.prequential = Gauge("mepo_prequential_accuracy_ratio", "Cumulative test-then-train accuracy",
                                 registry=r)
        self.rolling = Gauge("mepo_rolling_accuracy_ratio", "Test-then-train accuracy over the last samples",
                             registry=r)
        self.anytime = Gauge("mepo_anytime_accuracy_ratio", "Last any-time accuracy on seen-class test images",
                             registry=r)
        self.a_auc = Gauge("mepo_anytime_accuracy_auc_ratio", "A_AUC: mean of the any-time accuracies so far",
                           registry=r)
        self.last_accuracy = Gauge("mepo_last_accuracy_ratio",
                                   "Accuracy on seen-class test images when the stream last went idle (A_last)",
                                   registry=r)
        self.anytime_evals = Counter("mepo_anytime_evaluations", "Any-time evaluations run", registry=r)
        self.seen_classes = Gauge("mepo_seen_classes", "Classes seen in the stream", registry=r)
        self.lag = Gauge("mepo_kafka_consumer_lag_records", "Records behind the partition's high watermark",
                         ["partition"], registry=r)
        self.checkpoint_seconds = Histogram("mepo_checkpoint_duration_seconds", "Checkpoint write time",
                                            buckets=STEP_BUCKETS, registry=r)
        self.last_checkpoint = Gauge("mepo_last_checkpoint_timestamp_seconds", "Time of the last checkpoint",
                                     registry=r)
        self.model_version = Gauge("mepo_model_version", "Version of the published model snapshot", registry=r)
        self.learner_up = Gauge("mepo_learner_up", "1 while the learner loop runs and reaches the broker",
                                registry=r)
        self.info = Info("mepo_model", "Backbone and MePo bundle of the served model", registry=r)
