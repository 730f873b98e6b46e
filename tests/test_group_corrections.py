"""Corrections and deletions in a group of learners (issue 52): each partition's sample table moves with it.

The pieces: a part of the sums takes a sample out exactly; a partition's state carries its table's changelog
writes; a table restored from the changelog holds exactly the writes its state includes (a kill -9 between the
table's write and the state's leaves writes no state includes). Against the real broker: two ``mepo serve``
learners on four partitions, images keyed by id and their changes inline (from Kafka and from the admin routes),
one learner killed with SIGKILL twice while the changes come; the group's model is then a fresh learner's fed only
the final table."""

from __future__ import annotations

import signal
import time
import uuid
from dataclasses import replace

import httpx
import pytest
import torch

from mepo_stream.anytime import ProtocolConfig
from mepo_stream.data import load_split
from mepo_stream.errors import StateRefused
from mepo_stream.kafka import ensure_topics
from mepo_stream.label_statistics import FIELDS, LabelStatistics
from producers.siblurry import ReplayConfig, produce
from server.config import CorrectionsConfig, ServeConfig
from server.learner.changelog import Changelog
from server.learner.corrections import PARTITION_TABLES
from server.learner.sample_table import Entry, SampleTable
from server.learner.table_changelog import TableChangelog, Write
from server.snapshot_topic import Origin
from server.state_topic import PartitionState, decode, encode
from tests.helpers import DATA, http_client, settings, wait_for
from tests.test_corrections import STREAM, Scenario, fresh_model, scenario, send_changes, stored_id
from tests.test_labels_later import read_topic
from tests.test_scale_out import PARTITIONS, assert_same_model, group_member, owns_partitions, start, stop, total
from tests.test_scale_out import written_by as states_written_by


def test_a_part_that_forgets_or_moves_a_sample_is_the_part_that_learned_the_final_labels():
    h = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))  # [B, D]
    learned, final = LabelStatistics.zeros(3, 4, 1), LabelStatistics.zeros(3, 4, 1)
    learned.add(h, torch.tensor([0, 1, 2, 1, 0]), torch.tensor([2.0]))
    learned.remove(h[1:2], torch.tensor([1]))  # a deletion
    learned.move(h[4:5], torch.tensor([0]), torch.tensor([2]))  # a correction
    final.add(h[[0, 2, 3, 4]], torch.tensor([0, 2, 1, 2]), torch.tensor([2.0]))  # the prequential hits stay
    for name in FIELDS:
        assert torch.allclose(getattr(learned, name), getattr(final, name), rtol=0, atol=1e-12), name
    with pytest.raises(ValueError, match="never learned here"):
        learned.remove(h[:2], torch.tensor([1, 1]))  # label 1 has one sample left


def test_a_partition_state_carries_its_moves_its_table_writes_and_its_change_counts():
    origin = Origin("mepo", "{}", ("cat", "dog"), "ab" * 32, None)
    stats = LabelStatistics.zeros(2, 3, 1)
    stats.add(torch.ones(2, 3), torch.tensor([0, 1]), torch.zeros(1))
    state = PartitionState("images:1", stats, 9, {}, origin, "host:8000", 0.0, 1.0, 0, 5, {"e1": 3, "e2": 1},
                           {"deletions_applied": 2})
    back = decode(encode(state))
    assert (back.moves, back.table, back.changes) == (5, {"e1": 3, "e2": 1}, {"deletions_applied": 2})
    assert replace(state, steps=None).moves == 2  # a state written before changes: its samples


def entries(*pairs: tuple[str, int]) -> list[tuple[str, Entry]]:
    return [(id, Entry(label, 1.0, torch.full((4,), float(label)))) for id, label in pairs]


def test_a_restored_table_holds_exactly_the_changelog_writes_its_state_includes(broker, tmp_path):
    """An owner writes twice under its epoch; a kill -9 falls before the state of its second write, so the next
    owner's state includes its first only; that owner writes once. A restore from either state rebuilds the table
    that state's sums were learned with, and names the keys of the writes it left out."""
    kafka = replace(settings(broker, tmp_path).kafka, state_topic=f"state-{uuid.uuid4().hex[:8]}")
    ensure_topics(kafka, kafka.topic, partitions=2)
    changelog, owner = TableChangelog(kafka), SampleTable(tmp_path / "owner", 1e9)
    assert changelog.restore(1, {}, SampleTable(tmp_path / "empty", 1e9)) == 0  # creates the changelog
    for id, entry in entries(("a", 0), ("b", 1)):
        owner.put(id, entry)
    first = Write(1, "e1", 1, owner.commit(1))
    owner.put(*entries(("a", 2))[0])
    owner.delete("b")
    second = Write(1, "e1", 2, owner.commit(2))  # never included in a state: the owner died first
    taker = SampleTable(tmp_path / "taker", 1e9)
    taker.put(*entries(("c", 1))[0])
    third = Write(1, "e2", 1, taker.commit(1))
    changelog.write([first, second, third])

    after_kill = SampleTable(tmp_path / "after-kill", 1e9)
    skipped = changelog.restore(1, {"e1": 1, "e2": 1}, after_kill)
    assert sorted(after_kill.ids()) == ["a", "b", "c"] and after_kill.get("a").label == 0
    assert skipped == 2 and set(after_kill.commit(1)) == set(second.changes)  # written out again, as they are now
    assert after_kill.get("a").label == 0 and after_kill.get("b").label == 1
    had_all = SampleTable(tmp_path / "had-all", 1e9)
    changelog.restore(1, {"e1": 2, "e2": 1}, had_all)
    assert sorted(had_all.ids()) == ["a", "c"] and had_all.get("a").label == 2
    assert torch.equal(had_all.get("c").feature, torch.full((4,), 1.0))
    other = SampleTable(tmp_path / "other", 1e9)
    assert changelog.restore(0, {"e1": 2, "e2": 1}, other) == 0 and other.ids() == []
    with pytest.raises(StateRefused, match="has no partition 5"):
        changelog.restore(5, {}, SampleTable(tmp_path / "none", 1e9))
    changelog.close()


def test_a_table_rebuilt_from_a_changelog_keeps_no_bytes_of_an_id_deleted_in_it(tmp_path):
    """A restore writes an id's entry, then (a later poll) its deletion: LMDB keeps the freed page's bytes until
    the table is compacted, which the restore does before the table is used."""
    source = SampleTable(tmp_path / "source", 1e9)
    source.put(*entries(("gone", 3))[0])
    (key, entry), = source.commit(1).items()
    table = SampleTable(tmp_path / "rebuilt", 1e9)
    written: list[bytes] = []

    def batches():
        yield [(key, entry, True)]
        yield [(key, None, True)]
        written.append(b"".join(f.read_bytes() for f in table.path.iterdir()))  # before the end of the rebuild

    assert table.rebuild(batches()) == 0 and table.ids() == []
    assert stored_id("gone", written[0])  # deleted, its bytes still in a freed page
    assert not stored_id("gone", b"".join(f.read_bytes() for f in table.path.iterdir()))


def inline(plan: Scenario) -> Scenario:
    """The scenario with every change on the image topic, keyed by id: on its image's partition; no relabel to
    class 7, so the class whose every image is deleted ends empty."""
    return Scenario(plan.labels, [("images", id, 6 if label == 7 else label) for _, id, label in plan.changes])


def handled(cfg: ServeConfig, records: int) -> dict[str, PartitionState] | None:
    """Every partition's newest state once together they stand past all ``records``, else None."""
    states = Changelog(cfg.kafka).read_all()
    return states if len(states) == PARTITIONS and sum(s.offset for s in states.values()) == records else None


def table_files(pair: list[ServeConfig]) -> bytes:
    """The bytes of the learners' partition tables (a learner let go of a partition removes its table)."""
    return b"".join(f.read_bytes() for cfg in pair for f in (cfg.checkpoint_dir / PARTITION_TABLES).rglob("*")
                    if f.is_file())


def test_two_learners_one_killed_twice_while_changes_come_end_with_the_final_tables_model(broker, tmp_path):
    """Images keyed by id on four partitions, then relabels and tombstones inline in two halves; after each half
    the second learner is killed with SIGKILL once it has written states since it started, and started again
    (its partitions' tables are rebuilt from the changelog, by it or by the other learner). At the end the states'
    sums equal a fresh learner's fed the final table (1e-9, identical top-1 at every shrinkage), class 7 (every
    image deleted) is never predicted, the changes are counted once, a tombstone of an id never sent is dead-lettered
    as ``not_correctable``, and no deleted id is in a learner's table files. In fp32 (the learner alone's live tests
    run in the default precision)."""
    base = settings(broker, tmp_path, protocol=ProtocolConfig(eval_period=0))
    base = replace(base, corrections=CorrectionsConfig(enabled=True, compact_every_s=0.0),
                   learner=replace(base.learner, precision="fp32"))  # the learner alone's tests: the default
    ensure_topics(base.kafka, base.kafka.topic, partitions=PARTITIONS)
    pair = [group_member(base, tmp_path, "pair") for _ in range(2)]
    plan = inline(scenario(57, after_delete=False))
    procs = start(pair, tmp_path)
    try:
        n = produce(DATA, STREAM, base.kafka, ReplayConfig(partitions=PARTITIONS, partition_by="id"))
        half = len(plan.changes) // 2
        for changes in (plan.changes[:half], plan.changes[half:]):
            started = time.time()
            wait_for(lambda: all(owns_partitions(c) for c in pair), 120, "both learners own partitions",
                     ignore=(httpx.TransportError,))
            send_changes(pair[0], changes)
            wait_for(lambda started=started: states_written_by(pair[1], started), 120, "states of the learner to kill")
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait()
            procs[1:] = start([pair[1]], tmp_path)
        kept = sorted(plan.final())[0]  # through the admin routes: a correction, a tombstone of an id never sent
        plan.changes.append(("images", kept, (plan.final()[kept] + 1) % 7))
        admin = {"authorization": f"Bearer {pair[0].admin_token}"}
        with http_client(pair[0]) as http:
            relabel = http.post(f"/v1/labels/{kept}", json={"label": plan.changes[-1][2]}, headers=admin)
            never = http.delete("/v1/samples/never-sent", headers=admin)
        assert relabel.status_code == never.status_code == 202 and never.json()["topic"] == base.kafka.topic
        states = wait_for(lambda: handled(pair[0], n + len(plan.changes) + 1), 240, "every record handled")
        files = wait_for(lambda: all(owns_partitions(c) for c in pair) and table_files(pair), 120,
                         "both learners' partition tables (none while a rebalance has every partition let go)",
                         ignore=(httpx.TransportError, FileNotFoundError))
    finally:
        stop(procs)
    deletions = sorted({id for _, id, label in plan.changes if label is None})
    assert files and not [id for id in deletions if stored_id(id, files)]
    counts = {k: sum(s.changes.get(k, 0) for s in states.values()) for k in
              ("corrections_applied", "corrections_refused", "deletions_applied", "deletions_refused")}
    assert counts == {"corrections_applied": plan.relabels_applied(), "corrections_refused": 0,
                      "deletions_applied": len(deletions), "deletions_refused": 1}

    fresh = fresh_model(base, plan.final())
    origin = next(iter(states.values())).origin
    assert_same_model(total(states), fresh.statistics(), base, origin)
    fresh.load_statistics(total(states))
    test = load_split(replace(DATA, load_size=base.limits.size), "test")
    assert 7 not in plan.final().values() and 7 not in fresh.predict(test.images)["running"].tolist()

    dead = read_topic(base, base.kafka.dead_letter_topic, 1)
    assert [dict(r.headers)["error"] for r in dead] == [b"not_correctable"] and dead[0].key == b"never-sent"
