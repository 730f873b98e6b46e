"""One fast test per guarantee of docs/reliability.md, each failing when that
guarantee alone is broken (``make mutate`` checks that they do).

The learner loop runs over the fake Kafka clients of ``tests.fakes``, whose event log records the order of the
loop's side effects (dead-letter sends, producer flushes, checkpoints, commits); faults are injected (a save that
raises half-way), never waited for.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from starlette.requests import Request
from starlette.responses import PlainTextResponse

import mepo_stream.checkpoint as checkpoint
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.artifacts import SIGMA_PRE, write_bundle
from mepo_stream.checkpoint import LearnerCheckpoint, load_checkpoint, save_checkpoint
from mepo_stream.errors import StateRefused
from mepo_stream.images import ImageLimits
from mepo_stream.model import BundleParts
from mepo_stream.records import RecordError, parse_headers, record_headers
from server.config import ServeConfig, model_config, replica_of
from server.learner.state import CHECKPOINT, StateWriteFailed, build_learner, open_learner
from server.metrics import ServerMetrics
from server.replica.follower import ReplicaModel, SnapshotRefused
from server.snapshot import take_snapshot
from server.snapshot_topic import Origin, SnapshotMessage
from server.web.app import create_app
from server.web.dependencies import get_service
from tests.fakes import STREAM_ID, TOPIC, TP, FakeConsumer, record, records, run_loop, service
from tests.helpers import NO_BROKER, RUNNING, color_images, settings

SAVE = LearnerCheckpoint.save  # the real write, under the tests' wrappers


def logged_checkpoints(monkeypatch, events: list) -> None:
    """Every checkpoint written goes to ``events`` as ("checkpoint", offsets), once it is on disk."""

    def save(checkpoint, path):
        written = SAVE(checkpoint, path)
        events.append(("checkpoint", dict(checkpoint.position.offsets)))
        return written

    monkeypatch.setattr(LearnerCheckpoint, "save", save)


# --- offsets, checkpoints and dead letters ----------------------------------------------------------------------
def test_offsets_are_committed_only_after_a_checkpoint_holding_them(tmp_path, monkeypatch):
    state, loop, _ = service(tmp_path, checkpoint_every=16)
    events: list = []
    logged_checkpoints(monkeypatch, events)
    consumer = run_loop(monkeypatch, loop, records(list(range(40))), events)
    commits = [i for i, e in enumerate(events) if e[0] == "commit"]
    assert len(commits) >= 2 and consumer.committed == {f"{TOPIC}:0": 40}
    for i in commits:
        saved = [e[1] for e in events[:i] if e[0] == "checkpoint"]
        assert saved and saved[-1] == events[i][1], f"commit {events[i]} without its checkpoint before it"


@pytest.mark.parametrize("min_interval_s", [0.0, 3600.0])
def test_periodic_checkpoints_are_at_least_the_min_interval_apart(tmp_path, monkeypatch, min_interval_s):
    """A fast learner checkpoints every ``--checkpoint_every`` samples only as often as the interval allows: within
    an hour, the first periodic one and the last (idle, then stopping) are all; every offset still reaches a
    checkpoint before its commit."""
    state, loop, _ = service(tmp_path, checkpoint_every=16, checkpoint_min_interval_s=min_interval_s)
    events: list = []
    logged_checkpoints(monkeypatch, events)
    poll = FakeConsumer.poll

    def poll_once_written(consumer, wait_ms, max_records):  # each write on disk before the next poll: no load decides
        while loop.writing is not None and not loop.writing.done():
            time.sleep(0.001)
        return poll(consumer, wait_ms, max_records)

    monkeypatch.setattr(FakeConsumer, "poll", poll_once_written)
    consumer = run_loop(monkeypatch, loop, records(list(range(80))), events)
    saved = [e[1][f"{TOPIC}:0"] for e in events if e[0] == "checkpoint"]
    assert saved == ([16, 80] if min_interval_s else [16, 32, 48, 64, 80])  # each once due, the writer idle
    assert consumer.committed == {f"{TOPIC}:0": 80}


def test_a_checkpoint_written_while_the_loop_learns_on_holds_the_model_of_its_offsets(tmp_path, monkeypatch):
    """The periodic checkpoint is written in its own thread while the loop learns on: what it writes is the copy
    taken between two steps, not the live model that learning keeps changing."""
    state, loop, _ = service(tmp_path, checkpoint_every=16)
    written = []

    def save_after_more_learning(saved, path):
        if not written:  # the first periodic checkpoint: let the loop learn the next mini-batch first
            deadline = time.monotonic() + 10
            while state.samples_seen < 32 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert state.samples_seen >= 32, "the loop waited for the checkpoint instead of learning on"
        written.append(saved)
        return SAVE(saved, path)

    monkeypatch.setattr(LearnerCheckpoint, "save", save_after_more_learning)
    run_loop(monkeypatch, loop, records(list(range(48))))
    first = written[0]
    assert first.position.offsets == {f"{TOPIC}:0": 16} and first.samples_seen == 16
    assert int(first.learner["method"]["classifier.counts"].sum()) == 16  # not the 32+ learned meanwhile


@pytest.mark.parametrize("first_in_flight_at_32", [False, True])
def test_a_failed_checkpoint_commits_nothing(tmp_path, monkeypatch, first_in_flight_at_32):
    """The second state write fails: the loop stops naming it, and only the first write's offsets are committed.
    The second is the one due at offset 32 when the first is on disk by then, else the stream's end's (40: one
    write in flight at a time). The second case is forced: the first write waits until 32 samples are learned."""
    state, loop, _ = service(tmp_path, checkpoint_every=16)
    events: list = []
    calls, failed = [], []

    def save_once_then_fail(saved, path):
        calls.append(1)
        if len(calls) > 1:
            failed.append(saved.position.offsets[f"{TOPIC}:0"])
            raise OSError("disk full")
        deadline = time.monotonic() + 10
        while first_in_flight_at_32 and state.samples_seen < 32 and time.monotonic() < deadline:
            time.sleep(0.01)
        return SAVE(saved, path)

    monkeypatch.setattr(LearnerCheckpoint, "save", save_once_then_fail)
    consumer = FakeConsumer(loop, records(list(range(40))), events)
    monkeypatch.setattr("server.learner.stream.ensure_topics", lambda kafka, *topics: None)
    monkeypatch.setattr("server.learner.stream.open_producer", lambda kafka, **_: loop.producer)
    monkeypatch.setattr("server.learner.stream.open_consumer", lambda *_: consumer)
    loop.run()
    assert failed == [40] if first_in_flight_at_32 else failed in ([32], [40])
    assert loop.error == (f"StateWriteFailed: the state write of {TOPIC}:0 at offset {failed[0]} failed (OSError: "
                          "disk full); the learner stops: nothing was committed past its last written state, a "
                          "restart resumes from there")  # the loop stops, reports, and keeps serving
    assert consumer.committed == load_checkpoint(state.cfg.checkpoint_dir / CHECKPOINT)["offsets"] == {f"{TOPIC}:0": 16}
    assert isinstance(loop.failure, StateWriteFailed)  # kept: nothing more is written, even on a revocation
    if first_in_flight_at_32:  # the failed write's offsets count as unsaved again (nothing was learned after 40)
        assert set(state.intake.book.unsaved_keys()) == {f"{TOPIC}:0"}


def test_a_crash_in_the_middle_of_a_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / CHECKPOINT
    save_checkpoint(path, {"offsets": {"images:0": 16}, "w": torch.ones(1000)})
    real_save = torch.save

    def crash_half_way(obj, f):  # the bytes reach the disk, then the process "dies"
        real_save(obj, f)
        os.truncate(f, os.path.getsize(f) // 2)
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(checkpoint.torch, "save", crash_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"offsets": {"images:0": 32}, "w": torch.zeros(1000)})
    kept = load_checkpoint(path)
    assert kept["offsets"] == {"images:0": 16} and torch.equal(kept["w"], torch.ones(1000))
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT]  # no temporary file left behind


def test_dead_letters_are_flushed_before_the_offsets_that_skip_them_are_saved_or_committed(tmp_path, monkeypatch):
    state, loop, _ = service(tmp_path, checkpoint_every=16)
    events: list = []
    logged_checkpoints(monkeypatch, events)
    log = records(list(range(20)))
    log[3] = record(3, 3, value=b"not an image")
    run_loop(monkeypatch, loop, log, events)
    sent = events.index(("send", state.cfg.kafka.dead_letter_topic))
    first_past = next(i for i, e in enumerate(events) if e[0] in ("checkpoint", "commit") and e[1][f"{TOPIC}:0"] > 3)
    assert ("flush",) in events[sent:first_past], events


def test_dead_letter_records_carry_every_header_and_the_original_record(tmp_path):
    state, loop, _ = service(tmp_path)
    bad_image, bad_label = record(7, 3, value=b"not an image"), record(8, 4)
    bad_label.headers = record_headers(10, 4, 4, STREAM_ID, "cifar10")  # labels are 0..9
    loop.accept([bad_image])
    loop.accept([bad_label])
    assert [m["topic"] for m in loop.producer.sent] == [state.cfg.kafka.dead_letter_topic] * 2
    for sent, original, reason in zip(loop.producer.sent, (bad_image, bad_label),
                                      ("not_an_image", "label_out_of_range"), strict=True):
        headers = sent["headers"]
        names = [k for k, _ in headers[:5]]
        assert names == ["error", "error_message", "source_topic", "source_partition", "source_offset"]
        h = dict(headers[:5])
        assert h["error"] == reason.encode() and h["error_message"]
        assert (h["source_topic"], h["source_partition"], h["source_offset"]) == (
            TOPIC.encode(), b"0", str(original.offset).encode())
        assert headers[5:] == original.headers and sent["value"] == original.value and sent["key"] == original.key
    assert state.intake.book.dead_lettered == 2 and state.intake.book.offsets == {f"{TOPIC}:0": 9}


def test_a_partial_batch_is_learned_as_soon_as_the_topic_goes_idle(tmp_path, monkeypatch):
    state, loop, _ = service(tmp_path)  # batch size 16
    events: list = []
    learn = state.learn
    state.learn = lambda batch, key=None: events.append(("learn", len(batch))) or learn(batch, key)
    run_loop(monkeypatch, loop, records(list(range(5))), events, idle_polls=1)
    idle = [i for i, e in enumerate(events) if e == ("idle poll",)]
    assert events[idle[0] + 1] == ("learn", 5) and idle[1] > idle[0] + 1  # learned before the loop stopped


# --- what a record and a checkpoint may hold --------------------------------------------------------------------
def test_header_values_are_read_as_bytes_and_a_null_value_is_no_header():
    """Kafka clients hand header values as bytes, a bytearray, or None (a null value): read alike, None as absent."""
    headers = [(k, bytearray(v) if k == "label" else v) for k, v in record_headers(3, 7, 7, STREAM_ID, "cifar10")]
    meta = parse_headers([*headers, ("id", None)], n_classes=10)
    assert (meta.label, meta.sample_index, meta.stream_id, meta.id) == (3, 7, STREAM_ID, None)
    with pytest.raises(RecordError, match="no 'label' header"):
        parse_headers([(k, None if k == "label" else v) for k, v in headers], n_classes=10)


@pytest.mark.parametrize(("label", "ok"), [(0, True), (9, True), (10, False), (-1, False)])
def test_labels_are_bounded_by_the_label_space(label, ok):
    headers = record_headers(label, 0, 0, STREAM_ID, "cifar10")
    if ok:
        assert parse_headers(headers, n_classes=10).label == label
    else:
        with pytest.raises(RecordError, match="outside 0..9") as e:
            parse_headers(headers, n_classes=10)
        assert e.value.reason == "label_out_of_range"


class Payload:
    """Unpickling this object runs code: it writes a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_holding_a_pickled_object_is_refused_without_running_it(tmp_path):
    path, marker = tmp_path / CHECKPOINT, tmp_path / "ran"
    torch.save({"offsets": {}, "learner": Payload(str(marker))}, path)
    with pytest.raises(ValueError, match="is not a readable mepo checkpoint"):
        load_checkpoint(path)
    assert not marker.exists()


# --- HTTP: admin token and body limits --------------------------------------------------------------------------
def admin_client(tmp_path, token: str | None) -> tuple[TestClient, list[tuple[str, str]], list[str]]:
    """The app with a stand-in service whose loop records the admin actions; its admin routes, from the schema."""
    app = create_app(settings(NO_BROKER, tmp_path, admin_token=token))
    calls: list[str] = []
    service = SimpleNamespace(**{name: (lambda name=name: calls.append(name))
                                 for name in ("pause", "resume", "request_checkpoint")})
    app.dependency_overrides[get_service] = lambda: service
    admin = [(path, method) for path, ops in app.openapi()["paths"].items() if "/admin/" in path for method in ops]
    return TestClient(app), admin, calls  # no lifespan: no model, no broker


def refused(response, status: int, reason: str) -> bool:
    body = response.json()
    return response.status_code == status and body["reason"] == reason and bool(body["error"])


def test_every_admin_route_needs_the_token(tmp_path):
    client, admin, calls = admin_client(tmp_path, "s3cret")
    assert {p for p, _ in admin} == {"/v1/admin/checkpoint", "/v1/admin/pause", "/v1/admin/resume"}
    for path, method in admin:
        done = len(calls)
        assert refused(client.request(method, path), 401, "unauthorized"), path
        wrong = {"Authorization": "Bearer s3cre"}
        assert refused(client.request(method, path, headers=wrong), 403, "forbidden"), path
        assert refused(client.request(method, path, headers={"Authorization": "Bearer s3cret x"}), 403,
                       "forbidden"), path  # the token is all after the first space
        for header in ("Basic s3cret", "Bearer", "Bearer ", "s3cret", "Token Bearer s3cret"):
            assert refused(client.request(method, path, headers={"Authorization": header}), 401, "unauthorized"), (
                path, header)
        assert len(calls) == done, f"{path} acted without the token"
        assert client.request(method, path, headers={"Authorization": "bearer s3cret"}).status_code == 200, path
    assert sorted(calls) == ["pause", "request_checkpoint", "resume"]


def test_admin_routes_are_closed_when_no_token_is_configured(tmp_path):
    client, admin, calls = admin_client(tmp_path, None)
    for path, method in admin:
        for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer None"}):
            assert refused(client.request(method, path, headers=headers), 403, "admin_disabled"), path
    assert calls == []


def echo_app(tmp_path, max_bytes: int, max_files: int, **kw) -> TestClient:
    """The app (its middleware and error handlers) plus a route that reads the whole body and answers its length
    (``kw``: more settings, e.g. ``max_inflight_bytes``)."""
    app = create_app(settings(NO_BROKER, tmp_path, limits=ImageLimits(max_bytes=max_bytes), max_files=max_files,
                              **kw))

    @app.post("/upload")
    async def upload(request: Request) -> PlainTextResponse:
        return PlainTextResponse(str(len(await request.body())))

    return TestClient(app)


LIMITS = {"image/png": 1000,  # one image
          "multipart/form-data; boundary=x": 2 * (1000 + 64 * 1024),  # max_files images and their part headers
          "application/json": 2 * 1334 + 64 * 1024,  # max_files images in base64 (4/3, rounded up) and the JSON
          "": 2 * 1334 + 64 * 1024}  # no Content-Type: read as JSON (as OIP clients send it)


@pytest.mark.parametrize("content_type", list(LIMITS))
@pytest.mark.parametrize("chunked", [False, True])
def test_the_upload_limit_admits_the_limit_and_refuses_one_byte_more(tmp_path, content_type, chunked):
    client, limit = echo_app(tmp_path, max_bytes=1000, max_files=2), LIMITS[content_type]

    def body(n: int):
        data = b"x" * n
        return (data[i: i + 4096] for i in range(0, n, 4096)) if chunked else data

    headers = {"Content-Type": content_type} if content_type else {}
    ok = client.post("/upload", content=body(limit), headers=headers)
    assert ok.status_code == 200 and ok.text == str(limit)
    assert refused(client.post("/upload", content=body(limit + 1), headers=headers), 413, "too_large")


def drive(app, headers: dict[str, str], chunks: list[bytes]) -> tuple[int, int]:
    """One request straight through the ASGI app, its body in ``chunks`` (one ASGI message each, as a chunked
    upload arrives); returns the status and how many body messages the app took."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    taken, status = [], []

    async def receive():
        taken.append(1)
        return messages[len(taken) - 1] if len(taken) <= len(messages) else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {"type": "http", "method": "POST", "path": "/upload", "raw_path": b"/upload", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()], "http_version": "1.1",
             "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": "", "app": app}
    asyncio.run(app(scope, receive, send))
    return status[0], len(taken)


@pytest.mark.parametrize("content_type", list(LIMITS))
def test_a_chunked_upload_is_refused_once_its_running_total_passes_the_limit(tmp_path, content_type):
    app, limit = echo_app(tmp_path, max_bytes=1000, max_files=2).app, LIMITS[content_type]
    headers = {"content-type": content_type} if content_type else {}
    piece = 300  # every chunk below every limit: only the running total can pass it
    chunks = [b"x" * piece] * (limit // piece) + [b"x" * (limit % piece)]
    assert drive(app, headers, chunks)[0] == 200
    status, taken = drive(app, headers, chunks + [b"x"] * 1000)
    assert status == 413 and taken == len(chunks) + 1  # stopped at the first byte over, the rest never read


def test_a_declared_oversize_body_is_refused_before_any_of_it_is_read(tmp_path):
    app = echo_app(tmp_path, max_bytes=1000, max_files=2).app
    assert drive(app, {"content-type": "image/png", "content-length": "1001"}, [b"x" * 1001]) == (413, 0)
    assert drive(app, {"content-type": "image/png", "content-length": "1000"}, [b"x" * 1000]) == (200, 1)


def test_bodies_in_flight_share_one_budget_and_what_does_not_fit_gets_503_with_retry_after(tmp_path):
    """``--max_inflight_bytes`` 1,500 with one image body of 1,000 declared bytes held open (half of it read):
    a second declared body of 600 would pass the budget and gets 503 with Retry-After before any of it is read,
    one of 500 fits; a chunked one is refused once what arrived passes the budget. When the held body ends, its
    bytes are given back: the budget is whole again (the proof: the same 1,000 + 500 fit once more)."""
    app = echo_app(tmp_path, max_bytes=1000, max_files=2, max_inflight_bytes=1500).app
    png = {"content-type": "image/png"}

    async def request(headers: dict[str, str], chunks: list[bytes], gate: asyncio.Event | None = None,
                      started: asyncio.Event | None = None) -> tuple[int, dict[str, str], int]:
        """Status, headers and body messages taken; after its first chunk the body waits for ``gate``."""
        taken, answer = [], {}

        async def receive():
            taken.append(1)
            if len(taken) == 2 and gate is not None:
                started.set()
                await gate.wait()
            i = len(taken) - 1
            return {"type": "http.request", "body": chunks[i], "more_body": i < len(chunks) - 1} \
                if i < len(chunks) else {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                answer.update(status=message["status"], headers={k.decode(): v.decode() for k, v in message["headers"]})

        scope = {"type": "http", "method": "POST", "path": "/upload", "raw_path": b"/upload", "query_string": b"",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()], "http_version": "1.1",
                 "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": "", "app": app}
        await app(scope, receive, send)
        return answer["status"], answer["headers"], len(taken)

    async def while_one_is_held() -> dict[str, tuple[int, dict[str, str], int]]:
        gate, started = asyncio.Event(), asyncio.Event()
        held = asyncio.create_task(request({**png, "content-length": "1000"}, [b"x" * 500, b"x" * 500], gate, started))
        await started.wait()  # 1,000 bytes reserved, 500 of them read
        out = {"over": await request({**png, "content-length": "600"}, [b"x" * 600]),
               "fits": await request({**png, "content-length": "500"}, [b"x" * 500]),
               "chunked over": await request(png, [b"x" * 100] * 6)}
        gate.set()
        out["held"] = await held
        return out

    first = asyncio.run(while_one_is_held())
    assert first["held"][0] == 200 and first["fits"][0] == 200
    assert first["over"][0] == 503 and first["over"][1]["retry-after"] == "1" and first["over"][2] == 0
    assert first["chunked over"][0] == 503 and first["chunked over"][1]["retry-after"] == "1"
    assert first["chunked over"][2] == 6  # its 600th byte passes 1,500: refused then, not before
    again = asyncio.run(while_one_is_held())  # nothing leaked: the same answers
    assert {k: v[0] for k, v in again.items()} == {k: v[0] for k, v in first.items()}
    alone = asyncio.run(request({**png, "content-length": "1000"}, [b"x" * 1000]))
    assert alone[0] == 200  # a body alone always fits (its own limit holds), whatever the budget


# --- replicas ---------------------------------------------------------------------------------------------------
def test_a_replica_refuses_another_bundle_other_backbone_weights_and_options_that_contradict_the_snapshot(tmp_path):
    bundle = write_bundle(tmp_path / "bundle", {SIGMA_PRE: {SIGMA_PRE: torch.eye(64, dtype=torch.float64)}},
                          {"kind": "covariance"})
    cfg = settings(NO_BROKER, tmp_path, mepo=bundle)
    learner = build_learner(cfg, 2)
    bundle_sha256 = BundleParts.of(bundle).sha256()
    ours = Origin("mepo", model_config(cfg).to_json(), ("a", "b"), learner.method.backbone_sha256, bundle_sha256)
    model = ReplicaModel(replica_of(cfg))
    assert model.config(ours) == model_config(cfg)
    for theirs, shown in ((None, "None"), ("f" * 64, "f" * 12)):
        with pytest.raises(SnapshotRefused, match=f"bundle has sha256 {shown}…, this replica's {bundle_sha256[:12]}… "
                                          f".give it the learner's bundle with --mepo") as e:
            model.config(replace(ours, bundle_sha256=theirs))
        assert e.value.reason == "bundle_mismatch"
    message = SnapshotMessage(learner.method.trainable_state_dict(), ours, 1, 0, (), 0.0)
    assert model.snapshot(message).version == 1
    with pytest.raises(SnapshotRefused, match="backbone has sha256 000000000000…") as e:
        model.snapshot(replace(message, origin=replace(ours, backbone_sha256="0" * 64)))
    assert e.value.reason == "backbone_mismatch"
    other = ReplicaModel(replica_of(cfg, backbone=replace(cfg.backbone, img_size=48)))
    with pytest.raises(SnapshotRefused, match="--backbone.img_size 48 contradicts the learner's 32") as e:
        other.config(ours)
    assert e.value.reason == "backbone_mismatch"


def test_a_replica_left_at_serves_defaults_builds_the_model_its_snapshots_define(tmp_path):
    cfg = settings(NO_BROKER, tmp_path)  # the tiny test backbone at 32 px: not serve's default model
    learner = build_learner(cfg, 2)
    learner.observe(color_images(torch.tensor([0, 1] * 4)), torch.tensor([0, 1] * 4))
    ours = Origin("mepo", model_config(cfg).to_json(), ("a", "b"), learner.method.backbone_sha256, None)
    model = ReplicaModel(replica_of(ServeConfig()))
    snapshot = model.snapshot(SnapshotMessage(learner.method.trainable_state_dict(), ours, 3, 8, (0, 1), 0.0))
    images = color_images(torch.tensor([0, 1, 2]))
    assert torch.equal(snapshot.probabilities(images), take_snapshot(learner, 3).probabilities(images))


# --- what operators see -----------------------------------------------------------------------------------------
def test_lag_counts_the_records_read_but_not_yet_learned(tmp_path):
    state, loop, _ = service(tmp_path)
    loop.consumer = consumer = FakeConsumer(loop, records(list(range(8))))
    loop.accept(consumer.poll(0, 5))
    loop.update_lag()
    assert loop.lag == {f"{TOPIC}:0": 8}  # 3 unread + 5 waiting in the mini-batch
    loop.learn_pending()
    loop.update_lag()
    metric = state.metrics.registry.get_sample_value("mepo_kafka_consumer_lag_records", {"partition": "0"})
    assert loop.lag == {f"{TOPIC}:0": 3} and metric == 3
    loop.accept(consumer.poll(0, 5))
    loop.learn_pending()
    loop.update_lag()
    assert loop.lag == {f"{TOPIC}:0": 0}  # drained and learned


def test_an_idle_stream_is_evaluated_once_where_it_stopped(tmp_path, monkeypatch):
    state, loop, _ = service(tmp_path, protocol=ProtocolConfig(eval_period=10))
    run_loop(monkeypatch, loop, records(list(range(25))), idle_polls=3)
    curve = state.reporter.curve
    assert curve.samples == [10, 20] and len(curve.task_accuracy) == 1  # A_last at 25, not again while idle
    assert state.reporter.status(RUNNING).a_last == curve.task_accuracy[0] and not state.reporter.idle_evaluation_due


def test_per_class_accuracy_of_the_latest_evaluation_is_exported(tmp_path, monkeypatch):
    state, loop, _ = service(tmp_path, protocol=ProtocolConfig(eval_period=10))
    run_loop(monkeypatch, loop, records(list(range(30))))
    assert state.reporter.curve.samples == [10, 20, 30]  # the loop cut its batches at the scheduled positions
    per_class = state.reporter.status(RUNNING).class_accuracy
    assert set(per_class) == {state.class_names[c] for c in range(10)}
    text = generate_latest(state.metrics.registry).decode()
    for name, acc in per_class.items():
        assert f'mepo_class_accuracy_ratio{{class_name="{name}"}} {float(acc)}' in text


def test_a_restart_continues_from_the_checkpoint_model_offsets_and_curve(tmp_path, monkeypatch):
    state, loop, _ = service(tmp_path, protocol=ProtocolConfig(eval_period=10))
    run_loop(monkeypatch, loop, records(list(range(35))))
    again = open_learner(state.cfg, ServerMetrics())  # a new process on the same checkpoint folder
    assert again.version == state.version == 4 and again.learner.samples_seen == 35  # 10, 10, 10, 5
    assert again.intake.book.offsets == state.intake.book.offsets == {f"{TOPIC}:0": 35}
    assert again.reporter.curve == state.reporter.curve and again.reporter.curve.samples == [10, 20, 30]
    assert again.snapshot.version == 4 and again.learner.exposed == state.learner.exposed


@pytest.mark.parametrize("raised, refused", [(StateRefused("another model's state"), True),
                                             (ValueError("a bug"), False)])
def test_only_a_named_refusal_stops_the_learner_as_a_refusal(tmp_path, monkeypatch, raised, refused):
    """A state the options cannot take is a refusal (one line, a metric, the learner stops cleanly); a
    ``ValueError`` from a bug is not read as one: it keeps its traceback."""
    state, loop, _ = service(tmp_path)
    loop.consumer = SimpleNamespace(partitions_of=lambda topic: {0})

    def read(keys, corrections):
        raise raised

    monkeypatch.setattr(state.membership, "read", read)
    if refused:
        loop.take_over((TP,))
        assert loop.refusal is raised
    else:
        with pytest.raises(ValueError, match="a bug"):
            loop.take_over((TP,))
        assert loop.refusal is None
