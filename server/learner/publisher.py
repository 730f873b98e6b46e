"""The learner's snapshot publisher: its newest snapshot to the compacted snapshot topic, from its own thread.

A learning step only ``notify``s, so publishing never blocks learning. The thread sends the newest version,
acknowledged, then rests ``publish_interval_s``: versions learned meanwhile are skipped, the newest always goes out
(at shutdown too), and a broker that cannot be reached is retried with the newest; nothing queues up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kafka import KafkaProducer
from kafka.errors import KafkaError

from server.config import ServeConfig
from server.learner.changelog import ACK_TIMEOUT_S, RETRY_S, send_acked
from server.learner.state import LearnerState
from server.metrics import ServerMetrics
from server.snapshot import Snapshot
from server.snapshot_topic import Origin, close_quietly, encode, ensure_snapshot_topic, open_parts_producer, to_records

log = logging.getLogger(__name__)


class SnapshotPublisher:
    """Publishes the newest snapshot of ``source``; ``start`` it, ``notify`` it of new versions, ``stop`` it."""

    def __init__(self, cfg: ServeConfig, origin: Origin, metrics: ServerMetrics, source: Callable[[], Snapshot],
                 run: Callable[..., bytes] = lambda fn, *args: fn(*args)):
        self.kafka, self.interval, self.origin, self.metrics = cfg.kafka, cfg.publish_interval_s, origin, metrics
        self.source, self.run = source, run  # run: where the tensors are copied and encoded (the model thread)
        self._due = True  # the model as it starts (restored, or empty) goes out first
        self._sent_version: int | None = None
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._producer: KafkaProducer | None = None
        self.error: str | None = None  # why a bug stopped publishing (a broker's errors are retried): not ready
        self.thread = threading.Thread(target=self._run, name="mepo-publisher", daemon=True)

    @classmethod
    def create(cls, state: LearnerState) -> SnapshotPublisher | None:
        """The publisher of a learner's snapshots, or None when no snapshot topic is configured."""
        if state.cfg.kafka.snapshot_topic is None:
            return None
        return cls(state.cfg, state.origin, state.metrics, lambda: state.snapshot, state.model_thread.run)

    def start(self) -> None:
        self.thread.start()

    def notify(self) -> None:
        """A new version was learned: publish the newest at the thread's next turn; returns at once."""
        with self._wake:
            self._due = True
            self._wake.notify()

    def stop(self, timeout: float = 10.0) -> None:
        """Publish the newest snapshot if it is not yet (one attempt), then close the producer."""
        with self._wake:
            self._stop.set()
            self._wake.notify()
        self.thread.join(timeout)

    def _next(self) -> Snapshot | None:
        """Wait for a version not published yet and snapshot it; None once stopped with nothing left to publish."""
        while True:
            with self._wake:
                while not self._stop.is_set() and not self._due:
                    self._wake.wait()
                if not self._due:
                    return None
                self._due = False
            if (snapshot := self.source()).version != self._sent_version:
                return snapshot

    def _run(self) -> None:
        while (snapshot := self._next()) is not None:
            try:
                self._publish(snapshot)
            except KafkaError as e:
                self._due = True  # the newest, once the broker is back
                self.metrics.snapshot_publish_errors.inc()
                log.warning("could not publish snapshot version %d to %s (%s); retrying with the newest in %.0f s",
                            snapshot.version, self.kafka.snapshot_topic, e, RETRY_S)
                self._close()
                if self._stop.wait(RETRY_S):
                    break
            except Exception as e:  # a bug, not the broker: stop publishing, keep learning and serving, not ready
                self.error = f"{type(e).__name__}: {e}"
                self.metrics.publisher_crashes.inc()
                log.exception("the snapshot publisher failed: publishing stops, learning goes on, /readyz fails")
                break
            else:
                self._stop.wait(self.interval)
        self._close()

    def _publish(self, snapshot: Snapshot) -> None:
        """Encode, send every part, and wait until the broker has acknowledged them all."""
        start = time.perf_counter()
        assert snapshot.model is not None  # the learner's snapshots always hold its model
        blob = self.run(encode, snapshot.model.trainable_state_dict(), self.origin, snapshot.version,
                        snapshot.samples_seen, snapshot.exposed, time.time(), snapshot.novelty_score,
                        snapshot.novelty_threshold)
        records = to_records(blob, self.origin.model, snapshot.version, self.kafka.snapshot_chunk_bytes)
        send_acked(self._connect(), self.kafka.snapshot_topic, records)
        self._sent_version = snapshot.version
        m = self.metrics
        m.snapshot_publish_seconds.observe(time.perf_counter() - start)
        m.snapshots_published.inc()
        m.snapshot_bytes.set(len(blob))
        m.published_version.set(snapshot.version)
        log.debug("published snapshot version %d: %d bytes in %d records", snapshot.version, len(blob), len(records))

    def _connect(self) -> KafkaProducer:
        if self._producer is None:
            ensure_snapshot_topic(self.kafka)
            self._producer = open_parts_producer(self.kafka, ACK_TIMEOUT_S)
        return self._producer

    def _close(self) -> None:
        close_quietly(self._producer, "snapshot")
        self._producer = None
