"""The base of the Kafka-reading loops (the learner's, a replica's and a group's state follower): a thread with the
controls the API uses (pause, resume, health), and the broker check they run.

Example (a loop that is not started reports itself stopped and disconnected):
    >>> ConsumerThread("example").health()
    LoopHealth(running=False, kafka_connected=False, paused=False, consumer_lag={}, error=None)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kafka import KafkaConsumer
from kafka.errors import KafkaError

PROBE_EVERY_S = 5.0


def broker_answers(consumer: KafkaConsumer, timeout_s: float = 2.0) -> bool:
    """Partitions assigned and the broker answering a round trip within ``timeout_s`` (a stopped one keeps its TCP)."""
    assignment = consumer.assignment()
    if not assignment:
        return False
    try:
        consumer.beginning_offsets(list(assignment), timeout_ms=int(timeout_s * 1000))
        return True
    except KafkaError:
        return False


@dataclass(frozen=True)
class LoopHealth:
    """What the API reports about the loop (``/readyz``, ``/v1/status``, ``/v2/health/ready``)."""

    running: bool  # the loop's thread is alive (it stops on a bug, see ``error``)
    kafka_connected: bool  # partitions assigned and the broker answering
    paused: bool
    consumer_lag: dict[str, int]  # records not yet learned (unread or waiting in a batch), per "topic:partition"
    error: str | None  # why the loop stopped, if it failed

    def status_fields(self) -> dict:
        """What every role's ``/v1/status`` says of its Kafka thread (each names its ``error`` its own way)."""
        return {"paused": self.paused, "kafka_connected": self.kafka_connected, "consumer_lag": self.consumer_lag}


class ConsumerThread:
    """A Kafka-reading loop in its own thread: ``_run`` keeps ``connected``, ``error`` and ``lag`` current."""

    stop_timeout: float = 10.0

    def __init__(self, name: str):
        self.stop_event, self._paused = threading.Event(), threading.Event()
        self.connected, self._probed_at = False, 0.0
        self.error: str | None = None
        self.lag: dict[str, int] = {}
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        """Run the loop here, in the calling thread, until it stops (``start`` runs it in a thread of its own)."""
        self._run()

    def stop(self, timeout: float | None = None) -> None:
        self.stop_event.set()
        self.thread.join(self.stop_timeout if timeout is None else timeout)

    def pause(self) -> None:
        """Stop taking in new records; predictions go on from the current model."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def health(self) -> LoopHealth:
        return LoopHealth(self.thread.is_alive(), self.connected, self._paused.is_set(), dict(self.lag), self.error)
