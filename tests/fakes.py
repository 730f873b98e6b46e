"""Fake Kafka clients and scripted records for driving the learner loop without a broker.

A real ``LearnerState`` (tiny test ViT) learns; ``FakeConsumer`` serves scripted records to the loop's own
``_consume`` and both fakes append what the loop does to them (sends, flushes, commits) to a shared event log,
so a test can assert the order in which the loop's side effects happen. Nothing waits or sleeps.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from types import SimpleNamespace

from PIL import Image

import server.learner.stream as stream
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.records import record_headers
from server.learner.consumer import Assigned, PartitionKey
from server.learner.state import LearnerState, open_learner
from server.learner.stream import LearnerLoop
from server.metrics import ServerMetrics
from tests.helpers import settings

TOPIC, STREAM_ID = "images", "cifar10/test-stream"
TP = PartitionKey(TOPIC, 0)
COLORS = ["red", "green", "blue", "yellow", "cyan", "magenta", "gray", "white", "black", "orange"]


@dataclass
class FakeRecord:
    """What the loop reads from a kafka-python ConsumerRecord."""

    topic: str
    partition: int
    offset: int
    headers: list[tuple[str, bytes]]
    value: bytes
    key: bytes | None = None


def jpeg(color: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="JPEG")
    return buf.getvalue()


def record(offset: int, index: int, partition: int = 0, value: bytes | None = None) -> FakeRecord:
    """Sample ``index`` of the test stream (label index % 10) at ``offset``; ``value`` replaces its JPEG."""
    headers = record_headers(index % 10, index, index, STREAM_ID, "cifar10")
    image = jpeg(COLORS[index % 10]) if value is None else value
    return FakeRecord(TOPIC, partition, offset, headers, image, STREAM_ID.encode())


def records(indices: list[int], start: int = 0) -> list[FakeRecord]:
    return [record(start + i, index) for i, index in enumerate(indices)]


class FakeProducer:
    """Keeps every record sent; ``events`` gets ("send", topic) and ("flush",) in the order they happen."""

    def __init__(self, events: list | None = None, **_):
        self.sent: list[dict] = []
        self.events = [] if events is None else events

    def send(self, topic: str, **kw) -> None:
        self.sent.append({"topic": topic, **kw})
        self.events.append(("send", topic))

    def flush(self) -> None:
        self.events.append(("flush",))

    def close(self) -> None:
        pass


class FakeConsumer:
    """``server.learner.consumer.Consumer`` over one partition whose record offsets are their list indices.

    ``poll`` serves at most ``max_records`` from the position, as Kafka does; once the records are drained it
    answers ``idle_polls`` empty polls (the topic is idle), then stops the loop. Commits go to ``committed`` and
    to ``events`` as ("commit", offsets).
    """

    def __init__(self, loop: LearnerLoop, log: list[FakeRecord], events: list | None = None, idle_polls: int = 0):
        self.loop, self.log, self.pos, self.idle_polls = loop, log, 0, idle_polls
        self.committed: dict[str, int] = {}
        self.events = [] if events is None else events

    def subscribe(self, topics: list[str], on_rebalance) -> None:
        starts = on_rebalance(Assigned((TP,)))  # the loop answers with its checkpoint's offset
        self.pos = starts.get(TP, self.pos)

    def poll(self, wait_ms: int, max_records: int) -> list:
        batch = self.log[self.pos: self.pos + max_records]
        self.pos += len(batch)
        if not batch:
            self.events.append(("idle poll",))
            if self.idle_polls == 0:
                self.loop.stop_event.set()
            self.idle_polls -= 1
        return batch

    def seek(self, key: PartitionKey, offset: int) -> None:
        assert key == TP, key
        self.pos = offset

    def assignment(self) -> set[PartitionKey]:
        return {TP}

    def partitions_of(self, topic: str) -> set[int]:
        return {TP.partition}

    def probe(self, timeout_s: float) -> bool:
        return True

    def unread(self, key: PartitionKey) -> int:
        assert key == TP, key
        return len(self.log) - self.pos

    def commit(self, offsets: dict[PartitionKey, int]) -> None:
        """Applied at once (a real one lands later)."""
        self.committed = {str(key): offset for key, offset in offsets.items()}
        self.events.append(("commit", dict(self.committed)))

    def close(self, timeout_s: float) -> None:
        pass


def service(tmp_path, **kw) -> tuple[LearnerState, LearnerLoop, list[tuple[str, int]]]:
    """A real LearnerState (batch size 16) and its loop with a fake producer; also every sample id it learns."""
    kw.setdefault("protocol", ProtocolConfig(eval_period=0))
    cfg = settings(SimpleNamespace(bootstrap="127.0.0.1:9"), tmp_path, **kw)  # no broker is used
    state = open_learner(cfg, ServerMetrics())
    learned: list[tuple[str, int]] = []
    learn = state.learn

    def learn_and_log(batch, key=None):
        learned.extend((s.meta.stream_id, s.meta.sample_index) for s in batch)
        learn(batch, key)

    state.learn = learn_and_log
    loop = LearnerLoop(state)
    loop.producer = FakeProducer()
    return state, loop, learned


def run_loop(monkeypatch, loop: LearnerLoop, log: list[FakeRecord], events: list | None = None,
             idle_polls: int = 0) -> FakeConsumer:
    """The loop's own ``_run`` (connect, consume, checkpoint, commit, close) over fake clients."""
    consumer = FakeConsumer(loop, log, events, idle_polls)
    monkeypatch.setattr(stream, "ensure_topics", lambda kafka, *topics: None)
    monkeypatch.setattr(stream, "open_producer", lambda kafka, **_: FakeProducer(consumer.events))
    monkeypatch.setattr(stream, "open_consumer", lambda client, kafka, max_records: consumer)
    loop.run()
    assert loop.error is None
    return consumer
