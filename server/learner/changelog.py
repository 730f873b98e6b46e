"""The state topic's reader and writer, for learners in a group (``server.state_topic`` says what a record is).

* ``Changelog.read_all`` returns each partition's newest state, read to the high watermark of a fetch made after
  the call started (never ``end_offsets``, which the embedded broker answers wrongly after multi-record batches:
  ``../shared/notes/kafka.md``), so every state written before the assignment is read.
* ``Changelog.write`` waits for the broker's acknowledgement: offsets are committed only after their state is durable.
* ``ChangelogFollower`` tails the topic in a thread: how a learner hears of the partitions other learners own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError

from mepo_stream.errors import StateRefused
from mepo_stream.kafka import KafkaConfig
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


def read_to_end(consumer: KafkaConsumer, tp: TopicPartition, timeout_s: float) -> Iterator[dict]:
    """The polls of ``consumer`` (assigned ``tp`` alone) until its position reaches the high watermark of a fetch
    (see the module's docstring)."""
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
        futures = [self._producer.send(self.kafka.state_topic, key=key, value=value, headers=headers)
                   for key, value, headers in records]
        for future in futures:
            future.get(timeout=ACK_TIMEOUT_S)
        return sum(len(value) for _, value, _ in records)

    def close(self) -> None:
        close_quietly(self._producer, "state")
        self._producer = None


class ChangelogFollower:
    """Tails the state topic: a state this learner cannot read goes to ``on_error`` and stops the follower (sums of
    another model are never added)."""

    def __init__(self, kafka: KafkaConfig, on_state: Callable[[PartitionState], None],
                 on_error: Callable[[StateRefused], None]):
        self.kafka, self.on_state, self.on_error = kafka, on_state, on_error
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mepo-changelog", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.thread.join(timeout)

    def _run(self) -> None:
        position = 0
        while not self._stop.is_set():
            consumer = None
            try:
                consumer, tp = _consumer(self.kafka)
                consumer.seek(tp, position)
                reassembly = _Reassembly()  # parts of a state never span a reconnect: it re-reads from a state start
                while not self._stop.is_set():
                    polled = consumer.poll(timeout_ms=200)
                    for state in reassembly.states(polled):
                        self.on_state(state)
                    if not any(a.incomplete for a in reassembly.assemblers.values()):  # no state half read
                        position = consumer.position(tp)
            except KafkaError as e:
                log.warning("state topic unavailable (%s); retrying in %.0f s", e, RETRY_S)
                self._stop.wait(RETRY_S)
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
