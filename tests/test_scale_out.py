"""Learning scaled out (``--kafka.state_topic``): per-partition sums that add up to the single learner's model.

The unit tests check the pieces (the sums, the learner's step without folding, the state record, the refusals, the
checkpoint formats, a partition handed over, and a revocation through the loop's rebalance listener: the state let
go stands at the handled offset, after the write in flight is acknowledged, and one whose write fails lets the
partition go and stops the learner); the broker tests run real ``mepo serve`` processes on a 4-partition topic: two
learners in a group against one learner alone, and two learners with one of them killed with SIGKILL twice, each
time once it owns partitions and has written their states (the learner that takes them over restores those states).
"""

from __future__ import annotations

import io
import math
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
import yaml
from kafka.errors import KafkaConnectionError, KafkaTimeoutError
from PIL import Image

import server.learner.stream as stream
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.checkpoint import StreamPosition, load_checkpoint, save_checkpoint
from mepo_stream.data import load_split
from mepo_stream.kafka import ensure_topics
from mepo_stream.label_statistics import LabelStatistics
from mepo_stream.learner import OnlineLearner
from mepo_stream.model import create_model
from mepo_stream.records import RecordMeta
from mepo_stream.sampler import SiBlurryConfig
from producers.siblurry import ReplayConfig, produce, stream_id
from server.broker import free_port
from server.config import ServeConfig, model_config, replica_of
from server.learner.book import Sample
from server.learner.changelog import Changelog
from server.learner.consumer import Assigned, BrokerUnavailable, PartitionKey, Revoked
from server.learner.partitioned import GroupCapture, migrated_state, open_group_learner
from server.learner.state import CHECKPOINT, CheckpointCapture, LearnerState, open_learner
from server.learner.stream import LearnerLoop, Persist
from server.metrics import ServerMetrics
from server.snapshot_topic import Origin
from server.state_topic import FORMAT, PartitionState, StateFormatError, decode, encode
from tests.fakes import STREAM_ID, TOPIC, FakeConsumer, FakeProducer, record, service
from tests.helpers import DATA, NO_BROKER, ServeProcess, color_images, http_client, settings, wait_for

STREAM = SiBlurryConfig(seed=1)
PARTITIONS = 4


# --- the pieces -------------------------------------------------------------------------------------------------
def learner(device: str = "cpu", **kw) -> OnlineLearner:
    cfg = settings(NO_BROKER, Path("/tmp/unused"), **kw)
    return OnlineLearner(create_model(model_config(cfg), 10, torch.device(device)), cfg.learner)


CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA GPU")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_sums_of_parts_learned_apart_are_the_sums_of_the_whole(device):
    """Two learners (each numbering classes in its own order) on two halves equal one learner on the whole. The
    label-indexed sums live on the CPU whatever the learner's device (the group's state store adds them there)."""
    torch.set_num_threads(1)  # batch-invariant features (docs "Scale-out": exact with one thread per learner)
    labels = torch.tensor([3, 1, 3, 5, 1, 1, 5, 3, 0, 0, 5, 3])
    images = color_images(labels % 8)
    whole, a, b = learner(device), learner(device), learner(device)
    whole.observe(images, labels)
    parts = []
    for part, rows in ((a, slice(0, 6)), (b, slice(6, 12))):
        sums = LabelStatistics.zeros(10, whole.method.classifier.sums.shape[1], 4)
        _, h, hits = part.statistics_step(images[rows], labels[rows])
        sums.add(h, labels[rows], hits)
        parts.append(sums)
    assert a.exposed == [3, 1, 5] and b.exposed == [5, 3, 0]  # two label maps
    merged = learner(device)
    merged.load_statistics(LabelStatistics.total(parts))
    mine, theirs = merged.statistics(), whole.statistics()
    assert mine.counts.device.type == theirs.sums.device.type == "cpu"
    for name in ("counts", "sums", "second"):
        assert torch.allclose(getattr(mine, name), getattr(theirs, name), rtol=1e-12, atol=0), name
    test = color_images(torch.arange(8), seed=5)
    assert torch.equal(merged.predict(test)["running"], whole.predict(test)["running"])


def test_a_partition_state_survives_the_wire_and_another_format_is_refused():
    origin = Origin("mepo", "{}", ("a", "b"), "ab" * 32, None)
    stats = LabelStatistics.zeros(2, 3, 2)
    stats.add(torch.ones(2, 3), torch.tensor([1, 1]), torch.tensor([1.0, 0.0]))
    state = PartitionState("t:3", stats, 17, {"s": [4, 9]}, origin, "h:1", 5.0, 2.5, 3)
    back = decode(encode(state))
    assert (back.key, back.offset, back.learned, back.origin, back.rate, back.lag) == ("t:3", 17, {"s": [4, 9]},
                                                                                      origin, 2.5, 3)
    assert torch.equal(back.stats.second, stats.second) and back.stats.hits.tolist() == [1.0, 0.0]
    blob = encode(state).replace(FORMAT.encode(), b"mepo-partition-state/9")
    with pytest.raises(StateFormatError, match="mepo-partition-state/9.*another version"):
        decode(blob)
    with pytest.raises(StateFormatError, match="not a readable"):
        decode(b"\x05\x00\x00\x00\x00\x00\x00\x00junk")


@pytest.mark.parametrize("method,classifier,reason", [("misa", "slda", "trains by gradient"),
                                                      ("frozen", "linear", "trains by gradient")])
def test_a_model_that_depends_on_the_order_is_refused_in_a_group(tmp_path, method, classifier, reason):
    cfg = settings(NO_BROKER, tmp_path, method=method, learner=replace(settings(NO_BROKER, tmp_path).learner,
                                                                       classifier=classifier))
    cfg = replace(cfg, kafka=replace(cfg.kafka, state_topic="state"))
    with pytest.raises(ValueError, match=f"--kafka.state_topic.*--method {method}.*{reason}"):
        open_group_learner(cfg, ServerMetrics())


def single_checkpoint(tmp_path: Path, offsets: dict[str, int], fmt: str | None = None) -> ServeConfig:
    """A single learner's checkpoint (its state after 12 samples) at ``offsets``, in ``fmt`` (None: version 1)."""
    cfg = settings(NO_BROKER, tmp_path)
    state = open_learner(cfg, ServerMetrics())
    labels = torch.tensor([2, 7, 2, 7, 4, 4, 2, 7, 4, 2, 2, 7])
    images = color_images(labels % 8)
    state.model_thread.run(state.learn, [Sample(image, RecordMeta(int(y), i, i, "s"))
                                         for i, (image, y) in enumerate(zip(images, labels, strict=True))])
    captured = state.capture()
    assert isinstance(captured, CheckpointCapture)
    saved = captured.checkpoint
    path = saved.__class__(**{**vars(saved), "position": StreamPosition(offsets, {"s": torch.arange(12)})}).save(
        cfg.checkpoint_dir / CHECKPOINT)
    checkpoint = load_checkpoint(path)
    if fmt is None:
        del checkpoint["format"]
    else:
        checkpoint["format"] = fmt
    save_checkpoint(path, checkpoint)
    return cfg


def test_checkpoint_formats_are_read_or_refused_whole(tmp_path):
    v1 = single_checkpoint(tmp_path / "v1", {"images:0": 12})  # written before checkpoints had a format
    assert open_learner(v1, ServerMetrics()).learner.samples_seen == 12
    future = single_checkpoint(tmp_path / "v9", {"images:0": 12}, "mepo-checkpoint/9")
    with pytest.raises(ValueError, match="format 'mepo-checkpoint/9'.*move it away"):
        open_learner(future, ServerMetrics())


def test_a_single_learners_checkpoint_becomes_its_partitions_state_or_is_refused(tmp_path):
    one = single_checkpoint(tmp_path / "one", {"images:0": 12})
    state = open_learner(one, ServerMetrics())
    migrated = migrated_state(one.checkpoint_dir / CHECKPOINT, state.origin, "me", state.learner.statistics().shape)
    assert (migrated.key, migrated.offset, migrated.learned) == ("images:0", 12, {"s": list(range(12))})
    assert torch.equal(migrated.stats.counts, state.learner.statistics().counts)
    assert migrated.stats.samples == 12
    several = single_checkpoint(tmp_path / "several", {"images:0": 6, "images:1": 6})
    with pytest.raises(ValueError, match="over 2 partitions.*cannot be split"):
        migrated_state(several.checkpoint_dir / CHECKPOINT, state.origin, "me", state.learner.statistics().shape)


def test_a_second_learner_in_the_group_of_one_without_a_state_topic_stops_learning(tmp_path):
    state, loop, _ = service(tmp_path)
    loop.consumer = SimpleNamespace(partitions_of=lambda topic: {0, 1})
    loop.on_rebalance(Assigned((PartitionKey(state.cfg.kafka.topic, 0),)))
    assert re.search("another learner joined.*--kafka.state_topic", str(loop.refusal))  # it stops at its next turn


def test_a_refusal_stops_the_learner_with_its_one_line_reason_as_its_error_never_a_traceback(tmp_path, monkeypatch,
                                                                                             caplog):
    """From where it arises (a second learner in the group of one) to the status field and the log: the same
    refusal, its message whole, one line."""
    state, loop, _ = service(tmp_path)
    monkeypatch.setattr(FakeConsumer, "partitions_of", lambda consumer, topic: {0, 1})
    consumer = FakeConsumer(loop, [])
    monkeypatch.setattr(stream, "ensure_topics", lambda kafka, *topics: None)
    monkeypatch.setattr(stream, "open_producer", lambda kafka, **_: FakeProducer())
    monkeypatch.setattr(stream, "open_consumer", lambda *_: consumer)
    with caplog.at_level("ERROR", logger="server.learner.stream"):
        loop.run()
    assert loop.error is not None and loop.error.startswith("another learner joined consumer group")
    logged = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [r.getMessage() for r in logged] == [f"learning stopped: {loop.error}"] and logged[0].exc_info is None


def test_a_state_of_another_model_is_never_merged(tmp_path, monkeypatch):
    def broker_down(self, timeout_s=60.0):
        raise KafkaConnectionError("no broker")

    monkeypatch.setattr(Changelog, "read_all", broker_down)  # the start goes on; states come later
    cfg = settings(NO_BROKER, tmp_path)
    state = open_group_learner(replace(cfg, kafka=replace(cfg.kafka, state_topic="state")), ServerMetrics())
    foreign = replace(state.origin, backbone_sha256="0" * 64)
    stats = LabelStatistics.zeros(*state.learner.statistics().shape)
    stats.add(torch.ones(3, stats.shape[1]), torch.tensor([1, 1, 2]), torch.zeros(stats.shape[2]))
    state.merge_remote(PartitionState("images:1", stats, 3, {}, foreign, "other:1", 0.0, 0.0, 0))
    assert "another model (its backbone_sha256 differ" in str(state.refusal) and state.learner.samples_seen == 0
    state.merge_remote(PartitionState("images:1", stats, 3, {}, state.origin, "other:1", 0.0, 0.0, 0))
    assert state.learner.samples_seen == 3 and state.learner.exposed == [1, 2]  # its own model's state merges
    assert "another model" in str(state.refusal)  # and the refusal stays: learning stops at the loop's next turn
    state.model_thread.shutdown()


def test_newer_states_replace_their_partitions_part_of_the_model(tmp_path, monkeypatch):
    """Many states of 3 partitions, some stale (an older offset), merged in turn: the model is always the sum of
    each partition's newest state, whether the remote total is updated by replacement or summed afresh."""
    monkeypatch.setattr(Changelog, "read_all", lambda self, timeout_s=60.0: {})
    cfg = settings(NO_BROKER, tmp_path)
    state = open_group_learner(replace(cfg, kafka=replace(cfg.kafka, state_topic="state")), ServerMetrics())
    rng, newest = torch.Generator().manual_seed(0), {}
    shape = state.learner.statistics().shape
    for offset in (5, 9, 7, 20, 30, 25, 41):
        for key in ("images:0", "images:1", "images:2"):
            stats = LabelStatistics.zeros(*shape)
            stats.add(torch.randn(offset, shape[1], generator=rng), torch.randint(0, 10, (offset,), generator=rng),
                      torch.zeros(shape[2]))
            state.merge_remote(PartitionState(key, stats, offset, {}, state.origin, "other:1", 0.0, 0.0, 0))
            if offset >= newest.get(key, (-1,))[0]:
                newest[key] = (offset, stats)
            expected = LabelStatistics.total(s for _, s in newest.values())
            got = state.learner.statistics()
            assert state.learner.samples_seen == expected.samples
            assert torch.allclose(got.second, expected.second, rtol=1e-12, atol=1e-9)
            assert torch.allclose(got.sums, expected.sums, rtol=1e-12, atol=1e-9)
    state.model_thread.shutdown()


def test_a_partition_handed_over_is_restored_from_its_last_state_and_every_model_stays_the_sum(tmp_path,
                                                                                                 monkeypatch):
    """Two group learners over one (faked, compacted) state topic, through their state objects: each restores
    its assigned partitions from their newest states and merges the others', a written state reaches the other
    learner, and a partition let go and taken over moves as its last written state (what the giver learned after
    it is not in any model, and is learned again from its offset by the taker): at every point both models are the
    sum of every partition's newest state on the topic."""
    topic: dict[str, PartitionState] = {}  # key -> newest state

    def write(self, states):
        topic.update({s.key: s for s in states})
        return 100 * len(states)

    monkeypatch.setattr(Changelog, "read_all", lambda self, timeout_s=60.0: dict(topic))
    monkeypatch.setattr(Changelog, "write", write)
    a, b = (open_group_learner(replace(cfg, kafka=replace(cfg.kafka, state_topic="state")), ServerMetrics())
            for cfg in (settings(NO_BROKER, tmp_path / "a"), settings(NO_BROKER, tmp_path / "b")))
    shape, rng = a.learner.statistics().shape, torch.Generator().manual_seed(0)

    def sums(n: int) -> LabelStatistics:
        stats = LabelStatistics.zeros(*shape)
        stats.add(torch.randn(n, shape[1], generator=rng), torch.randint(0, 10, (n,), generator=rng),
                  torch.zeros(shape[2]))
        return stats

    def state(key: str, stats: LabelStatistics, offset: int, by: LearnerState) -> PartitionState:
        return PartitionState(key, stats, offset, {}, by.origin, by.membership.learner_id, time.time(), 0.0, 0)

    def assert_the_sum_of_the_topic(*learners: LearnerState) -> None:
        expected = LabelStatistics.total(st.stats for st in topic.values())
        for learner in learners:
            got = learner.learner.statistics()
            assert learner.learner.samples_seen == expected.samples
            for name in ("counts", "sums", "second"):
                assert torch.allclose(getattr(got, name), getattr(expected, name), rtol=1e-12, atol=1e-9), name

    topic.update({key: state(key, sums(n), n, a) for key, n in (("images:0", 7), ("images:1", 5), ("images:2", 9))})
    a.assign(["images:0", "images:1"])
    b.assign(["images:2"])
    assert sorted(a.membership.own) == ["images:0", "images:1"] and sorted(b.membership.own) == ["images:2"]
    assert_the_sum_of_the_topic(a, b)
    size = a.intake.limits.size  # a learns 4 more of images:0 and writes its state; b merges it
    images = torch.randint(0, 256, (4, 3, size, size), dtype=torch.uint8, generator=rng)
    a.membership.update(a.learner, images, torch.tensor([0, 1, 2, 3]), None, "images:0", torch.arange(4))
    written = state("images:0", a.membership.own["images:0"].clone(), 11, a)
    a.membership.write(GroupCapture({"images:0": 11}, written.written_at, [written], []), None)
    b.merge_remote(written)
    assert_the_sum_of_the_topic(a, b)
    a.membership.own["images:0"].add(torch.randn(3, shape[1], generator=rng), torch.tensor([1, 2, 3]),
                                     torch.zeros(shape[2]))  # learned after the last write: not kept
    a.revoke(["images:0"])
    b.assign(["images:0", "images:2"])
    assert torch.equal(b.membership.own["images:0"].sums, written.stats.sums) and "images:0" not in a.membership.own
    assert b.intake.book.partition("images:0")[0] == 11  # the taker goes on from the written offset
    assert_the_sum_of_the_topic(a, b)
    for learner in (a, b):
        learner.model_thread.shutdown()


# --- a partition revoked from a group learner's loop ------------------------------------------------------------
P0, P1 = f"{TOPIC}:0", f"{TOPIC}:1"


class AckedWhenWaitedFor:
    """A state write sent and not yet acknowledged: the write (and its acknowledgement) happens only once someone
    waits for it (``result``), or once ``DeferredWriter.drain`` lets the broker catch up; ``done()`` is False
    until then."""

    def __init__(self, fn, args):
        self.fn, self.args, self.value, self.error, self._done = fn, args, None, None, False

    def done(self) -> bool:
        return self._done

    def result(self, timeout=None):
        """The write's offsets once acknowledged; a failed write raises, now and at every later call (as a
        ``concurrent.futures.Future`` does)."""
        if not self._done:
            try:
                self.value = self.fn(*self.args)
            except Exception as e:
                self.error = e
            self._done = True
        if self.error is not None:
            raise self.error
        return self.value


class DeferredWriter:
    """The loop's checkpoint writer (``LearnerLoop.writer``) with every write in flight until it is waited for."""

    def __init__(self):
        self.futures: list[AckedWhenWaitedFor] = []

    def submit(self, fn, *args) -> AckedWhenWaitedFor:
        self.futures.append(AckedWhenWaitedFor(fn, args))
        return self.futures[-1]

    def drain(self) -> None:
        """The broker acknowledges every write still in flight, in the order they were sent."""
        for future in self.futures:
            future.result()

    def shutdown(self) -> None:
        """What the loop calls as it ends (``ThreadPoolExecutor.shutdown``): nothing runs in a thread here."""


def faked_state_topic(monkeypatch, events: list) -> dict[str, PartitionState]:
    """A compacted state topic (key -> newest state) behind ``Changelog``; each write, once acknowledged, is
    logged in ``events`` as ("acked", {key: offset})."""
    topic: dict[str, PartitionState] = {}

    def write(self, states):
        topic.update({s.key: s for s in states})
        events.append(("acked", {s.key: s.offset for s in states}))
        return 100 * len(states)

    monkeypatch.setattr(Changelog, "read_all", lambda self, timeout_s=60.0: dict(topic))
    monkeypatch.setattr(Changelog, "write", write)
    return topic


def group_loop(root: Path, topic: dict[str, PartitionState], events: list, keys: list[str]
               ) -> tuple[LearnerState, LearnerLoop]:
    """A group learner assigned ``keys`` over the faked state topic, and its loop (fake producer, no consumer: a
    revocation commits nothing). The moment its membership lets partitions go is logged in ``events`` as
    ("let go", keys, {key: the offset of its state on the topic then})."""
    cfg = settings(NO_BROKER, root, protocol=ProtocolConfig(eval_period=0))
    state = open_group_learner(replace(cfg, kafka=replace(cfg.kafka, state_topic="state")), ServerMetrics())
    state.assign(keys)
    revoke = state.membership.revoke

    def let_go(learner, revoked: list[str]) -> list[str]:
        events.append(("let go", revoked, {k: topic[k].offset for k in revoked if k in topic}))
        return revoke(learner, revoked)

    state.membership.revoke = let_go
    loop = LearnerLoop(state)
    loop.producer = FakeProducer()
    return state, loop


def revoke(loop: LearnerLoop, *partitions: int) -> None:
    """What the consumer does in a rebalance that takes ``partitions`` away: the loop is told."""
    loop.on_rebalance(Revoked(tuple(PartitionKey(TOPIC, p) for p in partitions)))


def test_a_revoked_partitions_state_stands_at_the_offset_its_learner_handled_when_it_is_let_go(tmp_path,
                                                                                                 monkeypatch):
    """A group learner's loop, revoked a partition holding records of three kinds: learned and written, learned
    after the last write, and read but still pending. When the partition is let go, its state on the (faked)
    state topic stands at the offset of every record handed to the learner, with exactly their ids and counts
    (nothing learned after the last write lost, nothing counted twice); the giver's model keeps that state, and the
    taker goes on from it, so the partition's records end up learned exactly once."""
    events: list = []
    topic = faked_state_topic(monkeypatch, events)
    a, loop = group_loop(tmp_path / "a", topic, events, [P0, P1])
    part0 = [record(offset, offset) for offset in range(30)]  # sample index = offset, label = index % 10
    part1 = [record(offset, 100 + offset, partition=1) for offset in range(10)]
    loop.accept(part0[:20] + part1)
    a.learn_pending()
    loop.persist(Persist.BEFORE_REVOKE)  # the last periodic write: images:0 at 20, images:1 at 10
    loop.accept(part0[20:24])
    a.learn_pending()  # learned after it
    loop.accept(part0[24:27])  # read, still pending
    assert (topic[P0].offset, a.offsets[P0], a.intake.waiting()[P0]) == (20, 24, 3)
    revoke(loop, 0)
    assert events == [("acked", {P0: 20, P1: 10}), ("acked", {P0: 27}), ("let go", [P0], {P0: 27})]
    given = topic[P0]
    assert given.offset == 27 and given.learned == {STREAM_ID: list(range(27))}
    assert given.stats.counts.tolist() == torch.bincount(torch.arange(27) % 10, minlength=10).double().tolist()
    assert P0 not in a.membership.own and a.membership.remote[P0] is given  # the giver's model keeps that state
    assert a.learner.samples_seen == 27 + 10 and a.offsets == {P1: 10}

    b, taker = group_loop(tmp_path / "b", topic, events, [P0])
    assert b.offsets == {P0: 27} and torch.equal(b.membership.own[P0].sums, given.stats.sums)
    taker.accept(part0[24:])  # the taker reads from before the offset: what the giver learned is a replay
    b.learn_pending()
    taker.persist(Persist.BEFORE_REVOKE)
    assert topic[P0].offset == 30 and topic[P0].learned == {STREAM_ID: list(range(30))}
    assert topic[P0].stats.samples == 30 and b.intake.book.replays_skipped == 3
    for learner in (a, b):
        learner.model_thread.shutdown()


@pytest.mark.parametrize("read_after", [0, 4])
def test_a_revocation_waits_for_the_state_write_in_flight_before_letting_the_partition_go(tmp_path, monkeypatch,
                                                                                          read_after):
    """A group learner's periodic state write is in flight (sent, not acknowledged: ``DeferredWriter``) when its
    partition is revoked, with nothing more (0) or 4 more records read since its capture. The revocation waits for
    that write's acknowledgement, then writes what was learned after it, and only then lets the partition go; no
    write still in flight can later move the partition's state back behind the offset it was let go at."""
    events: list = []
    topic = faked_state_topic(monkeypatch, events)
    a, loop = group_loop(tmp_path, topic, events, [P0])
    loop.writer = writer = DeferredWriter()
    loop.accept([record(offset, offset) for offset in range(16)])
    a.learn_pending()
    loop.persist(Persist.ASKED)  # the periodic write, in flight
    assert P0 not in topic and not loop.writing.done()
    loop.accept([record(offset, offset) for offset in range(16, 16 + read_after)])
    revoke(loop, 0)
    handled = 16 + read_after
    writes = [{P0: 16}] + ([{P0: handled}] if read_after else [])
    assert events == [("acked", w) for w in writes] + [("let go", [P0], {P0: handled})]
    writer.drain()  # whatever is still in flight lands now
    assert topic[P0].offset == handled and topic[P0].stats.samples == handled
    assert a.learner.samples_seen == handled and a.membership.remote[P0] is topic[P0]
    a.model_thread.shutdown()


class RebalancingConsumer(FakeConsumer):
    """A consumer of images:0 and images:1 in a rebalance that takes images:0 away at the first poll: the handler
    runs inside ``poll``, a handler that raises makes ``poll`` raise (the loop would reconnect), and ``close``
    revokes what is still assigned."""

    def __init__(self, loop: LearnerLoop):
        super().__init__(loop, [])
        self.assigned, self.polls = [PartitionKey(TOPIC, 0), PartitionKey(TOPIC, 1)], 0

    def subscribe(self, topics, on_rebalance) -> None:
        self.on_rebalance = on_rebalance

    def revoke(self, gone: list[PartitionKey]) -> None:
        self.assigned = [key for key in self.assigned if key not in gone]
        try:
            self.on_rebalance(Revoked(tuple(gone)))
        except Exception as e:
            raise BrokerUnavailable("User rebalance callback throws an error") from e

    def poll(self, wait_ms: int, max_records: int) -> list:
        self.polls += 1
        if self.polls == 1:
            self.revoke([PartitionKey(TOPIC, 0)])
        else:  # a loop that goes on after the failure: stop it here
            self.loop.stop_event.set()
        return []

    def assignment(self) -> set[PartitionKey]:
        return set(self.assigned)

    def unread(self, key: PartitionKey) -> None:
        return None

    def close(self, timeout_s: float) -> None:
        self.revoke(list(self.assigned))


def test_a_failed_state_write_during_a_revocation_lets_the_partition_go_and_stops_the_learner(tmp_path,
                                                                                              monkeypatch):
    """The state write in flight when images:0 is revoked fails (the broker never acknowledges it). The learner lets
    the partition go all the same (its membership no longer claims it, its model keeps none of the partition's
    unwritten sums), the book does not count the failed capture as saved, and the loop stops with an error that
    names the partition, its offset and the cause, instead of reconnecting every 2 s forever without learning.
    Nothing was committed: a learner that takes the partitions over learns every record once."""
    events: list = []
    topic = faked_state_topic(monkeypatch, events)
    a, loop = group_loop(tmp_path / "a", topic, events, [P0, P1])
    loop.writer = DeferredWriter()
    part0, part1 = [record(o, o) for o in range(16)], [record(o, 100 + o, partition=1) for o in range(8)]
    loop.accept(part0 + part1)
    a.learn_pending()
    loop.persist(Persist.ASKED)  # the periodic write of both partitions, in flight

    def unacknowledged(self, states):
        raise KafkaTimeoutError("Timeout after waiting for 30000 ms")

    acknowledged = Changelog.write
    monkeypatch.setattr(Changelog, "write", unacknowledged)
    let_go, seen = a.membership.revoke, []

    def watched(learner, keys: list[str]) -> list[str]:  # what the book counts as saved when a partition goes
        seen.append((keys, sorted(a.intake.book.unsaved_keys())))
        return let_go(learner, keys)

    a.membership.revoke = watched
    consumer, connects = RebalancingConsumer(loop), []
    monkeypatch.setattr(stream, "ensure_topics", lambda kafka, *topics: None)
    monkeypatch.setattr(stream, "open_producer", lambda kafka, **_: FakeProducer())
    monkeypatch.setattr(stream, "open_consumer", lambda *_: connects.append(1) or consumer)
    loop.run()
    assert len(connects) == 1 and consumer.polls == 1  # stopped at the turn after the revocation, no reconnection
    assert loop.error is not None and re.search(rf"{P0} at offset 16\b", loop.error), loop.error
    assert "KafkaTimeoutError" in loop.error and "Timeout after waiting" in loop.error
    assert seen == [([P0], [P0, P1]), ([P1], [P1])]  # the failed capture is not counted as saved
    assert [e[:2] for e in events] == [("let go", [P0]), ("let go", [P1])] and topic == {}
    assert a.membership.own == {} and a.offsets == {} and loop.writing is None
    assert a.learner.samples_seen == 0  # no unwritten sums of a partition let go stay in the model

    monkeypatch.setattr(Changelog, "write", acknowledged)  # the broker is back
    b, taker = group_loop(tmp_path / "b", topic, events, [P0, P1])  # restarted: from the last written states
    assert b.offsets == {P0: 0, P1: 0}
    taker.accept(part0 + part1)
    b.learn_pending()
    taker.persist(Persist.BEFORE_REVOKE)
    assert {k: (s.offset, s.stats.samples) for k, s in topic.items()} == {P0: (16, 16), P1: (8, 8)}
    for learner in (a, b):
        learner.model_thread.shutdown()


# --- against the real broker ------------------------------------------------------------------------------------
def group_member(base: ServeConfig, root: Path, group: str) -> ServeConfig:
    """A learner of ``group`` on ``base``'s image topic: the group's state topic, its own port and directory."""
    kafka = replace(base.kafka, state_topic=f"{base.kafka.topic}-state-{group}",
                    group_id=f"{base.kafka.group_id}-{group}",
                    snapshot_topic=f"{base.kafka.topic}-snapshots-{group}")
    return replace(base, kafka=kafka, port=free_port(), checkpoint_dir=root / f"{group}-{free_port()}",
                   checkpoint_every=16)


def learned_all(cfg: ServeConfig, n: int) -> dict[str, PartitionState] | None:
    """Every partition's newest state once together they hold all ``n`` records, else None."""
    states = Changelog(cfg.kafka).read_all()
    return states if len(states) == PARTITIONS and sum(s.offset for s in states.values()) == n else None


def total(states: dict[str, PartitionState]) -> LabelStatistics:
    return LabelStatistics.total(s.stats for s in states.values())


def assert_same_model(a: LabelStatistics, b: LabelStatistics, cfg: ServeConfig, origin: Origin) -> None:
    """The sums agree to 1e-9 relative, and at every shrinkage the test set's top-1 predictions are identical."""
    for name in ("counts", "sums", "second"):
        x, y = getattr(a, name), getattr(b, name)
        assert ((x - y).abs().max() / x.abs().max()).item() <= 1e-9, name
    torch.set_num_threads(1)
    reference = OnlineLearner(create_model(model_config(cfg), len(origin.class_names)), cfg.learner)
    assert reference.method.backbone_sha256 == origin.backbone_sha256  # the learners' model, rebuilt here
    test = load_split(replace(cfg.data, load_size=cfg.limits.size), "test")
    h = reference.encode(test.images).feature
    predictions = []
    for stats in (a, b):
        reference.load_statistics(stats)
        lda = reference.method.classifier
        predictions.append([reference.to_labels(lda.scores(h, k).argmax(1)) for k in range(len(lda.shrinkage))])
        print(f"shrinkage chosen from the summed prequential hits: {float(lda.shrinkage[lda.chosen])}")
    for k, (pa, pb) in enumerate(zip(*predictions, strict=True)):
        assert torch.equal(pa, pb), f"shrinkage #{k}"


def png_files(cfg: ServeConfig, count: int = 8) -> list[bytes]:
    """The first test images of ``cfg``'s dataset, as PNG files."""
    test = load_split(replace(cfg.data, load_size=cfg.limits.size), "test")
    out = []
    for image in test.images[:count]:
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def start(cfgs: list[ServeConfig], tmp_path: Path) -> list[ServeProcess]:
    """``mepo serve`` for each config, waited for until each answers."""
    procs = [ServeProcess(c, tmp_path / f"{c.port}.log") for c in cfgs]
    for proc, cfg in zip(procs, cfgs, strict=True):
        with http_client(cfg) as http:
            wait_for(lambda proc=proc, http=http: proc.running() and http.get("/livez").is_success, 120,
                     f"learner {cfg.port}",
                     ignore=(httpx.TransportError,))
    return procs


def stop(procs: list[ServeProcess]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(60)


def test_two_learners_on_four_partitions_build_the_single_learners_model(broker, tmp_path):
    # The shrinkage pinned: the prequential hits that choose it depend on which model predicted each batch, which a
    # group's split changes; the sums, and with them the predictions and novelty scores, do not.
    base = settings(broker, tmp_path)
    base = replace(base, learner=replace(base.learner, slda_shrinkage=(0.2,)))
    ensure_topics(base.kafka, base.kafka.topic, partitions=PARTITIONS)
    single = group_member(base, tmp_path, "single")
    pair = [group_member(base, tmp_path, "pair") for _ in range(2)]
    replica = replica_of(pair[0], port=free_port())
    procs = start([single, *pair, replica], tmp_path)
    try:
        n = produce(DATA, STREAM, base.kafka, ReplayConfig(partitions=PARTITIONS, partition_by="position"))
        alone = wait_for(lambda: learned_all(single, n), 180, "the single learner's states")
        split = wait_for(lambda: learned_all(pair[0], n), 180, "the pair's states")
        assert len({s.learner for s in split.values()}) == 2, "both learners of the pair learned partitions"
        assert len({s.learner for s in alone.values()}) == 1
        assert_same_model(total(alone), total(split), single, next(iter(alone.values())).origin)
        with pytest.raises(ValueError, match="another model \\(its model_config differ"):  # another seed
            open_group_learner(replace(pair[0], seed=1), ServerMetrics())
        answers, novelty = [], []
        for cfg in [*pair, replica, single]:  # each serves the merged model; the learners say who learns what
            with http_client(cfg) as http:
                status = wait_for(lambda h=http: (s := h.get("/v1/status").json())["samples_seen"] == n and s,
                                  60, "the merged model")
                files = [("files", (f"{i}.png", png, "image/png")) for i, png in enumerate(png_files(single))]
                answer = http.post("/v1/predict", files=files).json()
                answers.append([p["top_k"][0]["label"] for p in answer["predictions"]])
                novelty.append(([p["novelty"] for p in answer["predictions"]], answer["novelty_threshold"]))
                metrics = http.get("/metrics").text
            if cfg.role == "learner":  # evaluated at the global counts, the sum over partitions
                assert status["anytime_accuracy"]["samples"] == [64, 128, 192]
                assert len(status["anytime_accuracy"]["novelty_auroc"]) == 3  # how well the score tells, there
                assert re.search(r"^mepo_anytime_novelty_auroc_ratio \S+$", metrics, re.M)
                assert re.search(r'^mepo_predicted_images_total\{novel="false"\} \d', metrics, re.M)
                assert sum(status["partition_samples"].values()) == n and len(status["partition_samples"]) == 4
                assert sorted(p for e in status["learners"].values() for p in e["partitions"]) == sorted(split)
                # Prometheus sees the partitions the status lists
                assert sum(float(v) for v in re.findall(r"^mepo_partition_samples\{[^}]*\} (\S+)$", metrics,
                                                        re.M)) == n
        assert answers[0] == answers[1] == answers[2] == answers[3], answers
        for scores, _ in novelty[1:]:  # the novelty scores are made of the same sums: the group's are one learner's
            assert scores == pytest.approx(novelty[0][0], rel=1e-6) and all(map(math.isfinite, scores))
        for _, threshold in novelty[1:3]:  # the group's learners (and the replica) agree on the threshold: a sum of
            assert threshold == pytest.approx(novelty[0][1], rel=1e-6)  # the partitions' (each scored its own)
    finally:
        stop(procs)


def owns_partitions(cfg: ServeConfig) -> bool:
    """Whether the learner ``cfg`` owns partitions now (its ``mepo_partitions_owned`` gauge)."""
    with http_client(cfg) as http:
        owned = re.search(r"^mepo_partitions_owned (\S+)$", http.get("/metrics").text, re.M)
    return owned is not None and float(owned.group(1)) > 0


def written_by(cfg: ServeConfig, since: float) -> dict[str, PartitionState]:
    """The partitions whose newest state on ``cfg``'s state topic the learner ``cfg`` wrote after ``since``."""
    me = f"{socket.gethostname()}:{cfg.port}"
    return {k: s for k, s in Changelog(cfg.kafka).read_all().items() if s.learner == me and s.written_at > since}


def test_kill_9_of_a_learner_that_owns_partitions_mid_stream_twice_the_taker_restores_its_last_states(broker,
                                                                                                     tmp_path):
    """Two learners of a group (and a single learner beside them) on a stream that arrives in three parts: the
    first 64 records, the first 128, then all 200 (each part replays the one before: those records are skipped as
    replays). After each of the first two parts, the second learner of the pair is killed with SIGKILL once it
    owns partitions and has written their states since it started, and started again: killed mid-stream whatever
    the machine's speed. Whoever takes its partitions over restores them from the dead learner's last states:
    every sample is learned exactly once (a taker that started such a partition from nothing would lose what the
    dead learner had learned of it, and the states would not add up to the stream), what the dead learner had
    written is in its partitions' final states, and the model is the single learner's. The client is the default:
    a rebalance reaches the learner as the consumer contract's events, with either client
    (``tests/test_consumer_contract.py``)."""
    base = settings(broker, tmp_path)
    ensure_topics(base.kafka, base.kafka.topic, partitions=PARTITIONS)
    single = group_member(base, tmp_path, "single")
    pair = [group_member(base, tmp_path, "pair") for _ in range(2)]
    procs = start([single, *pair], tmp_path)
    replay = ReplayConfig(partitions=PARTITIONS, partition_by="position")
    killed: list[dict[str, PartitionState]] = []
    sent = 0
    try:
        for part in (64, 128):  # the fault: the second learner of the pair, once it owns partitions and wrote them
            started = time.time()
            wait_for(lambda: all(owns_partitions(c) for c in pair), 120, "both learners of the pair own partitions",
                     ignore=(httpx.TransportError,))
            sent += produce(DATA, STREAM, base.kafka, replace(replay, limit=part))
            killed.append(wait_for(lambda started=started: written_by(pair[1], started), 120,
                                   "states of the learner to kill"))
            procs[2].send_signal(signal.SIGKILL)
            procs[2].wait()
            procs[2:] = start([pair[1]], tmp_path)
        n = sent + produce(DATA, STREAM, base.kafka, replay)
        alone = wait_for(lambda: learned_all(single, n), 240, "the single learner's states")
        split = wait_for(lambda: learned_all(pair[0], n), 240, "the pair's states after the kills")
        sid = stream_id(DATA, STREAM)
        learned = sorted(i for s in split.values() for i in s.learned[sid])
        assert learned == sorted(i for s in alone.values() for i in s.learned[sid]) and len(learned) == 200
        assert total(split).samples == total(alone).samples == 200, "a sample lost or learned twice"
        for states in killed:  # what the dead learner had written is part of what its partitions hold at the end
            for key, state in states.items():
                assert set(state.learned.get(sid, [])) <= set(split[key].learned[sid]), key
                assert split[key].offset >= state.offset and split[key].stats.samples >= state.stats.samples, key
        assert_same_model(total(alone), total(split), single, next(iter(alone.values())).origin)
    finally:
        stop(procs)


def test_the_scale_out_recipe_runs_two_learners_one_replica_on_four_partitions():
    """``deploy/compose.scale-out.yaml`` over ``deploy/compose.yaml``: what docs/scale-out.md promises."""
    loader = type("ComposeLoader", (yaml.SafeLoader,), {})
    loader.add_constructor("!override", lambda load, node: load.construct_sequence(node))  # Compose's merge tag
    deploy = Path(__file__).parents[1] / "deploy"
    services = yaml.load((deploy / "compose.scale-out.yaml").read_text(), loader)["services"]
    base = yaml.safe_load((deploy / "compose.yaml").read_text())["services"]
    assert set(services) - {"topics"} <= set(base)
    assert "partitions=4" in services["topics"]["command"][0]
    learner = services["learner"]
    assert learner["deploy"]["replicas"] == 2 and "--kafka.state_topic mepo.state" in learner["command"][0]
    assert learner["depends_on"]["topics"]["condition"] == "service_completed_successfully"
    assert services["replica"]["deploy"]["replicas"] == 1
    assert "--replay.partitions 4 --replay.partition_by position" in services["producer"]["command"][0]
    config = services["prometheus"]["command"][0].split("=", 1)[1].removeprefix("/etc/prometheus/")
    scrape = yaml.safe_load((deploy / "prometheus" / config).read_text())["scrape_configs"]
    assert {"names": ["learner"], "type": "A", "port": 8000} in [c for j in scrape for c in j.get("dns_sd_configs", [])]
    assert (Path(__file__).parents[1] / "docs" / "scale-out.md").is_file()
    if promtool := shutil.which("promtool"):  # CI installs it (.ci/run)
        subprocess.run([promtool, "check", "config", str(deploy / "prometheus" / config)], check=True,
                       capture_output=True)
