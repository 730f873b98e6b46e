"""The learner's consumer on librdkafka (``--consumer librdkafka``): the records parsed in C, off the GIL.

kafka-python parses every record in Python, under the interpreter lock the model thread needs between its
operators; beside a fast model that parsing sets the learner's pace (docs/performance.md, "Why the nearly free
model stays near half its bare loop"). librdkafka (``confluent-kafka``) fetches and parses in its own threads.

``LibrdkafkaConsumer`` offers the part of kafka-python's ``KafkaConsumer`` the learner loop
(``server.learner.stream``) uses, with kafka-python's ``TopicPartition`` and ``KafkaError`` at the boundary, so the
loop, its rebalance listener and its offsets are the same whichever client reads. What differs underneath:

* the rebalance listener runs inside ``poll``, in the polling thread (kafka-python runs it on its IO thread while
  the learner thread waits in ``poll``); a seek asked for while partitions are assigned sets where they start;
* a broker that does not answer is retried inside librdkafka: ``poll`` returns nothing, and the loop's probe
  (``beginning_offsets``, a round trip) is what can report it disconnected;
* every commit is sent without waiting (librdkafka's waiting commit has no timeout), and ``close`` waits for those
  in flight.

A learner alone or in a group (``--kafka.state_topic``) may use it: the kill -9 tests, alone and in a group whose
partitions move to the learner that takes them over, and the broker-stall test run with both clients.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

from kafka import ConsumerRebalanceListener, TopicPartition
from kafka.errors import KafkaError

from mepo_stream.errors import ConfigError
from mepo_stream.kafka import KafkaConfig

LIBRDKAFKA_NAMES = {"security_protocol": "security.protocol", "sasl_mechanism": "sasl.mechanism",
                    "sasl_plain_username": "sasl.username", "sasl_plain_password": "sasl.password",
                    "ssl_cafile": "ssl.ca.location", "ssl_certfile": "ssl.certificate.location",
                    "ssl_keyfile": "ssl.key.location"}
"""librdkafka's names of the options ``KafkaConfig.client_options`` gives kafka-python."""

log = logging.getLogger(__name__)


class Record(NamedTuple):
    """A consumed record with the fields the intake and the dead letters read (``mepo_stream.records.KafkaRecord``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] | None
    timestamp: int  # ms


def _record(message) -> Record:
    """A consumed message's record (its topic, partition and offset are set: it is not an error)."""
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    assert topic is not None and partition is not None and offset is not None
    headers = cast(list[tuple[str, bytes]] | None, message.headers())  # as consumed: a list of (str, bytes) pairs
    return Record(topic, partition, offset, message.key(), message.value(), headers, message.timestamp()[1])


def _log_error(error) -> None:
    """librdkafka's client-wide errors (a broker down, a failed connection), which it retries itself: logged."""
    log.warning("librdkafka: %s", error)


def _log_failed_commit(error, partitions) -> None:
    """An asynchronous commit's answer: a failure is only logged, the checkpoint holds the offsets."""
    if error is not None:
        log.warning("offset commit failed (the checkpoint holds them): %s", error)


def _partition(tp: TopicPartition, offset: int | None = None):
    """librdkafka's name of partition ``tp`` (at ``offset``); imported here, as confluent-kafka is an extra."""
    from confluent_kafka import TopicPartition as Partition

    return Partition(tp.topic, tp.partition) if offset is None else Partition(tp.topic, tp.partition, offset)


@contextmanager
def _as_kafka_error() -> Iterator[None]:
    """librdkafka's exceptions as kafka-python's ``KafkaError``, which the loop handles (reconnects on)."""
    from confluent_kafka import KafkaException

    try:
        yield
    except KafkaException as e:
        raise KafkaError(str(e)) from e


def check_available() -> None:
    """Refuse ``--consumer librdkafka`` where confluent-kafka is not installed, naming the extra that brings it."""
    if importlib.util.find_spec("confluent_kafka") is None:
        raise ConfigError("--consumer librdkafka needs confluent-kafka: pip install 'mepo-stream[librdkafka]'")


def librdkafka_settings(kafka: KafkaConfig, session_timeout_ms: int, heartbeat_interval_ms: int,
                        max_poll_interval_ms: int, fetch_max_bytes: int, fetch_max_wait_ms: int) -> dict[str, Any]:
    """The learner's consumer settings in librdkafka's names: a group member that never commits on its own and
    starts a partition without a committed offset at its beginning."""
    options = kafka.client_options()  # the one place that knows which options reach a client
    security = {LIBRDKAFKA_NAMES[name]: value for name, value in options.items() if name != "bootstrap_servers"}
    return {"bootstrap.servers": ",".join(options["bootstrap_servers"]), "group.id": kafka.group_id, **security,
            "enable.auto.commit": False, "enable.auto.offset.store": False, "auto.offset.reset": "earliest",
            "session.timeout.ms": session_timeout_ms, "heartbeat.interval.ms": heartbeat_interval_ms,
            "max.poll.interval.ms": max_poll_interval_ms, "fetch.max.bytes": fetch_max_bytes,
            "fetch.wait.max.ms": fetch_max_wait_ms}


class LibrdkafkaConsumer:
    """A group member reading through librdkafka, behind the calls the learner loop makes of a ``KafkaConsumer``."""

    def __init__(self, settings: dict[str, Any]):
        from confluent_kafka import Consumer

        self._consumer = Consumer({**settings, "error_cb": _log_error, "on_commit": _log_failed_commit})
        self._assigned: set[TopicPartition] = set()
        self._starts: dict[TopicPartition, int] | None = None  # seeks asked for while partitions are assigned

    def subscribe(self, topics: list[str], listener: ConsumerRebalanceListener) -> None:
        def on_assign(consumer, partitions) -> None:
            assigned = [TopicPartition(p.topic, p.partition) for p in partitions]
            self._assigned |= set(assigned)
            self._starts = {}
            try:
                listener.on_partitions_assigned(assigned)
                for p in partitions:
                    p.offset = self._starts.get(TopicPartition(p.topic, p.partition), p.offset)
            finally:
                self._starts = None
            consumer.assign(partitions)

        def on_revoke(consumer, partitions) -> None:
            revoked = [TopicPartition(p.topic, p.partition) for p in partitions]
            try:
                listener.on_partitions_revoked(revoked)
            finally:
                self._assigned -= set(revoked)
                consumer.unassign()

        self._consumer.subscribe(topics, on_assign=on_assign, on_revoke=on_revoke, on_lost=on_revoke)

    def poll(self, timeout_ms: int = 0, max_records: int = 500) -> dict[TopicPartition, list[Record]]:
        """Up to ``max_records`` records by partition, waiting at most ``timeout_ms`` for the first."""
        polled: dict[TopicPartition, list[Record]] = {}
        for message in self._consumer.consume(max_records, timeout_ms / 1000):
            if (error := message.error()) is not None:
                if error.fatal():
                    raise KafkaError(str(error))
                continue  # librdkafka retries what it can; the probe reports a broker that does not answer
            record = _record(message)
            polled.setdefault(TopicPartition(record.topic, record.partition), []).append(record)
        return polled

    def seek(self, partition: TopicPartition, offset: int) -> None:
        if self._starts is not None:  # in the assignment callback: where the partition starts
            self._starts[partition] = offset
            return
        self._consumer.seek(_partition(partition, offset))

    def commit(self, offsets: dict, timeout_ms: int | None = None) -> None:
        """Sent as ``commit_async`` is: librdkafka's waiting commit takes no timeout, so a broker that stops answering
        would hold it, and the loop with its readiness probe, for as long as it does not answer. ``close`` waits for
        the commits in flight."""
        self.commit_async(offsets)

    def commit_async(self, offsets: dict, callback=None) -> None:
        """A failure is logged by the consumer's ``on_commit`` (``_log_failed_commit``), not by ``callback``."""
        partitions = [_partition(tp, meta.offset) for tp, meta in offsets.items()]
        with _as_kafka_error():
            self._consumer.commit(offsets=partitions, asynchronous=True)

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    def highwater(self, partition: TopicPartition) -> int | None:
        """The partition's end offset as of its last fetch (None before any)."""
        _, high = self._consumer.get_watermark_offsets(_partition(partition), cached=True)
        return high if high is not None and high >= 0 else None

    def position(self, partition: TopicPartition, timeout_ms: int | None = None) -> int:
        offset = self._consumer.position([_partition(partition)])[0].offset
        if offset < 0:
            raise KafkaError(f"no position yet for {partition}")
        return offset

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        with _as_kafka_error():
            topics = self._consumer.list_topics(topic, timeout=5).topics
        return set(topics[topic].partitions) if topic in topics and topics[topic].error is None else None

    def beginning_offsets(self, partitions: Iterable[TopicPartition], timeout_ms: int) -> dict[TopicPartition, int]:
        """Each partition's first offset, asked of the broker: a round trip (the loop's probe)."""
        with _as_kafka_error():
            return {tp: self._consumer.get_watermark_offsets(_partition(tp), timeout=timeout_ms / 1000)[0]
                    for tp in partitions}

    def close(self) -> None:
        self._consumer.close()
