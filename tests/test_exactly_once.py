"""Exactly once, with the interleavings forced: the learner loop driven by fake Kafka records, no broker.

A real ``LearnerState`` (tiny test ViT) learns; a fake consumer serves scripted records through the loop's own
``_consume``, or the tests call ``accept`` / ``learn_pending`` themselves, so a replay arrives exactly while
its original is still pending in a partial mini-batch, or inside the learning step. Nothing waits or sleeps.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from mepo_stream.checkpoint import LearnerCheckpoint
from mepo_stream.records import RecordMeta
from server.learner.book import Sample, StreamBook
from server.learner.state import CHECKPOINT, LearnerState
from tests.fakes import STREAM_ID, FakeConsumer, jpeg, record, records, run_loop, service


def assert_each_learned_once(state: LearnerState, learned: list[tuple[str, int]], indices: range) -> None:
    counts = Counter(learned)
    assert not [i for i, n in counts.items() if n > 1], "learned twice"
    assert sorted(i for _, i in learned) == list(indices)
    assert state.learner.samples_seen == len(indices)
    assert sorted(state.intake.book.position().learned[STREAM_ID].tolist()) == list(indices)


# --- the race: replays of samples still pending in a partial mini-batch ---------------------------------------
def test_replays_of_samples_still_in_a_partial_batch_are_skipped_through_the_loop(tmp_path, monkeypatch):
    """The end-to-end test's stream with no idle gap: 100 samples, then all 200 (the first 100 replays).

    With batch size 16, samples 96..99 wait in a partial batch; every record after them is a skipped replay, so
    the batch never fills and the topic never idles until the replays of 96..99 arrive. Checking only the
    learned ids let those through: 204 samples learned.
    """
    state, loop, learned = service(tmp_path)
    log = records(list(range(100)) + list(range(200)))
    consumer = run_loop(monkeypatch, loop, log)
    assert_each_learned_once(state, learned, range(200))
    assert state.intake.book.replays_skipped == 100
    assert state.metrics.registry.get_sample_value("mepo_replayed_samples_skipped_total") == 100
    assert state.intake.book.offsets == {"images:0": 300} and consumer.committed == {"images:0": 300}
    assert state.intake.book.position().offsets == {"images:0": 300}


def test_a_replay_of_a_pending_sample_is_skipped(tmp_path):
    state, loop, learned = service(tmp_path)
    for r in records(list(range(20))):
        loop.accept([r])
        if len(state.intake.book.pending) == 16:
            loop.state.learn_pending()
    assert [s.meta.sample_index for _, _, s in state.intake.book.pending] == [16, 17, 18, 19]
    for r in records([16, 17, 18, 19, 3], start=20):  # replays: four pending, one learned
        loop.accept([r])
    assert len(state.intake.book.pending) == 4 and state.intake.book.replays_skipped == 5
    loop.state.learn_pending()
    assert_each_learned_once(state, learned, range(20))
    assert state.intake.book.offsets == {"images:0": 25}


def test_a_replay_handed_in_while_its_original_is_in_the_learning_step_is_booked_after_it_and_skipped(tmp_path):
    """Records handed in from another thread during the step (forced: the step waits until they are queued) are
    booked only after it, by the model thread: the replay is skipped, a new sample waits for the next batch."""
    state, loop, learned = service(tmp_path)
    for r in records([0, 1, 2, 3]):
        loop.accept([r])
    observe, seen_in_step, queued = state.learner.observe, {}, threading.Event()
    handing = threading.Thread(target=lambda: (queued.set(), loop.accept([record(4, 0), record(5, 4)])))

    def observe_and_accept(images, labels, *rest):
        if not seen_in_step:
            handing.start()  # a replay of sample 0, which is in this step, and a new sample
            assert queued.wait(10)
            time.sleep(0.05)  # the other thread is now inside ``book``, queued behind this step
            seen_in_step.update(consumed=dict(state.intake.book.offsets), skipped=state.intake.book.replays_skipped)
        observe(images, labels, *rest)

    state.learner.observe = observe_and_accept
    loop.state.learn_pending()
    handing.join(10)
    assert seen_in_step == {"consumed": {}, "skipped": 0}  # nothing was booked during the step
    assert [s.meta.sample_index for _, _, s in state.intake.book.pending] == [4]
    assert state.intake.book.offsets == {"images:0": 5}  # up to the new sample, which is still pending
    loop.state.learn_pending()
    assert_each_learned_once(state, learned, range(5))
    assert state.intake.book.offsets == {"images:0": 6} and state.intake.book.replays_skipped == 1


def test_learn_replays_learns_a_replayed_sample_again(tmp_path):
    state, loop, learned = service(tmp_path, learn_replays=True)
    for r in records([0, 1, 0, 1]):
        loop.accept([r])
    loop.state.learn_pending()
    assert sorted(learned) == [(STREAM_ID, 0), (STREAM_ID, 0), (STREAM_ID, 1), (STREAM_ID, 1)]
    assert state.intake.book.replays_skipped == 0


# --- claims across a reconnect and a restart --------------------------------------------------------------------
def test_a_reconnect_drops_pending_records_and_their_claims_so_they_are_learned_once(tmp_path, monkeypatch):
    state, loop, learned = service(tmp_path)
    for r in records([0, 1, 2]):
        loop.accept([r])
    state.intake.reread()  # the broker went away, the loop reconnects: the pending records are read again
    assert state.intake.book.pending == [] and state.intake.book.offsets == {}
    for r in records([0, 1, 2]):
        loop.accept([r])
    assert state.intake.book.replays_skipped == 0
    loop.state.learn_pending()
    assert_each_learned_once(state, learned, range(3))


def test_a_restart_restores_learned_ids_and_nothing_in_flight(tmp_path, monkeypatch):
    """A checkpoint taken with records pending (then a crash): they are neither saved as learned nor lost."""
    state, loop, _ = service(tmp_path)
    log = records(list(range(20)))
    for r in log:
        loop.accept([r])
        if len(state.intake.book.pending) == 16:
            loop.state.learn_pending()
    loop.persist()  # 0..15 learned, 16..19 in flight
    saved = state.intake.book.position()
    assert saved.offsets == {"images:0": 16} and saved.learned[STREAM_ID].tolist() == list(range(16))
    restarted, loop2, learned = service(tmp_path)
    assert restarted.learner.samples_seen == 16 and restarted.intake.book.offsets == {"images:0": 16}
    consumer = run_loop(monkeypatch, loop2, log + records([0, 19], start=20))  # read again from offset 16
    assert sorted(i for _, i in learned) == [16, 17, 18, 19] and restarted.learner.samples_seen == 20
    assert restarted.intake.book.replays_skipped == 2 and consumer.committed == {"images:0": 22}


def test_before_a_revocation_the_state_is_written_and_nothing_committed(tmp_path):
    """Partitions being taken away: what is pending is learned and the checkpoint written and waited for, but no
    offset is committed (a blocking consumer call would stall the rebalance that called); a write at any other
    occasion commits its offsets."""
    state, loop, _ = service(tmp_path)
    loop.consumer = consumer = FakeConsumer(loop, [])
    for r in records(list(range(20))):
        loop.accept([r])
    loop.let_go(["images:0"])
    assert LearnerCheckpoint.load(state.cfg.checkpoint_dir / CHECKPOINT).position.offsets == {"images:0": 20}
    assert state.samples_seen == 20 and consumer.committed == {}
    loop.accept([record(20, 20)])
    loop.state.learn_pending()
    loop.persist()
    assert consumer.committed == {"images:0": 21}


# --- offsets: stored only past records with nothing pending before them -----------------------------------------
def test_offsets_do_not_move_past_a_pending_record_but_do_past_handled_ones(tmp_path):
    state, loop, _ = service(tmp_path)
    loop.accept([record(0, 0)])  # pending
    loop.accept([record(1, 1, value=b"NOTANIMG")])  # dead-lettered, behind a pending record
    loop.accept([record(2, 0)])  # a skipped replay, behind a pending record
    assert state.intake.book.offsets == {}
    loop.accept([record(0, 7, partition=1, value=b"")])  # dead-lettered on a partition with nothing pending
    loop.accept([record(1, 0, partition=1)])  # a replay there
    assert state.intake.book.offsets == {"images:1": 2}
    loop.state.learn_pending()
    assert state.intake.book.offsets == {"images:0": 3, "images:1": 2} and state.intake.book.pending == []
    assert state.intake.book.dead_lettered == 2 and state.intake.book.replays_skipped == 2
    letters = loop.producer.sent
    assert [dict(m["headers"])["error"] for m in letters] == [b"not_an_image", b"empty"]
    assert [dict(m["headers"])["source_offset"] for m in letters] == [b"1", b"0"]


def test_pending_records_on_several_partitions_all_count_as_handled_once_learned(tmp_path):
    state, loop, _ = service(tmp_path)
    loop.accept([record(5, 0, partition=0)])
    loop.accept([record(9, 1, partition=1)])
    loop.accept([record(10, 1, partition=1)])  # a replay behind a pending record
    assert state.intake.book.offsets == {}
    loop.state.learn_pending()
    assert state.intake.book.offsets == {"images:0": 6, "images:1": 11}


def test_a_bad_copy_of_a_sample_gives_its_claim_back(tmp_path):
    state, loop, learned = service(tmp_path)
    loop.accept([record(0, 5, value=jpeg("red")[:60])])  # a valid header, a truncated image
    loop.accept([record(1, 5)])  # a good copy of the same sample is learned, not skipped as a replay
    assert state.intake.book.dead_lettered == 1 and state.intake.book.replays_skipped == 0
    loop.state.learn_pending()
    assert learned == [(STREAM_ID, 5)] and state.intake.book.offsets == {"images:0": 2}


# --- the book on its own --------------------------------------------------------------------------------------
@pytest.mark.parametrize("learn_replays", [False, True])
def test_stream_book_claims(learn_replays):
    book = StreamBook(learn_replays=learn_replays)
    assert book.claim("s", 1) and book.claim("t", 1)  # ids are per stream
    assert book.claim("s", 1) is learn_replays  # in flight
    book.mark_learned([Sample(torch.zeros(3, 2, 2, dtype=torch.uint8), RecordMeta(0, 1, 1, "s"))])
    assert book.claim("s", 1) is learn_replays  # learned
    book.reread()
    assert book.claim("t", 1)  # its claim was dropped with the pending records
    assert book.replays_skipped == (0 if learn_replays else 2)
    assert {k: v.tolist() for k, v in book.position().learned.items()} == {"s": [1]}


def sample(stream_id: str, index: int) -> Sample:
    return Sample(torch.zeros(3, 2, 2, dtype=torch.uint8), RecordMeta(index % 10, index, index, stream_id))


def test_stream_book_position_round_trips_through_a_checkpoint_file(tmp_path):
    """Learned ids, offsets and counters survive a checkpoint file; what was pending or claimed does not."""
    book = StreamBook()
    samples = [sample("s", i) for i in range(4)]
    for offset, s in enumerate(samples):
        assert book.claim(*s.id)
        book.add_pending("images:0", offset, s)
    assert book.claim("t", 9)
    book.add_pending("images:1", 0, t9 := sample("t", 9))
    assert not book.claim("s", 1)  # a replay of a pending sample
    book.skip("images:0", 4)
    book.skip("images:0", 5, dead_letter=True)
    book.mark_learned(samples[:3] + [t9])  # s3 stays pending at offset 3
    saved = book.position()
    assert saved.offsets == {"images:0": 3, "images:1": 1}  # stops at the pending record
    assert {k: v.tolist() for k, v in saved.learned.items()} == {"s": [0, 1, 2], "t": [9]}
    book.mark_learned(samples[3:])  # what was saved does not move with the book
    assert saved.offsets == {"images:0": 3, "images:1": 1}
    assert book.offsets == {"images:0": 6, "images:1": 1}

    LearnerCheckpoint({}, 0, 0.0, saved, {}, None, torch.get_rng_state()).save(tmp_path / "c.pt")
    restored = StreamBook()
    restored.load(LearnerCheckpoint.load(tmp_path / "c.pt").position)  # tensors and plain values: weights_only
    again = restored.position()
    assert {k: v.tolist() for k, v in again.learned.items()} == {"s": [0, 1, 2], "t": [9]}
    assert (again.offsets, again.dead_lettered, again.replays_skipped) == ({"images:0": 3, "images:1": 1}, 1, 1)
    assert restored.pending == [] and not restored.unsaved_keys()  # the offsets restored are the saved ones
    assert restored.claim("s", 3)  # it was pending, not learned: it is read and claimed again
    assert not restored.claim("s", 2) and not restored.claim("t", 9) and restored.replays_skipped == 3


def test_a_checkpoint_stores_the_offsets_before_the_pending_records_and_only_when_they_moved(tmp_path):
    """``persist``: the checkpoint file holds the book's offsets (stopping before pending records) with the
    learned ids and model that match them; handling records without learning still moves them to disk; with
    nothing new nothing is written."""
    state, loop, _ = service(tmp_path)
    path = state.cfg.checkpoint_dir / CHECKPOINT
    for r in records(list(range(20))):
        loop.accept([r])
        if len(state.intake.book.pending) == 16:
            loop.state.learn_pending()
    loop.persist()  # 0..15 learned, 16..19 pending
    saved = LearnerCheckpoint.load(path)
    assert saved.position.offsets == {"images:0": 16} and saved.position.learned[STREAM_ID].tolist() == list(range(16))
    assert saved.samples_seen == 16 and saved.position.replays_skipped == 0
    loop.state.learn_pending()
    loop.accept([record(20, 3)])  # a replay: handled, nothing learned
    assert state.intake.book.offsets == {"images:0": 21} and state.intake.book.unsaved_keys()
    loop.persist()
    saved = LearnerCheckpoint.load(path)
    assert saved.position.offsets == {"images:0": 21} and saved.samples_seen == 20
    assert torch.equal(saved.position.learned[STREAM_ID], torch.arange(20)) and saved.position.replays_skipped == 1
    loop.accept([record(21, 4)])  # only a replay again: the offset moved, so it is saved
    loop.persist()
    assert LearnerCheckpoint.load(path).position.offsets == {"images:0": 22}
    written = path.stat().st_mtime_ns
    loop.persist()  # nothing changed since
    assert path.stat().st_mtime_ns == written and state.capture() is None
