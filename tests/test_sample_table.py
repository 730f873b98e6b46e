"""Forgetting a sample exactly (``OnlineLearner.forget_features``) and the table of learned samples that makes it
possible (``server.learner.sample_table``): a model corrected and pruned is the model of a fresh learner fed the final
table, and the table goes back to any checkpoint's generation after a crash."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import server.learner.sample_table as sample_table
from mepo_stream.errors import StateRefused
from mepo_stream.learner import LearnerConfig, OnlineLearner
from server.learner.consumer import PartitionKey
from server.learner.sample_table import Entry, SampleTable
from server.learner.stream import fill_wait_ms
from tests.fakes import service
from tests.helpers import learner_of

SHRINKAGE = (0.05, 0.2, 0.6)


def slda(n_classes: int = 6) -> OnlineLearner:
    return learner_of("frozen", LearnerConfig(classifier="slda", slda_shrinkage=SHRINKAGE), n_classes)


def features(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 5, (n,), generator=g)
    centres = torch.randn(5, dim, generator=g) * 3
    return centres[labels] + torch.randn(n, dim, generator=g), labels  # [N, D], [N]


def assert_same_model(a: OnlineLearner, b: OnlineLearner, probe: torch.Tensor) -> None:
    """Counts, class sums and second moments within 1e-9 relative (by label), and the same top-1 at every
    shrinkage on ``probe`` features."""
    sa, sb = a.statistics(), b.statistics()
    for field in ("counts", "sums", "second"):
        x, y = getattr(sa, field), getattr(sb, field)
        assert torch.allclose(x, y, rtol=1e-9, atol=1e-9 * float(y.abs().max())), field
    for k in range(len(SHRINKAGE)):
        top = [learner.to_labels(learner.method.classifier.scores(probe, k).argmax(1)) for learner in (a, b)]
        assert torch.equal(*top), f"shrinkage {SHRINKAGE[k]}"


def test_corrections_and_deletions_leave_the_model_of_a_fresh_learner_fed_the_final_table():
    dim = slda().method.classifier.second.shape[0]
    x, y = features(300, dim, 0)
    table = {i: (x[i], int(y[i])) for i in range(300)}
    learner = slda()
    for start in range(0, 300, 32):
        learner.observe_features(x[start:start + 32], y[start:start + 32])
    rng = random.Random(1)
    for i in rng.sample(range(300), 60):  # relabel 40, delete 20, in a random order, some twice
        feature, label = table[i]
        if rng.random() < 0.67:
            new = rng.choice([c for c in range(6) if c != label])  # class 5: a class only corrections bring
            learner.relabel_features(feature[None], torch.tensor([label]), torch.tensor([new]))
            table[i] = (feature, new)
        else:
            learner.forget_features(feature[None], torch.tensor([label]))
            del table[i]
    gone = [i for i in table if table[i][1] == 4]
    for i in gone:  # every sample of class 4 deleted: it is no longer predicted
        learner.forget_features(table[i][0][None], torch.tensor([4]))
        del table[i]
    fresh = slda()
    ids = sorted(table)
    fresh.observe_features(torch.stack([table[i][0] for i in ids]), torch.tensor([table[i][1] for i in ids]))
    assert_same_model(learner, fresh, x)
    assert 4 not in learner.to_labels(learner.method.classifier(x).argmax(1)).tolist()


def test_forgetting_what_was_never_learned_is_refused_and_changes_nothing():
    dim = slda().method.classifier.second.shape[0]
    x, y = features(20, dim, 2)
    learner = slda()
    learner.observe_features(x, y)
    before = learner.statistics().clone()
    with pytest.raises(ValueError, match="never learned"):
        learner.forget_features(x[:1], torch.tensor([9]))
    twice = torch.tensor([int(y[0])] * (int((y == y[0]).sum()) + 1))  # more samples of a class than it has
    with pytest.raises(ValueError, match="more samples"):
        learner.forget_features(x[:1].expand(len(twice), -1), twice)
    assert torch.equal(learner.statistics().counts, before.counts)


def test_a_learner_trained_by_gradient_cannot_forget():
    learner = learner_of("mvp", LearnerConfig(classifier="linear"), 4)
    assert "gradient" in learner.not_correctable
    with pytest.raises(ValueError, match="cannot forget"):
        learner.forget_features(torch.zeros(1, 8), torch.tensor([0]))


def entry(label: int, at: float, value: float = 0.0) -> Entry:
    return Entry(label, at, torch.full((4,), value))


def test_the_table_goes_back_to_the_generation_of_the_checkpoint_even_after_a_restart(tmp_path):
    table = SampleTable(tmp_path / "t", retention_s=1e9)
    table.put("a", entry(0, 1.0, 1.0))
    table.put("b", entry(1, 2.0, 2.0))
    table.commit(1)  # checkpoint 1 written
    table.settle(1)
    table.put("a", entry(2, 3.0, 3.0))  # corrected
    table.delete("b")
    table.put("c", entry(0, 4.0))
    table.commit(2)
    table.put("a", entry(3, 5.0))  # and again, in generation 3
    table.commit(3)  # neither checkpoint 2 nor 3 reached the disk: a kill -9
    table.close()
    reopened = SampleTable(tmp_path / "t", retention_s=1e9)
    assert reopened.generation == 3 and reopened.ids() == ["a", "c"]
    reopened.restore(1)
    assert reopened.ids() == ["a", "b"] and reopened.generation == 1
    assert reopened.get("a").label == 0 and torch.equal(reopened.get("b").feature, torch.full((4,), 2.0))
    reopened.put("d", entry(1, 6.0))
    reopened.restore(1)  # changes in memory are not in any checkpoint either
    assert reopened.get("d") is None and len(reopened) == 2
    with pytest.raises(StateRefused, match="not the table this checkpoint was written with"):
        reopened.restore(2)  # a checkpoint newer than the table
    reopened.commit(2)
    reopened.settle(2)
    with pytest.raises(StateRefused, match="settled at 2"):
        reopened.restore(0)  # the checkpoint was deleted, the table kept: its settled changes cannot be undone


def test_ids_past_retention_leave_the_table_by_record_time(tmp_path):
    table = SampleTable(tmp_path / "t", retention_s=10.0)
    for i in range(5):
        table.put(f"id{i}", entry(0, 100.0 + i))
    table.commit(1)
    table.put("id0", entry(1, 120.0))  # corrected later: its new record time counts
    assert table.expire(113.5) == 3 and table.ids() == ["id0", "id4"]
    table.commit(2)
    assert table.ids() == ["id0", "id4"] and table.expire(200.0) == 2 and len(table) == 0


def _records(kafka, changes: list[tuple[str, str, int | None]], start: dict[str, int]) -> list:
    """Fake records of (topic "images" or "labels", id, label; None: a tombstone), at offsets from ``start``."""
    from mepo_stream.records import label_headers, record_headers
    from tests.fakes import FakeRecord, jpeg

    colours = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
    out = []
    for topic, id, label in changes:
        name = kafka.topic if topic == "images" else kafka.labels_topic
        offset = start[name] = start.get(name, -1) + 1
        if label is None:
            out.append(FakeRecord(name, 0, offset, [], None, id.encode()))
        elif topic == "images":
            headers = record_headers(None, 0, offset, "s", "cifar10", id=id)
            out.append(FakeRecord(name, 0, offset, headers, jpeg(colours[label]), id.encode()))
        else:
            out.append(FakeRecord(name, 0, offset, label_headers(id, label), b"", id.encode()))
    return out


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_a_change_is_applied_once_in_its_place_and_a_restart_before_its_checkpoint_undoes_it(tmp_path, precision):
    """Fast, without a broker: relabels (one id twice), a tombstone on each topic; learning again applies nothing
    twice; a kill after the sample table committed but before the checkpoint file was written, then a replay of
    the changes from the checkpoint's offsets, ends with the same model; and both are the final table's. In fp32 and
    in the default precision (bf16 where the CPU has it)."""
    from dataclasses import replace

    from server.config import CorrectionsConfig
    from tests.helpers import NO_BROKER, settings
    from tests.test_labels_later import later

    base = later(settings(NO_BROKER, tmp_path))
    on = {"kafka": base.kafka, "corrections": CorrectionsConfig(enabled=True),
          "learner": replace(base.learner, precision=precision)}
    kafka = base.kafka
    images = [("images", f"i{k}", k % 4) for k in range(12)]  # colour k % 4 for label k % 4
    stream = images + [("labels", id, label) for _, id, label in images]
    changes = [("labels", "i0", 1), ("labels", "i1", None), ("labels", "i0", 2), ("images", "i2", None),
               ("labels", "i5", 3)]
    final = {id: label for _, id, label in images if id not in ("i1", "i2")} | {"i0": 2, "i5": 3}

    def learned(state, loop, records) -> None:
        loop.state.accept(records)
        state.learn_pending()

    state, loop, _ = service(tmp_path / "a", **on)
    offsets: dict[str, int] = {}
    learned(state, loop, _records(kafka, stream, offsets))
    loop.persist()  # checkpoint 1: the stream, no change
    learned(state, loop, _records(kafka, changes, dict(offsets)))
    state.learn_pending()  # nothing is left to apply
    assert state.intake.corrections.counts[None] == {"corrections_applied": 3, "corrections_refused": 0,
                                               "deletions_applied": 2, "deletions_refused": 0}
    assert state.capture() is not None  # the table commits generation 2 ... and the process dies: no file
    state.intake.corrections.table(None).close()

    restarted, loop2, _ = service(tmp_path / "a", **on)  # back to checkpoint 1, its offsets, its table
    assert sorted(restarted.intake.corrections.table(None).ids()) == sorted(id for _, id, _ in images)
    learned(restarted, loop2, _records(kafka, changes, dict(offsets)))
    fresh, loop3, _ = service(tmp_path / "b", **on)
    learned(fresh, loop3, _records(kafka, [c for c in images if c[1] in final]
                                   + [("labels", id, final[id]) for id in sorted(final)], {}))
    probe = fresh.learner.statistics().sums.float()[[0, 1, 2, 3]]
    for learner in (state.learner, restarted.learner):
        assert_same_model(learner, fresh.learner, probe)
    assert sorted(restarted.intake.corrections.table(None).ids()) == sorted(final)


def test_labels_inline_are_corrected_and_deleted_on_the_image_topic(tmp_path):
    """A stream with its labels inline and ids: a record with an empty value and ``id`` and ``label`` headers on the
    image topic corrects a sample, a tombstone deletes one, one for an id never learned is refused; the model is the
    final table's, with the features each sample was learned from kept at learning."""
    from mepo_stream.records import label_headers, record_headers
    from server.config import CorrectionsConfig
    from tests.fakes import FakeRecord, jpeg
    from tests.helpers import NO_BROKER, settings

    base = settings(NO_BROKER, tmp_path)
    on = {"kafka": base.kafka, "corrections": CorrectionsConfig(enabled=True)}
    colours = ["red", "green", "blue", "yellow"]
    images = [FakeRecord(base.kafka.topic, 0, k, record_headers(k % 4, k, k, "s", "cifar10", id=f"s/{k}"),
                         jpeg(colours[k % 4]), None) for k in range(12)]
    changes = [FakeRecord(base.kafka.topic, 0, 12, label_headers("s/0", 2), b"", b"s/0"),
               FakeRecord(base.kafka.topic, 0, 13, [], None, b"s/5"),
               FakeRecord(base.kafka.topic, 0, 14, label_headers("s/99", 1), b"", b"s/99")]
    state, loop, _ = service(tmp_path / "a", **on)
    loop.state.accept(images[:8])  # the first changes name a sample still pending
    dead = loop.state.accept(images[8:] + changes).outgoing
    state.learn_pending()
    assert [d.reason for d in dead] == ["not_correctable"] and state.offsets == {f"{base.kafka.topic}:0": 15}
    assert state.intake.corrections.counts[None] == {"corrections_applied": 1, "corrections_refused": 1,
                                               "deletions_applied": 1, "deletions_refused": 0}
    final = [r for r in images if r.offset != 5]
    fresh, loop2, _ = service(tmp_path / "b", **on)
    loop2.state.accept(final)
    fresh.learn_pending()
    relabelled = fresh.learner.statistics()
    fresh.learner.relabel_features(fresh.intake.corrections.table(None).get("s/0").feature[None], torch.tensor([0]),
                                   torch.tensor([2]))
    assert not torch.equal(relabelled.counts, fresh.learner.statistics().counts)
    assert_same_model(state.learner, fresh.learner, fresh.learner.statistics().sums.float()[:4])
    assert sorted(state.intake.corrections.table(None).ids()) == sorted(f"s/{k}" for k in range(12) if k != 5)


def test_changes_wait_for_the_samples_of_their_poll_unless_one_names_a_later_sample():
    """The samples of a learning turn are learned in whole mini-batches and the changes applied after them; where a
    change names an id received again after it (deleted, then sent anew), everything stays in order."""
    from mepo_stream.records import RecordMeta
    from server.learner.book import Sample
    from server.learner.corrections import Forget, Relabel
    from server.learner.state import runs_of_samples

    def sample(id: str) -> Sample:
        return Sample(torch.zeros(1), RecordMeta(0, 0, 0, "s", id))

    def change(c) -> Sample:
        return Sample(None, RecordMeta(None, -1, -1, "", c.id), change=c)

    a, b, c = sample("a"), sample("b"), sample("c")
    relabel, forget = change(Relabel("a", 1, 0.0)), change(Forget("x"))
    assert runs_of_samples([a, relabel, b, forget, c]) == [[a, b, c], [relabel, forget]]
    again = sample("x")
    assert runs_of_samples([a, forget, again, relabel]) == [[a], [forget], [again], [relabel]]
    assert runs_of_samples([a, b]) == [[a, b]] and runs_of_samples([forget]) == [[forget]]


def test_a_deleted_ids_bytes_leave_the_files_at_the_next_compaction_and_a_cut_swap_is_finished(tmp_path):
    table = SampleTable(tmp_path / "t", retention_s=1e9, compact_every_s=0.0)
    for i in range(50):
        table.put(f"user-{i:03d}", entry(1, 1.0, float(i)))
    table.commit(1)
    table.settle(1)
    for i in range(0, 50, 2):
        table.delete(f"user-{i:03d}")
    table.commit(2)
    on_disk = (tmp_path / "t" / "data.mdb").read_bytes()
    assert b"user-000" in on_disk  # deleted, yet its bytes stay (and its undo record) until the compaction
    table.settle(2)
    on_disk = (tmp_path / "t" / "data.mdb").read_bytes()
    assert not [i for i in range(0, 50, 2) if f"user-{i:03d}".encode() in on_disk]
    assert b"user-001" in on_disk and len(table) == 25 and table.get("user-049").label == 1
    table.close()
    (tmp_path / "t").rename(tmp_path / "t.compact")  # a crash between the two renames of the swap
    reopened = SampleTable(tmp_path / "t", retention_s=1e9)
    assert len(reopened) == 25 and reopened.generation == 2 and not (tmp_path / "t.compact").exists()


def test_a_table_open_in_this_process_is_not_opened_twice_until_closed_or_let_go(tmp_path):
    """LMDB allows one environment per file per process: a second table on an open table's path is refused with
    the reason (after a compaction's swap too), a closed table's path opens again, and so does one nobody holds."""
    table = SampleTable(tmp_path / "t", retention_s=1e9, compact_every_s=0.0)
    table.put("a", entry(0, 1.0))
    table.commit(1)
    table.delete("a")
    table.commit(2)
    table.settle(2)  # compacts: the environment is reopened on the swapped-in copy
    with pytest.raises(StateRefused, match="already open in this process"):
        SampleTable(tmp_path / "t" / ".." / "t", retention_s=1e9)
    table.close()
    reopened = SampleTable(tmp_path / "t", retention_s=1e9)
    assert reopened.generation == 2 and len(reopened) == 0
    del reopened  # let go without a close: it is collected, and its environment closed, before a new one opens
    assert SampleTable(tmp_path / "t", retention_s=1e9).generation == 2


def test_a_read_that_waits_for_a_settles_reopening_uses_the_reopened_tables_handles(tmp_path, monkeypatch):
    """A settle reopens the environment (its pages leave the resident set), which makes new database handles; a
    read from another thread (the intake, while the checkpoint settles) waits for it and must then use the new
    ones. The reopening is held open here until the read waits on it."""
    table = SampleTable(tmp_path / "t", retention_s=1e9)
    table.put("s/1", entry(3, 1.0))
    table.commit(1)
    entered, release, opened = threading.Event(), threading.Event(), sample_table.lmdb.open

    def held_open(*args, **kwargs):
        entered.set()
        release.wait(10)
        return opened(*args, **kwargs)

    monkeypatch.setattr(sample_table.lmdb, "open", held_open)
    settling = threading.Thread(target=table.settle, args=(1,))
    settling.start()
    assert entered.wait(10)
    got: list = []
    reading = threading.Thread(target=lambda: got.append(table.get("s/1")))
    reading.start()
    time.sleep(0.2)  # the read is waiting for the reopening
    release.set()
    settling.join(10)
    reading.join(10)
    assert got and got[0].label == 3


CHURN = """
import sys, threading, time
from pathlib import Path
import torch
from server.learner.sample_table import Entry, SampleTable
table = SampleTable(Path(sys.argv[2]) / "t", retention_s=1e9)
for i in range(200):
    table.put(f"s/{i}", Entry(i % 10, float(i), torch.ones(8)))
end = time.monotonic() + float(sys.argv[1])

def read():  # the intake and the learning step: each read's transaction is let go after the table's lock
    i = 0
    while time.monotonic() < end:
        table.get(f"s/{i % 200}")
        table.expire(1.0)
        i += 1

def checkpoint():  # the checkpoint thread: commit, then settle, which closes and reopens the environment
    g = 1
    while time.monotonic() < end:
        table.put(f"s/{g % 200}", Entry(1, float(g), torch.ones(8)))
        table.commit(g)
        table.settle(g)
        g += 1

threads = [threading.Thread(target=f) for f in (read, read, checkpoint)]
[t.start() for t in threads]
[t.join() for t in threads]
table.close()
print("survived")
"""


def test_a_table_reopened_at_every_checkpoint_while_other_threads_read_it_does_not_crash_the_process(tmp_path):
    """Every settle closes and reopens the environment in the checkpoint thread while the model thread reads the
    table. A binding that lets another thread drop its last transaction while the environment closes frees LMDB's
    memory twice (py-lmdb before 2.0: an abort within two seconds here, and a test worker lost in CI), so this runs
    the three threads for a few seconds in a process of its own."""
    churn = subprocess.run([sys.executable, "-c", CHURN, "3", str(tmp_path)], capture_output=True, text=True,
                           timeout=120, cwd=Path(__file__).parent.parent)
    assert (churn.returncode, churn.stdout.strip()) == (0, "survived"), churn.stderr[-2000:]


def test_a_partial_mini_batch_waits_for_samples_unless_a_change_waits_and_nothing_is_left_to_read():
    """A poll waits up to 500 ms for samples to fill a partial mini-batch; where a correction or deletion waits, only
    20 ms once the consumer has read to the end of every partition (its user waits), and 500 ms again while a
    backlog remains (it still fills the mini-batch)."""
    class Consumer:  # the two reads fill_wait_ms makes of the learner's consumer
        def __init__(self, position: int):
            self.at = position

        def assignment(self) -> set:
            return {PartitionKey("images", 0)}

        def unread(self, key) -> int:
            return 10 - self.at

    assert fill_wait_ms(Consumer(10), None, changes_waiting=False) == 500
    assert fill_wait_ms(Consumer(10), None, changes_waiting=True) == 20
    assert fill_wait_ms(Consumer(4), None, changes_waiting=True) == 500
