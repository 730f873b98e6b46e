"""The learner's consumer: one interface, the project's own types. Its two adapters, kafka-python (the default) and
librdkafka (``--consumer librdkafka``), keep its promises, checked by ``tests/test_consumer_contract.py``:

* ``poll`` returns ``Record``s, each partition's in offset order, waiting at most ``wait_ms`` for the first; while
  the member joins its group, until the join is over (kafka-python's adapter: at most ``JOIN_WAIT_S``).
* A rebalance is an event handed to the ``subscribe`` handler while ``poll`` runs, on the client's thread: a
  revocation before the partitions go (their state is written first); an assignment answered with where each starts.
* ``commit`` sends offsets without waiting (the checkpoint is the source of truth); ``close`` waits, at most
  ``timeout_s``, for the commits in flight. ``probe`` asks the broker a round trip: a stopped one keeps its TCP open.
* A broker that cannot be reached raises ``BrokerUnavailable`` (the loop reconnects), never a client's own type.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, Protocol

log = logging.getLogger(__name__)


class PartitionKey(NamedTuple):
    """A topic's partition; ``str`` gives ``topic:N`` (as checkpoints and states carry), ``parse`` reads it."""

    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}:{self.partition}"

    @classmethod
    def parse(cls, key: str) -> PartitionKey:
        topic, partition = key.rsplit(":", 1)
        return cls(topic, int(partition))

    @classmethod
    def of(cls, record) -> PartitionKey:
        return cls(record.topic, record.partition)


@dataclass(frozen=True)
class Record:
    """A consumed record (``mepo_stream.records.KafkaRecord``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] | None
    timestamp: int  # ms; -1 where the client has none


@dataclass(frozen=True)
class Assigned:
    """These partitions are now this member's; the handler answers where each starts (else: where committed)."""

    keys: tuple[PartitionKey, ...]


@dataclass(frozen=True)
class Revoked:
    """These partitions go to another member once the handler returns (or were lost with the member's session)."""

    keys: tuple[PartitionKey, ...]


Rebalance = Assigned | Revoked
OnRebalance = Callable[[Rebalance], dict[PartitionKey, int] | None]  # for ``Assigned``: where each partition starts


class BrokerUnavailable(Exception):
    """The broker did not answer, or answered with an error the client does not retry itself."""


class Consumer(Protocol):
    """A member of the learner's consumer group that commits only what the learner's checkpoint holds."""

    def subscribe(self, topics: list[str], on_rebalance: OnRebalance) -> None: ...
    def poll(self, wait_ms: int, max_records: int) -> list[Record]: ...
    def seek(self, key: PartitionKey, offset: int) -> None: ...
    def commit(self, offsets: dict[PartitionKey, int]) -> None: ...
    def assignment(self) -> set[PartitionKey]: ...
    def unread(self, key: PartitionKey) -> int | None: ...
    def partitions_of(self, topic: str) -> set[int] | None: ...
    def probe(self, timeout_s: float) -> bool: ...
    def close(self, timeout_s: float) -> None: ...


@contextmanager
def unavailable_on(*errors: type[BaseException]) -> Iterator[None]:
    """A client's own errors (``errors``) raised as ``BrokerUnavailable``, which the loop reconnects on."""
    try:
        yield
    except errors as e:
        raise BrokerUnavailable(str(e)) from e


def log_failed_commit(error: object) -> None:
    log.warning("offset commit failed (the checkpoint holds them): %s", error)


def close_within(close: Callable[[], None], timeout_s: float) -> None:
    """Run a client's ``close`` for at most ``timeout_s``; past that the member is left to expire with its session."""
    closing = threading.Thread(target=close, name="mepo-consumer-close", daemon=True)
    closing.start()
    closing.join(timeout_s)
    if closing.is_alive():
        log.warning("the consumer did not close within %.0f s (the broker does not answer); left behind", timeout_s)


# either client's; ``fetch_max_wait_ms`` not Kafka's 500: the embedded broker answers an empty fetch only once it is
# over, so a lone deletion waits it whole (docs/corrections.md)
TIMING = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 2000, "max_poll_interval_ms": 600_000,
          "fetch_max_bytes": 16 * 1024 * 1024, "fetch_max_wait_ms": 100}
