"""The learner's consumer on librdkafka (``--consumer librdkafka``), behind ``server.learner.consumer.Consumer``.

librdkafka parses records in C, in its own threads, not under the interpreter lock the model thread needs
(docs/performance.md). A silent broker is retried inside librdkafka (``probe`` reports it); its waiting commit takes
no timeout, so commits are sent without waiting and ``close`` waits for those in flight.
"""

from __future__ import annotations

import importlib.util
import logging
from functools import partial
from typing import Any, cast

from mepo_stream.errors import ConfigError
from mepo_stream.kafka import KafkaConfig
from server.learner import consumer as contract

# librdkafka's names of the options ``KafkaConfig.client_options`` gives kafka-python
LIBRDKAFKA_NAMES = {"security_protocol": "security.protocol", "sasl_mechanism": "sasl.mechanism",
                    "sasl_plain_username": "sasl.username", "sasl_plain_password": "sasl.password",
                    "ssl_cafile": "ssl.ca.location", "ssl_certfile": "ssl.certificate.location",
                    "ssl_keyfile": "ssl.key.location"}

log = logging.getLogger(__name__)


def _record(message) -> contract.Record:
    """A consumed message's record (not an error: its topic, partition and offset are set)."""
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    assert topic is not None and partition is not None and offset is not None
    headers = cast(list[tuple[str, bytes]] | None, message.headers())  # as consumed: a list of (str, bytes) pairs
    return contract.Record(topic, partition, offset, message.key(), message.value(), headers, message.timestamp()[1])


def _on_commit(error, partitions) -> None:
    if error is not None:
        contract.log_failed_commit(error)


def _partition(key: contract.PartitionKey, offset: int | None = None):
    """librdkafka's name of a partition (at ``offset``); imported here, as confluent-kafka is an extra."""
    from confluent_kafka import TopicPartition

    return TopicPartition(key.topic, key.partition) if offset is None else TopicPartition(*key, offset)


def _as_unavailable():
    """librdkafka's errors as ``BrokerUnavailable``; imported here, as confluent-kafka is an extra."""
    from confluent_kafka import KafkaException

    return contract.unavailable_on(KafkaException)


def check_available() -> None:
    """Refuse ``--consumer librdkafka`` where confluent-kafka is not installed, naming the extra that brings it."""
    if importlib.util.find_spec("confluent_kafka") is None:
        raise ConfigError("--consumer librdkafka needs confluent-kafka: pip install 'mepo-stream[librdkafka]'")


def librdkafka_settings(kafka: KafkaConfig, session_timeout_ms: int, heartbeat_interval_ms: int,
                        max_poll_interval_ms: int, fetch_max_bytes: int, fetch_max_wait_ms: int) -> dict[str, Any]:
    """The learner's consumer settings in librdkafka's names."""
    options = kafka.client_options()  # the one place that knows which options reach a client
    security = {LIBRDKAFKA_NAMES[name]: value for name, value in options.items() if name != "bootstrap_servers"}
    return {"bootstrap.servers": ",".join(options["bootstrap_servers"]), "group.id": kafka.group_id, **security,
            "enable.auto.commit": False, "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
            "session.timeout.ms": session_timeout_ms, "heartbeat.interval.ms": heartbeat_interval_ms,
            "max.poll.interval.ms": max_poll_interval_ms, "fetch.max.bytes": fetch_max_bytes,
            "fetch.wait.max.ms": fetch_max_wait_ms}


class LibrdkafkaConsumer:
    def __init__(self, kafka: KafkaConfig, **timing: int):
        from confluent_kafka import Consumer

        settings = librdkafka_settings(kafka, **timing)
        error_cb = partial(log.warning, "librdkafka: %s")  # a broker down, a failed connection: it retries itself
        self._consumer = Consumer({**settings, "error_cb": error_cb, "on_commit": _on_commit})
        self._assigned: set[contract.PartitionKey] = set()

    def subscribe(self, topics: list[str], on_rebalance: contract.OnRebalance) -> None:
        def on_assign(consumer, partitions) -> None:
            keys = tuple(map(contract.PartitionKey.of, partitions))
            self._assigned |= set(keys)
            starts = on_rebalance(contract.Assigned(keys)) or {}
            for p, key in zip(partitions, keys, strict=True):
                p.offset = starts.get(key, p.offset)
            consumer.assign(partitions)

        def on_revoke(consumer, partitions) -> None:
            keys = tuple(map(contract.PartitionKey.of, partitions))
            try:
                on_rebalance(contract.Revoked(keys))
            finally:
                self._assigned -= set(keys)
                consumer.unassign()

        self._consumer.subscribe(topics, on_assign=on_assign, on_revoke=on_revoke, on_lost=on_revoke)

    def poll(self, wait_ms: int, max_records: int) -> list[contract.Record]:
        records = []
        for message in self._consumer.consume(max_records, wait_ms / 1000):
            if (error := message.error()) is not None:
                if error.fatal():
                    raise contract.BrokerUnavailable(str(error))
                continue  # librdkafka retries what it can; the probe reports a broker that does not answer
            records.append(_record(message))
        return records

    def seek(self, key: contract.PartitionKey, offset: int) -> None:
        with _as_unavailable():
            self._consumer.seek(_partition(key, offset))

    def commit(self, offsets: dict[contract.PartitionKey, int]) -> None:
        try:
            self._consumer.commit(offsets=[_partition(k, o) for k, o in offsets.items()], asynchronous=True)
        except Exception as e:  # not even queued (no coordinator): the checkpoint holds them
            contract.log_failed_commit(e)

    def assignment(self) -> set[contract.PartitionKey]:
        return set(self._assigned)

    def unread(self, key: contract.PartitionKey) -> int | None:
        """Behind the end offset as of the last fetch (None before any, or without a position)."""
        _, high = self._consumer.get_watermark_offsets(_partition(key), cached=True)
        position = self._consumer.position([_partition(key)])[0].offset
        return None if high is None or high < 0 or position < 0 else max(0, high - position)

    def partitions_of(self, topic: str) -> set[int] | None:
        with _as_unavailable():
            topics = self._consumer.list_topics(topic, timeout=5).topics
        return set(topics[topic].partitions) if topic in topics and topics[topic].error is None else None

    def probe(self, timeout_s: float) -> bool:
        if not self._assigned:
            return False
        try:
            for key in self._assigned:
                self._consumer.get_watermark_offsets(_partition(key), timeout=timeout_s)
            return True
        except Exception:  # KafkaException: no answer in time
            return False

    def close(self, timeout_s: float) -> None:
        contract.close_within(self._consumer.close, timeout_s)
