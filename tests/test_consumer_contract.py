"""The learner's consumer contract (``server.learner.consumer``), run against both clients and the real broker, the
way river's ``check_estimator`` runs every estimator: what the loop relies on, and nothing of how a client gets there.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from mepo_stream.kafka import KafkaConfig, ensure_topics, open_producer
from server.learner.consumer import Assigned, Consumer, PartitionKey, Rebalance, Record, Revoked
from server.learner.stream import open_consumer
from tests.helpers import holds_for, stalled, wait_for

CLIENTS = ["kafka-python", "librdkafka"]


def topic_with(broker, records_per_partition: int, partitions: int = 2) -> KafkaConfig:
    """A new topic of ``partitions`` partitions holding ``records_per_partition`` records each, and a new group."""
    name = f"contract-{uuid.uuid4().hex[:8]}"
    kafka = KafkaConfig(bootstrap_servers=broker.bootstrap, topic=name, group_id=f"{name}-group")
    ensure_topics(kafka, name, partitions=partitions)
    producer = open_producer(kafka)
    for p in range(partitions):
        for i in range(records_per_partition):
            producer.send(name, value=f"{p}/{i}".encode(), key=b"k", partition=p, headers=[("n", str(i).encode())])
    producer.flush()
    producer.close()
    return kafka


class Member:
    """A consumer and what its handler was told, answering assignments from ``starts``."""

    def __init__(self, client: str, kafka: KafkaConfig, starts: dict[PartitionKey, int] | None = None):
        self.consumer: Consumer = open_consumer(client, kafka, 100)
        self.events: list[tuple[Rebalance, float, float]] = []  # the event, when its handling began and ended
        self.starts, self.records, self.revoke_takes = starts or {}, [], 0.0
        self.consumer.subscribe([kafka.topic], self.handle)

    def handle(self, event: Rebalance) -> dict[PartitionKey, int] | None:
        began = time.monotonic()
        if isinstance(event, Revoked):
            time.sleep(self.revoke_takes)  # a learner writing the partitions' state
        self.events.append((event, began, time.monotonic()))
        return {key: self.starts[key] for key in event.keys if key in self.starts} if isinstance(event, Assigned) \
            else None

    def read(self, n: int, timeout: float = 60.0) -> list[Record]:
        """Poll back to back until ``n`` records came (pauses between polls: the paced members' test below)."""
        deadline = time.monotonic() + timeout
        while len(self.records) < n:
            assert time.monotonic() < deadline, f"{len(self.records)} of {n} records after {timeout:.0f} s"
            self.records.extend(self.consumer.poll(200, 1000))
        return self.records

    def first_offsets(self) -> dict[int, int]:
        first: dict[int, int] = {}
        for r in self.records:
            first.setdefault(r.partition, r.offset)
        return first


@pytest.fixture(params=CLIENTS)
def client(request) -> str:
    return request.param


def test_poll_returns_records_of_the_projects_type_each_partition_in_offset_order_after_its_assignment(broker,
                                                                                                     client):
    kafka = topic_with(broker, 5)
    member = Member(client, kafka)
    try:
        records = member.read(10)
        assert all(isinstance(r, Record) for r in records) and len(records) == 10
        for p in (0, 1):
            mine = [r for r in records if r.partition == p]
            assert [r.offset for r in mine] == list(range(5))
            assert [r.value for r in mine] == [f"{p}/{i}".encode() for i in range(5)]
            assert mine[0].headers == [("n", b"0")] and mine[0].key == b"k" and mine[0].timestamp > 0
        assigned = [e for e, _, _ in member.events if isinstance(e, Assigned)]
        assert set(assigned[0].keys) == {PartitionKey(kafka.topic, 0), PartitionKey(kafka.topic, 1)}
        assert member.consumer.assignment() == set(assigned[0].keys)
        assert member.consumer.partitions_of(kafka.topic) == {0, 1}
        assert member.consumer.probe(timeout_s=5) is True
        wait_for(lambda: member.consumer.poll(0, 1) == [] and member.consumer.unread(assigned[0].keys[0]) == 0,
                 30, "nothing left unread")
    finally:
        member.consumer.close(timeout_s=10)


def test_an_assignment_starts_each_partition_where_the_handler_says_and_seek_moves_it(broker, client):
    kafka = topic_with(broker, 8)
    p0, p1 = PartitionKey(kafka.topic, 0), PartitionKey(kafka.topic, 1)
    member = Member(client, kafka, starts={p0: 5, p1: 2})
    try:
        member.read(3 + 6)
        assert member.first_offsets() == {0: 5, 1: 2}
        member.consumer.seek(p0, 1)
        member.records.clear()
        member.read(7)
        assert member.first_offsets()[0] == 1
    finally:
        member.consumer.close(timeout_s=10)


def where_the_next_member_starts(client: str, kafka: KafkaConfig, records: int) -> dict[int, int]:
    """Each partition's first offset, as a new member of the group reads ``records`` records."""
    member = Member(client, kafka)
    try:
        member.read(records)
        return member.first_offsets()
    finally:
        member.consumer.close(timeout_s=10)


def test_nothing_is_committed_unless_asked_and_a_new_group_starts_at_the_beginning(broker, client):
    kafka = topic_with(broker, 4)
    first = Member(client, kafka)
    first.read(8)
    first.consumer.close(timeout_s=10)
    assert where_the_next_member_starts(client, kafka, 8) == {0: 0, 1: 0}


def test_a_commit_sent_just_before_close_is_read_back_by_the_next_member(broker, client):
    """``commit`` does not wait; ``close`` waits for it, so what was committed is where the group starts next."""
    kafka = topic_with(broker, 10)
    first = Member(client, kafka)
    first.read(20)
    started = time.monotonic()
    first.consumer.commit({PartitionKey(kafka.topic, 0): 7, PartitionKey(kafka.topic, 1): 3})
    assert time.monotonic() - started < 1.0
    first.consumer.close(timeout_s=10)
    assert where_the_next_member_starts(client, kafka, 3 + 7) == {0: 7, 1: 3}


def test_a_revocation_is_an_event_handled_before_the_partitions_go_to_another_member(broker, client):
    """A second member joins: the first is told ``Revoked`` while it polls, and the newcomer is assigned a partition
    only after the first's handler returned (which takes 2 s here: a learner writing the partitions' state)."""
    kafka = topic_with(broker, 3)
    first = Member(client, kafka)
    first.read(6)
    first.revoke_takes = 2.0
    stop = threading.Event()
    polling = threading.Thread(target=lambda: [first.consumer.poll(100, 10) for _ in iter(stop.is_set, True)])
    polling.start()
    second = Member(client, kafka)
    try:
        # Each poll long enough to finish a join: on a loaded machine kafka-python's 100 ms polls each gave up
        # mid-join, and the newcomer was told its assignment after 50 s to over 200 s (7 s with 1 s polls).
        wait_for(lambda: second.consumer.poll(1000, 10) is not None and any(
            isinstance(e, Assigned) and e.keys for e, _, _ in second.events), 120, "the newcomer's assignment")
        revoked = [(e, end) for e, _, end in first.events if isinstance(e, Revoked) and e.keys]
        granted = [began for e, began, _ in second.events if isinstance(e, Assigned) and e.keys]
        assert revoked and granted and revoked[0][1] <= granted[0]
        assert all(isinstance(key, PartitionKey) for key in revoked[0][0].keys)
    finally:
        stop.set()
        polling.join(30)
        second.consumer.close(timeout_s=10)
        first.consumer.close(timeout_s=10)


def test_members_that_pause_between_polls_are_assigned_and_the_group_settles(broker, client):
    """A learner's loop waits for its model thread between polls (a second here, each poll with no wait of its own): a
    group join that ends in such a pause must not be started over, or the members rejoin for as long as they run."""
    kafka = topic_with(broker, 3)
    first = Member(client, kafka)
    first.read(6)
    second = Member(client, kafka)
    stop = threading.Event()

    def paced(member: Member) -> None:
        while not stop.is_set():
            member.consumer.poll(0, 10)
            stop.wait(1.0)  # the model thread's step

    threads = [threading.Thread(target=paced, args=(m,)) for m in (first, second)]
    for thread in threads:
        thread.start()
    try:
        both = {PartitionKey(kafka.topic, 0), PartitionKey(kafka.topic, 1)}

        def split() -> bool:  # a partition each
            mine, theirs = first.consumer.assignment(), second.consumer.assignment()
            return bool(mine and theirs and not mine & theirs and mine | theirs == both)

        wait_for(split, 60, "a partition assigned to each member")
        events = len(first.events) + len(second.events)
        holds_for(lambda: split() and len(first.events) + len(second.events) == events, 8, "no rebalance after it")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        second.consumer.close(timeout_s=10)
        first.consumer.close(timeout_s=10)


def test_a_stalled_broker_is_reported_by_the_probe_and_bounds_every_call(broker, client):
    """The broker stopped (SIGSTOP): no call waits past its bound, and the probe says the broker is not there."""
    kafka = topic_with(broker, 3)
    member = Member(client, kafka)
    member.read(6)
    key = PartitionKey(kafka.topic, 0)
    with stalled(broker.process):
        started = time.monotonic()
        member.consumer.commit({key: 2})
        assert time.monotonic() - started < 1.0
        started = time.monotonic()
        assert member.consumer.probe(timeout_s=2) is False
        assert time.monotonic() - started < 6.0
        started = time.monotonic()
        member.consumer.poll(300, 10)
        assert time.monotonic() - started < 6.0
        started = time.monotonic()
        member.consumer.close(timeout_s=3)
        assert time.monotonic() - started < 8.0
