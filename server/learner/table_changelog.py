"""A partition's sample table on Kafka, for learners in a group: the table moves with its partition.

As Kafka Streams backs a state store, partition p of ``<state topic>.samples`` holds the table changes of image
partition p: a record per changed id, keyed by its hash, valued by its entry (None: gone). Each owner numbers its
writes under an epoch of its own (headers ``epoch``, ``seq``) and a partition state names the last write it includes
per epoch, so a restore after a kill -9 applies only those, and writes the skipped ids out again.

Example:
    >>> Write(2, "e1", 3, {b"k" * 16: None}).headers()
    [('epoch', b'e1'), ('seq', b'3')]
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from mepo_stream.errors import StateRefused
from mepo_stream.kafka import KafkaConfig, ensure_topics, open_producer
from server.learner.changelog import ACK_TIMEOUT_S, read_to_end
from server.learner.consumer import PartitionKey
from server.learner.corrections import Corrections
from server.learner.sample_table import Entry, SampleTable
from server.snapshot_topic import close_quietly
from server.state_topic import PartitionState

# a day: a record no state includes is written over by the next owner before a compaction drops the one before it
TOPIC_CONFIGS = {"cleanup.policy": "compact", "min.compaction.lag.ms": str(24 * 3600 * 1000)}


@dataclass(frozen=True)
class Write:
    """One capture's changes of one partition's table: the ``seq``-th write of ``epoch``."""

    partition: int
    epoch: str
    seq: int
    changes: dict[bytes, Entry | None]

    def headers(self) -> list[tuple[str, bytes]]:
        return [("epoch", self.epoch.encode()), ("seq", str(self.seq).encode())]


def included(record, committed: dict[str, int]) -> bool:
    """Whether a changelog record belongs to a write that ``committed`` (a state's epoch -> last seq) includes."""
    head = {k: v.decode() for k, v in record.headers or []}
    return int(head["seq"]) <= committed.get(head["epoch"], 0)


class TableChangelog:
    """Writes partitions' table changes, and rebuilds a partition's table from them."""

    def __init__(self, kafka: KafkaConfig):
        self.kafka, self.topic = kafka, f"{kafka.state_topic}.samples"
        self._producer: KafkaProducer | None = None
        self._created = False  # the topic exists (made here or by another learner): not asked again

    def write(self, writes: list[Write]) -> int:
        """Send the writes and wait until the broker has them all; returns the bytes sent."""
        if self._producer is None:
            self._producer = open_producer(self.kafka, linger_ms=5)
        sent, futures = 0, []
        for write in writes:
            for key, entry in write.changes.items():
                value = None if entry is None else entry.encode()
                sent += len(key) + len(value or b"")
                futures.append(self._producer.send(self.topic, key=key, value=value, headers=write.headers(),
                                                   partition=write.partition))
        for future in futures:
            future.get(timeout=ACK_TIMEOUT_S)
        return sent

    def restore(self, partition: int, committed: dict[str, int], table: SampleTable, timeout_s: float = 120.0) -> int:
        """Fill ``table`` with the writes ``committed`` names (epoch -> last seq); returns how many it skipped."""
        consumer = KafkaConsumer(**self.kafka.client_options(), group_id=None, enable_auto_commit=False,
                                 auto_offset_reset="earliest", fetch_max_bytes=64 * 1024 * 1024)
        tp = TopicPartition(self.topic, partition)
        try:
            self._ensure(consumer, partition)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)
            return table.rebuild([(r.key, None if r.value is None else Entry.decode(r.value), included(r, committed))
                                  for r in polled.get(tp, [])] for polled in read_to_end(consumer, tp, timeout_s))
        finally:
            consumer.close()

    def _ensure(self, consumer: KafkaConsumer, partition: int) -> None:
        """Create the changelog with the image topic's partitions; refuse one without ``partition``."""
        if not self._created:
            ensure_topics(self.kafka, self.topic, configs=TOPIC_CONFIGS,
                          partitions=len(consumer.partitions_for_topic(self.kafka.topic) or ()))
            self._created = True
        if partition not in (consumer.partitions_for_topic(self.topic) or set()):
            raise StateRefused(f"{self.topic} has no partition {partition}: it needs as many partitions as "
                               f"{self.kafka.topic} (add them, or start over with a new --kafka.state_topic)")

    def close(self) -> None:
        close_quietly(self._producer, "sample changelog")
        self._producer = None


class PartitionTables:
    """The changelog writes of the partitions a learner in a group owns, each under this owner's epoch."""

    def __init__(self, kafka: KafkaConfig):
        self.changelog = TableChangelog(kafka)
        self.writes: dict[str, tuple[str, dict[str, int]]] = {}  # per partition: this owner's epoch, what it includes

    def restore(self, keys: list[str], states: dict[str, PartitionState], corrections: Corrections
                ) -> dict[str, tuple[SampleTable, bool]]:
        """Each partition's table rebuilt from the writes its state includes, and whether the changelog holds more."""
        out = {}
        for key in keys:
            table = corrections.new_table(key)
            committed = states[key].table if key in states else {}
            skipped = self.changelog.restore(PartitionKey.parse(key).partition, committed, table)
            out[key] = (table, skipped > 0)
        return out

    def adopt(self, key: str, state: PartitionState | None) -> None:
        """Own ``key`` from its state (None: none yet) under a new, unique epoch: no two owners' writes are confused."""
        self.writes[key] = (uuid.uuid4().hex, {} if state is None else dict(state.table))

    def drop(self, key: str) -> None:
        self.writes.pop(key, None)

    def included(self, key: str) -> dict[str, int]:
        """What the partition's next state says its table includes."""
        return dict(self.writes[key][1])

    def capture(self, key: str, table: SampleTable) -> Write | None:
        """The partition table's changes since the last capture as this owner's next write (None: none)."""
        epoch, included = self.writes[key]
        seq = included.get(epoch, 0) + 1
        changes = table.commit(seq)
        table.settle(seq)  # the changelog, not this file, is what a restore reads: no undo is needed
        if not changes:
            return None
        included[epoch] = seq
        return Write(PartitionKey.parse(key).partition, epoch, seq, changes)
