"""The state topic's reader and writer, for learners in a group (``server.state_topic`` says what a record is).

``read_all`` reads to the high watermark of a fetch made after the call started (never ``end_offsets``, which the
embedded broker answers wrongly), so every state written before the assignment is read. ``write`` waits for the
broker's acknowledgement. ``ChangelogFollower`` tails the topic for the other learners' states.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError

from mepo_stream.errors import StateRefused
from mepo_stream.kafka import KafkaConfig
from server.consumer import ConsumerThread
from server.snapshot_topic import Assembler, CorruptSnapshot, close_quietly, open_parts_producer
from server.state_topic import FORMAT, PartitionState, StateFormatError, decode, ensure_state_topic, state_records

log = logging.getLogger(__name__)
ACK_TIMEOUT_S = 30.0
RETRY_S = 2.0


def _consumer(kafka: KafkaConfig) -> tuple[KafkaConsumer, TopicPartition]:
    """A group-less consumer of the state topic's one partition, at its beginning."""
    ensure_state_topic(kafka)
    consumer = KafkaConsumer(**kafka.client_options(), group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest", max_partition_fetch_bytes=4 * kafka.snapshot_chunk_bytes,
                             fetch_max_bytes=64 * 1024 * 1024)
    tp = TopicPartition(kafka.state_topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    return consumer, tp


class _Reassembly:
    """Puts the parts of each partition's states back together."""

    def __init__(self):
        self.assemblers: dict[str, Assembler] = {}

    def states(self, polled: dict) -> Iterator[PartitionState]:
        for record in sorted((r for rs in polled.values() for r in rs), key=lambda r: r.offset):
            head = {k: v.decode(errors="replace") for k, v in record.headers or []}
            if head.get("format") != FORMAT:
                raise StateFormatError(f"record {record.offset} of the state topic has format "
                                       f"{head.get('format')!r}; this learner reads {FORMAT!r}")
            key = head.get("model", "")
            assembler = self.assemblers.setdefault(key, Assembler(key, fmt=FORMAT))
            try:
                blob = assembler.add(record.key, record.value, record.headers)
            except CorruptSnapshot as e:
                raise StateFormatError(f"record {record.offset} of the state topic: {e}") from e
            if blob is not None:
                yield decode(blob)


def send_acked(producer: KafkaProducer, topic: str | None, records: Iterable[tuple], **options) -> None:
    """Send (key, value, headers) records and wait until the broker has them all."""
    for future in [producer.send(topic, key=k, value=v, headers=h, **options) for k, v, h in records]:
        future.get(timeout=ACK_TIMEOUT_S)


def read_to_end(consumer: KafkaConsumer, tp: TopicPartition, timeout_s: float) -> Iterator[dict]:
    """The polls of ``consumer`` (assigned ``tp`` alone) until its position reaches the high watermark of a fetch."""
    deadline = time.monotonic() + timeout_s
    while True:
        yield consumer.poll(timeout_ms=200)
        high = consumer.highwater(tp)
        if high is not None and consumer.position(tp) >= high:
            return
        if time.monotonic() > deadline:
            raise KafkaError(f"could not read {tp.topic}:{tp.partition} to its end in {timeout_s:.0f} s")


class Changelog:
    """Reads and writes one learner group's state topic."""

    def __init__(self, kafka: KafkaConfig):
        self.kafka = kafka
        self._producer: KafkaProducer | None = None

    def read_all(self, timeout_s: float = 60.0) -> dict[str, PartitionState]:
        consumer, tp = _consumer(self.kafka)
        latest: dict[str, PartitionState] = {}
        reassembly = _Reassembly()
        try:
            for polled in read_to_end(consumer, tp, timeout_s):
                for state in reassembly.states(polled):
                    latest[state.key] = state
            return latest
        finally:
            consumer.close()

    def write(self, states: list[PartitionState]) -> int:
        """Send ``states`` and wait for the broker to have them; returns the bytes sent."""
        if self._producer is None:
            ensure_state_topic(self.kafka)
            self._producer = open_parts_producer(self.kafka, ACK_TIMEOUT_S)
        records = [r for state in states for r in state_records(state, self.kafka.snapshot_chunk_bytes)]
        send_acked(self._producer, self.kafka.state_topic, records)
        return sum(len(value) for _, value, _ in records)

    def close(self) -> None:
        close_quietly(self._producer, "state")
        self._producer = None


class ChangelogFollower(ConsumerThread):
    """Tails the state topic; a state it cannot read goes to ``on_error`` and stops it (no other model's sums)."""

    def __init__(self, kafka: KafkaConfig, on_state: Callable[[PartitionState], None],
                 on_error: Callable[[StateRefused], None]):
        self.kafka, self.on_state, self.on_error = kafka, on_state, on_error
        super().__init__("mepo-changelog")

    def _run(self) -> None:
        position = 0
        while not self.stop_event.is_set():
            consumer = None
            try:
                consumer, tp = _consumer(self.kafka)
                consumer.seek(tp, position)
                reassembly = _Reassembly()  # parts of a state never span a reconnect: it re-reads from a state start
                while not self.stop_event.is_set():
                    polled = consumer.poll(timeout_ms=200)
                    for state in reassembly.states(polled):
                        self.on_state(state)
                    if not any(a.incomplete for a in reassembly.assemblers.values()):  # no state half read
                        position = consumer.position(tp)
            except KafkaError as e:
                log.warning("state topic unavailable (%s); retrying in %.0f s", e, RETRY_S)
                self.stop_event.wait(RETRY_S)
            except StateFormatError as e:
                self.on_error(e)
                return
            except Exception as e:  # a bug: stop following, and learning, which could no longer merge the states
                log.exception("the changelog follower failed")
                self.on_error(StateRefused(f"the state topic's follower failed ({type(e).__name__}: {e})"))
                return
            finally:
                if consumer is not None:
                    consumer.close()
