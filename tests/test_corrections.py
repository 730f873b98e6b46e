"""Corrections and deletions against a real broker (issue 52): a stream whose labels come later, then relabels and
tombstones of learned ids in a random order, end with the model of a fresh learner fed only the final table (the
latest label of every id that still exists), with a learner alone and one killed with kill -9 twice. A deleted id is
in no store, checkpoint or snapshot, and its prediction is retracted; what cannot be exact is refused."""

from __future__ import annotations

import random
import signal
import struct
import time
from dataclasses import dataclass, replace

import httpx
import pytest
import torch
from kafka import KafkaProducer

from mepo_stream.anytime import ProtocolConfig
from mepo_stream.data import list_files, load_split
from mepo_stream.errors import ConfigError
from mepo_stream.learner import OnlineLearner
from mepo_stream.records import label_headers, sample_id
from mepo_stream.sampler import si_blurry_stream
from producers.siblurry import produce, stream_id
from server.config import CorrectionsConfig, ServeConfig
from server.learner.sample_table import SampleTable
from server.learner.state import CHECKPOINT, build_learner
from server.metrics import ServerMetrics
from tests.helpers import DATA, LiveServer, checkpoint, serve_process, settings, wait_for
from tests.test_labels_later import LATE, STREAM, later, read_topic
from tests.test_sample_table import assert_same_model


def corrected(cfg: ServeConfig, **kw) -> ServeConfig:
    """``cfg`` with labels that come later and corrections on (the streaming LDA's several shrinkages)."""
    return replace(later(cfg), corrections=CorrectionsConfig(enabled=True, **kw))


@dataclass
class Scenario:
    """The stream's ids and labels, the changes sent after it, and the table they leave."""

    labels: dict[str, int]
    """Every id of the stream and its first label."""
    changes: list[tuple[str, str, int | None]]
    """(topic: "labels" or "images", id, new label; None: a tombstone), in the order sent."""

    def final(self) -> dict[str, int]:
        """Each id's latest label, without the deleted ones (a label after a deletion waits for a new image)."""
        return self._replay()[0]

    def relabels_applied(self) -> int:
        return self._replay()[1]

    def waiting_labels(self) -> set[str]:
        """The deleted ids a label came for after their deletion."""
        return self._replay()[2]

    def _replay(self) -> tuple[dict[str, int], int, set[str]]:
        table, applied, waiting = dict(self.labels), 0, set()
        for _, id, label in self.changes:
            if label is None:
                table.pop(id, None)
                waiting.discard(id)
            elif id in table:
                table[id], applied = label, applied + 1
            else:
                waiting.add(id)
        return table, applied, waiting


def scenario(seed: int, after_delete: bool = True) -> Scenario:
    """40 relabels (some ids twice, none to the class deleted whole), 15 tombstones of learned ids (on either topic),
    every sample of one class deleted, in a random order; an id's changes go to one topic, so they stay in order.
    Without ``after_delete``, no label comes after its id's deletion (where the stream is still being read, it would
    join the image it finds)."""
    listing = list_files(DATA, "train")
    order = si_blurry_stream(listing.targets, STREAM.n_tasks, STREAM.n, STREAM.m, STREAM.seed).order
    sid = stream_id(DATA, STREAM)
    labels = {sample_id(sid, listing.names[i]): listing.targets[i] for i in order}
    rng = random.Random(seed)
    ids = sorted(labels)
    gone_class = [id for id in ids if labels[id] == 7]
    relabelled = rng.sample([id for id in ids if labels[id] != 7], 30)
    changes = [("labels", id, rng.choice([c for c in range(10) if c != 7])) for id in relabelled + relabelled[:10]]
    deleted = rng.sample([id for id in ids if labels[id] != 7], 15)
    changes += [("labels" if id in relabelled else rng.choice(["labels", "images"]), id, None)
                for id in deleted + gone_class]
    rng.shuffle(changes)
    by_id: dict[str, list] = {}
    for change in changes:
        by_id.setdefault(change[1], []).append(change)
    topic = {id: cs[0][0] for id, cs in by_id.items()}  # one topic per id: its changes keep their order
    changes = [(topic[id], id, label) for _, id, label in changes]
    if not after_delete:
        deleted_at = {id: i for i, (_, id, label) in enumerate(changes) if label is None}
        changes = [c for i, c in enumerate(changes) if c[2] is None or i < deleted_at.get(c[1], len(changes))]
    return Scenario(labels, changes)


def send_changes(cfg: ServeConfig, changes: list[tuple[str, str, int | None]]) -> None:
    producer = KafkaProducer(**cfg.kafka.client_options(), acks="all")
    for topic, id, label in changes:
        name = cfg.kafka.labels_topic if topic == "labels" else cfg.kafka.topic
        if label is None:
            producer.send(name, value=None, key=id.encode())
        else:
            producer.send(name, value=b"", key=id.encode(), headers=label_headers(id, label))
    producer.flush()
    producer.close()


def stored_id(id: str, files: bytes) -> bool:
    """``id`` is in these sample-table files: an entry holds its id after the id's length (so "s/1" is not found
    inside "s/14"); keys are hashes."""
    return struct.pack("<H", len(id.encode())) + id.encode() in files


def fresh_model(cfg: ServeConfig, table: dict[str, int]) -> OnlineLearner:
    """A new learner fed the final table: each id's image (decoded as records are) with its final label."""
    train = load_split(replace(DATA, load_size=cfg.limits.size), "train")
    sid = stream_id(DATA, STREAM)
    index_of = {sample_id(sid, name): i for i, name in enumerate(list_files(DATA, "train").names)}
    index = [index_of[id] for id in sorted(table)]
    learner = build_learner(cfg, 10)
    features = torch.cat([learner.encode(train.images[index[i:i + 16]]).feature for i in range(0, len(index), 16)])
    learner.observe_features(features, torch.tensor([table[id] for id in sorted(table)]))
    return learner


def learned_model(cfg: ServeConfig) -> OnlineLearner:
    learner = build_learner(cfg, 10)
    learner.load_state_dict(checkpoint(cfg)["learner"])
    return learner


def test_corrections_and_deletions_leave_the_model_a_fresh_learner_builds_from_the_final_table(broker, tmp_path):
    cfg = corrected(settings(broker, tmp_path, protocol=ProtocolConfig(eval_period=0)), compact_every_s=0.0)
    plan = scenario(52)
    n = produce(DATA, STREAM, cfg.kafka, LATE)
    deletions = [id for _, id, label in plan.changes if label is None]
    plan.changes.append(("labels", deletions[0], 3))  # a label after its deletion: a new row, waiting for an image
    waiting, deleted = plan.waiting_labels(), sorted(set(deletions))
    with LiveServer(cfg) as http:
        learned = wait_for(lambda: (s := http.get("/v1/status").json())["samples_seen"] >= n and s, what="the stream")
        send_changes(cfg, [*plan.changes, ("images", "never-sent", None)])
        expected = {"corrections_applied": plan.relabels_applied(), "deletions_applied": len(deletions),
                    "deletions_refused": 1}
        status = wait_for(lambda: (s := http.get("/v1/status").json())["corrections"] | expected == s["corrections"]
                          and s, what="every change applied")
        metrics = http.get("/metrics").text
    changes = status["corrections"]
    assert changes["corrections_refused"] == 0 and status["label_join"]["labels"]["waiting"] == len(waiting)
    assert changes["ids"] == len(plan.final()) and changes["bytes_on_disk"] > 0
    assert f'mepo_sample_changes_total{{kind="deletions",outcome="applied"}} {len(deletions)}.0' in metrics
    assert status["model_version"] > learned["model_version"]  # the changes are new versions: replicas follow

    model, fresh = learned_model(cfg), fresh_model(cfg, plan.final())
    test = load_split(replace(DATA, load_size=32), "test")
    probe = fresh.encode(test.images).feature
    assert_same_model(model, fresh, probe)
    assert 7 not in model.predict(test.images)["running"].tolist()  # every sample of class 7 was deleted

    state = checkpoint(cfg)  # the deleted ids are gone from the table, the checkpoint and the join's memory
    raw = (cfg.checkpoint_dir / CHECKPOINT).read_bytes()
    assert not [id for id in deleted if id not in waiting and id.encode() in raw]
    assert sorted(state["join"]["label_ids"]) == sorted(waiting)  # their new labels wait for new images
    table = SampleTable(cfg.checkpoint_dir / "samples", 1e9)
    assert set(table.ids()) == set(plan.final()) and not set(deleted) & set(table.ids())
    table.close()
    files = b"".join(f.read_bytes() for f in (cfg.checkpoint_dir / "samples").iterdir())  # compacted: no old pages
    assert not [id for id in deleted if stored_id(id, files)]
    predictions = read_topic(cfg, cfg.kafka.predictions_topic, n + len(deletions))
    assert sorted(r.key.decode() for r in predictions if r.value is None) == sorted(deletions)
    dead = read_topic(cfg, cfg.kafka.dead_letter_topic, 1)
    assert [dict(r.headers)["error"] for r in dead] == [b"not_correctable"] and dead[0].key == b"never-sent"


def test_kill_9_twice_while_changes_are_applied_ends_with_the_final_tables_model(broker, tmp_path):
    """The stream and its changes are all in the broker; the learner is killed twice mid-way (mid-change,
    mid-checkpoint) and restarted: the model is still the final table's, and nothing is applied twice."""
    cfg = corrected(settings(broker, tmp_path, protocol=ProtocolConfig(eval_period=0), checkpoint_every=8))
    plan = scenario(53, after_delete=False)
    n = produce(DATA, STREAM, cfg.kafka, LATE)
    send_changes(cfg, plan.changes)
    images = n + sum(topic == "images" for topic, _, _ in plan.changes)
    labels = n + sum(topic == "labels" for topic, _, _ in plan.changes)
    ends = {f"{cfg.kafka.topic}:0": images, f"{cfg.kafka.labels_topic}:0": labels}
    rng, log = random.Random(7), tmp_path / "serve.log"
    learner = serve_process(cfg, log)
    try:
        for target in sorted(rng.sample(range(n // 2, n + len(plan.changes)), 2)):
            def due(learner=learner, target=target) -> bool:
                state = checkpoint(cfg)
                return learner.running() and state is not None and sum(state["offsets"].values()) >= target

            wait_for(due, what=f"a checkpoint past {target} records")
            time.sleep(rng.uniform(0, 0.2))
            learner.send_signal(signal.SIGKILL)
            learner.wait()
            learner = serve_process(cfg, log)
        wait_for(lambda: learner.running() and (s := checkpoint(cfg)) is not None and s["offsets"] == ends, 300,
                 "every record handled after the last restart")
    finally:
        learner.send_signal(signal.SIGTERM)
        learner.wait(60)
    test = load_split(replace(DATA, load_size=32), "test")
    fresh = fresh_model(cfg, plan.final())
    assert_same_model(learned_model(cfg), fresh, fresh.encode(test.images).feature)
    table = SampleTable(cfg.checkpoint_dir / "samples", 1e9)
    assert set(table.ids()) == set(plan.final())
    table.close()


def test_a_learner_that_cannot_forget_exactly_refuses_corrections_at_start(tmp_path):
    """The paper's recipe trains its prompts by gradient: a sample cannot be subtracted from it, so corrections are
    refused in one line before anything is read."""
    from server.learner.state import open_learner
    from tests.helpers import NO_BROKER

    base = settings(NO_BROKER, tmp_path, protocol=ProtocolConfig(eval_period=0))
    paper = replace(corrected(base), method="mvp", learner=replace(base.learner, classifier="linear"))
    with pytest.raises(ConfigError, match="can take a sample out exactly, and it trains by gradient") as e:
        open_learner(paper, ServerMetrics())
    assert "\n" not in str(e.value)


def test_a_correction_past_retention_is_dead_lettered_as_not_correctable(broker, tmp_path):
    cfg = corrected(settings(broker, tmp_path, protocol=ProtocolConfig(eval_period=0)), retention_s=1.0)
    n = produce(DATA, STREAM, cfg.kafka, LATE)
    first = sorted(scenario(54).labels)[0]
    with LiveServer(cfg) as http:
        wait_for(lambda: http.get("/v1/status").json()["samples_seen"] >= n, what="the stream")
        time.sleep(2.0)  # past retention in record time: the next record moves the clock there
        send_changes(cfg, [("labels", first, 1), ("labels", first, None)])
        status = wait_for(lambda: (c := http.get("/v1/status").json()["corrections"])["deletions_refused"] and c,
                          what="both refused")
    assert status["corrections_refused"] == 1 and status["ids"] == 0 and status["corrections_applied"] == 0
    dead = read_topic(cfg, cfg.kafka.dead_letter_topic, 2)
    assert [dict(r.headers)["error"] for r in dead] == [b"not_correctable"] * 2


def test_the_admin_routes_write_a_correction_and_a_deletion_that_the_learner_applies(broker, tmp_path):
    """``POST /v1/labels/{id}`` and ``DELETE /v1/samples/{id}`` (ids with slashes) answer 202 once the broker has
    the record, and the learner applies both; without the token, or with a label outside the label space, nothing
    is written."""
    cfg = corrected(settings(broker, tmp_path, protocol=ProtocolConfig(eval_period=0)))
    n = produce(DATA, STREAM, cfg.kafka, LATE)
    plan = scenario(55)
    first, second = sorted(plan.labels)[:2]
    admin = {"authorization": f"Bearer {cfg.admin_token}"}
    with LiveServer(cfg) as http:
        wait_for(lambda: http.get("/v1/status").json()["samples_seen"] >= n, what="the stream")
        assert http.delete(f"/v1/samples/{first}").status_code == 401
        refused = http.post(f"/v1/labels/{second}", json={"label": 10}, headers=admin)
        assert (refused.status_code, refused.json()["reason"]) == (422, "label_out_of_range")
        new = (plan.labels[second] + 1) % 10
        written = http.post(f"/v1/labels/{second}", json={"label": new}, headers=admin)
        assert written.status_code == 202 and written.json()["topic"] == cfg.kafka.labels_topic, written.text
        deleted = http.delete(f"/v1/samples/{first}", headers=admin)
        assert deleted.status_code == 202 and deleted.json()["offset"] == written.json()["offset"] + 1
        status = wait_for(lambda: (c := http.get("/v1/status").json()["corrections"])["deletions_applied"] and c,
                          what="the deletion")
    assert status["corrections_applied"] == 1 and status["ids"] == n - 1
    table = plan.labels | {second: new}
    del table[first]
    fresh = fresh_model(cfg, table)
    test = load_split(replace(DATA, load_size=32), "test")
    assert_same_model(learned_model(cfg), fresh, fresh.encode(test.images).feature)


def test_a_replica_follows_a_deletion_and_no_longer_answers_with_the_deleted_class(broker, tmp_path):
    """Changes are model versions like any other: a replica loads the version without class 7 (every one of its
    images deleted) and answers as the learner does."""
    from tests.test_replica import jpeg, learner_settings, predict, replica_of, version_of

    cfg = corrected(learner_settings(broker, tmp_path))
    n = produce(DATA, STREAM, cfg.kafka, LATE)
    gone = [("labels", id, None) for id, label in scenario(56).labels.items() if label == 7]
    follower = replica_of(cfg)
    replica, server = serve_process(follower, tmp_path / "replica.log"), LiveServer(cfg)
    try:
        with server as http:
            wait_for(lambda: http.get("/v1/status").json()["samples_seen"] >= n, what="the stream")
            send_changes(cfg, gone)
            learner = wait_for(lambda: (s := http.get("/v1/status").json())["corrections"]["deletions_applied"]
                               == len(gone) and s, what="the deletions")
            version = learner["model_version"]
            wait_for(lambda: replica.running() and version_of(follower.port) == version, 60,
                     f"the replica at version {version}", ignore=(httpx.TransportError,))
            answer = predict(follower.port)
            assert answer == predict(server.port) and answer["model_version"] == version
            every = httpx.post(f"http://127.0.0.1:{follower.port}/v1/predict", params={"top_k": 10},
                               content=jpeg("red"), headers={"content-type": "image/jpeg"}).json()
            sevens = [c["probability"] for c in every["predictions"][0]["top_k"] if c["label"] == 7]
            assert sevens == [0.0]  # still a head output, its class emptied: never predicted
    finally:
        replica.terminate()
        replica.wait(60)
