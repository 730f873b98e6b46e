"""Fake Kafka clients and scripted records for driving the learner loop without a broker.

A real ``LearnerState`` (tiny test ViT) learns; ``FakeConsumer`` serves scripted records to the loop's own
``_consume`` and both fakes append what the loop does to them (sends, flushes, commits) to a shared event log,
so a test can assert the order in which the loop's side effects happen. Nothing waits or sleeps.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from types import SimpleNamespace

from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata
from PIL import Image

import server.learner.stream as stream
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.records import record_headers
from server.learner.state import LearnerState, open_learner
from server.learner.stream import LearnerLoop
from server.metrics import ServerMetrics
from tests.helpers import settings

TOPIC, STREAM_ID = "images", "cifar10/test-stream"
TP = TopicPartition(TOPIC, 0)
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
    """The part of KafkaConsumer the loop uses, over one partition whose record offsets are their list indices.

    ``poll`` serves at most ``max_records`` from the position, as Kafka does; once the records are drained it
    answers ``idle_polls`` empty polls (the topic is idle), then stops the loop. Commits go to ``committed`` and
    to ``events`` as ("commit", offsets).
    """

    def __init__(self, loop: LearnerLoop, log: list[FakeRecord], events: list | None = None, idle_polls: int = 0):
        self.loop, self.log, self.pos, self.idle_polls = loop, log, 0, idle_polls
        self.committed: dict[str, int] = {}
        self.options: dict = {}  # what the loop opened the consumer with (``run_loop``)
        self.events = [] if events is None else events

    def subscribe(self, topics: list[str], listener) -> None:
        listener.on_partitions_assigned([TP])  # the loop seeks to its checkpoint's offset

    def poll(self, timeout_ms: int, max_records: int) -> dict:
        assert timeout_ms is not None  # the loop must come back to its controls (stop, pause, checkpoint)
        batch = self.log[self.pos: self.pos + max_records]
        self.pos += len(batch)
        if not batch:
            self.events.append(("idle poll",))
            if self.idle_polls == 0:
                self.loop.stop_event.set()
            self.idle_polls -= 1
        return {TP: batch} if batch else {}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        assert tp == TP, tp
        self.pos = offset

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {TP.partition}

    def beginning_offsets(self, tps, timeout_ms: int) -> dict:
        return {tp: 0 for tp in tps}

    def highwater(self, tp: TopicPartition) -> int:
        assert tp == TP, tp
        return len(self.log)

    def position(self, tp: TopicPartition, timeout_ms: int) -> int:
        assert tp == TP and timeout_ms is not None, (tp, timeout_ms)  # a stalled broker must not hang the loop
        return self.pos

    def commit(self, offsets: dict, timeout_ms: int) -> None:
        assert timeout_ms is not None  # a stalled broker must not hang the loop
        assert all(meta == OffsetAndMetadata(meta.offset, "", -1) for meta in offsets.values()), offsets
        self.committed = {stream.tp_key(tp): meta.offset for tp, meta in offsets.items()}
        self.events.append(("commit", dict(self.committed)))

    def commit_async(self, offsets: dict, callback) -> None:
        """Applied at once (a real one lands at a later poll); the callback gets the response, as kafka-python's."""
        self.commit(offsets, timeout_ms=0)
        callback(offsets, object())

    def close(self) -> None:
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
    monkeypatch.setattr(stream, "KafkaConsumer", lambda **options: consumer.options.update(options) or consumer)
    monkeypatch.setattr(stream, "LibrdkafkaConsumer", lambda settings: consumer.options.update(settings) or consumer)
    loop.run()
    assert loop.error is None
    return consumer
