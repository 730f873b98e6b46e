"""The learner's consumer on kafka-python (the default client), behind ``server.learner.consumer.Consumer``.

The rebalance listener runs on kafka-python's IO thread while ``poll`` waits, so the handler's seeks are made before
the fetches of the new assignment begin. ``close`` commits the last offsets sent again, waiting, so none is lost.

A poll does not return while this member's group join is in flight (at most ``JOIN_WAIT_S``): kafka-python 3.0.12
starts a join over when it finished between two polls (``join_group_async`` replaces a finished join task instead of
reading it), and a learner whose model thread takes a second between polls would rejoin its group again and again.
"""

from __future__ import annotations

import logging
import time

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from mepo_stream.kafka import KafkaConfig
from server.consumer import broker_answers
from server.learner import consumer as contract

log = logging.getLogger(__name__)

JOIN_WAIT_S = 10.0
"""The longest a poll waits for a group join in flight (the other members answer the rebalance in that time)."""


def _on_commit(offsets: dict, result: object) -> None:
    if isinstance(result, Exception):
        contract.log_failed_commit(result)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, consumer: KafkaPythonConsumer, on_rebalance: contract.OnRebalance):
        self.consumer, self.on_rebalance = consumer, on_rebalance

    def on_partitions_revoked(self, revoked):
        self.consumer.joining = True  # the eager protocol revokes at the start of every join
        try:
            self.on_rebalance(contract.Revoked(tuple(map(contract.PartitionKey.of, revoked))))
        finally:
            for tp in revoked:  # another member commits them from now on
                self.consumer.sent.pop(tp, None)

    def on_partitions_assigned(self, assigned):
        self.consumer.joining = False
        starts = self.on_rebalance(contract.Assigned(tuple(map(contract.PartitionKey.of, assigned)))) or {}
        for key, offset in starts.items():
            self.consumer.seek(key, offset)


class KafkaPythonConsumer:
    def __init__(self, kafka: KafkaConfig, max_records: int, **timing: int):
        with contract.unavailable_on(KafkaError):
            self._consumer = KafkaConsumer(**kafka.client_options(), group_id=kafka.group_id,
                                           enable_auto_commit=False, auto_offset_reset="earliest",
                                           max_poll_records=max_records, **timing)
        self.sent: dict[TopicPartition, OffsetAndMetadata] = {}  # the last committed: ``close`` commits them again
        self.joining = False  # from a join's start (subscribe, or a revocation) to its assignment

    def subscribe(self, topics: list[str], on_rebalance: contract.OnRebalance) -> None:
        self.joining = True
        self._consumer.subscribe(topics, listener=_Listener(self, on_rebalance))

    def poll(self, wait_ms: int, max_records: int) -> list[contract.Record]:
        deadline = time.monotonic() + max(wait_ms / 1000, JOIN_WAIT_S)
        with contract.unavailable_on(KafkaError):
            polled = self._consumer.poll(timeout_ms=wait_ms, max_records=max_records)
            while self.joining and not polled and (left := deadline - time.monotonic()) > 0:
                polled = self._consumer.poll(timeout_ms=int(1000 * min(left, 1.0)), max_records=max_records)
        return [contract.Record(r.topic, r.partition, r.offset, r.key, r.value, list(r.headers or []), r.timestamp)
                for records in polled.values() for r in records]

    def seek(self, key: contract.PartitionKey, offset: int) -> None:
        self._consumer.seek(TopicPartition(*key), offset)

    def commit(self, offsets: dict[contract.PartitionKey, int]) -> None:
        sent = {TopicPartition(*key): OffsetAndMetadata(offset, "", -1) for key, offset in offsets.items()}
        self.sent.update(sent)
        try:
            self._consumer.commit_async(sent, callback=_on_commit)
        except KafkaError as e:  # not even sent (no coordinator): the checkpoint holds them
            contract.log_failed_commit(e)

    def assignment(self) -> set[contract.PartitionKey]:
        return set(map(contract.PartitionKey.of, self._consumer.assignment()))

    def unread(self, key: contract.PartitionKey) -> int | None:
        tp = TopicPartition(*key)
        if (high := self._consumer.highwater(tp)) is None:
            return None
        try:
            return max(0, high - self._consumer.position(tp, timeout_ms=1000))
        except KafkaError:  # no position yet, or the broker is stalled
            return None

    def partitions_of(self, topic: str) -> set[int] | None:
        return self._consumer.partitions_for_topic(topic)

    def probe(self, timeout_s: float) -> bool:
        return broker_answers(self._consumer, timeout_s)

    def close(self, timeout_s: float) -> None:
        contract.close_within(self._close, timeout_s)

    def _close(self) -> None:
        if self.sent:
            try:
                self._consumer.commit(self.sent)
            except KafkaError as e:
                contract.log_failed_commit(e)
        self._consumer.close(autocommit=False)
