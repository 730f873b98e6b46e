"""Prediction replicas (``mepo replica``) against the real broker.

A learner and two replicas run as processes: the replicas converge to the learner's version and answer exactly as
it does; a replica killed and restarted catches up from the snapshot topic; the replicas keep serving while the
learner is down. In-process replicas check the refusals: a snapshot from another backbone is refused, corrupt
snapshot records are skipped and counted, never loaded. The wire format is checked without a broker.
"""

from __future__ import annotations

import hashlib
import io
import logging
import signal
import time
from dataclasses import replace

import httpx
import pytest
import torch
from kafka import KafkaProducer
from PIL import Image

from mepo_stream.anytime import ProtocolConfig
from mepo_stream.data import list_files
from mepo_stream.sampler import SiBlurryConfig
from producers.siblurry import ReplayConfig, produce
from server.broker import free_port
from server.config import DemoConfig, ReplicaConfig, ServeConfig, model_config, replica_of
from server.learner.state import build_learner
from server.metrics import ServerMetrics
from server.replica.follower import ReplicaService
from server.snapshot import Snapshot, take_snapshot
from server.snapshot_topic import Assembler, CorruptSnapshot, Origin, encode, to_records
from tests.helpers import DATA, TINY, color_images, serve_process, settings, wait_for

STREAM = SiBlurryConfig(seed=1)


def learner_settings(broker, tmp_path, **kw) -> ServeConfig:
    """The tiny learner on fresh topics, its own snapshot topic included, publishing every 0.2 s at most."""
    cfg = settings(broker, tmp_path, protocol=ProtocolConfig(eval_period=0), publish_interval_s=0.2, **kw)
    return replace(cfg, kafka=replace(cfg.kafka, snapshot_topic=f"snapshots-{cfg.kafka.group_id}"))


def replica_settings(cfg: ServeConfig, **kw) -> ReplicaConfig:
    """A replica of the learner ``cfg`` on a port of its own."""
    return replica_of(cfg, port=free_port(), **kw)


def jpeg(color: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="JPEG")
    return buf.getvalue()


def predict(port: int) -> dict:
    """Top-3 of three images from the server on ``port``, with the version that answered."""
    files = [("files", (f"{c}.jpg", jpeg(c), "image/jpeg")) for c in ("red", "green", "blue")]
    r = httpx.post(f"http://127.0.0.1:{port}/v1/predict", files=files, params={"top_k": 3}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def status(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=10).json()


def version_of(port: int) -> int:
    return status(port)["model_version"]


def test_two_replicas_follow_the_learner_answer_as_it_does_and_survive_restarts(broker, tmp_path):
    cfg = learner_settings(broker, tmp_path)
    n = produce(DATA, STREAM, cfg.kafka, ReplayConfig())
    replicas = [replica_settings(cfg), replica_settings(cfg)]
    procs = [serve_process(c, tmp_path / f"serve-{i}.log") for i, c in enumerate([cfg, *replicas])]
    try:
        final = wait_for(lambda: (s := status(cfg.port))["samples_seen"] == n and s["model_version"], 180,
                         "the learner to learn the stream", ignore=(httpx.TransportError,))
        for r in replicas:
            wait_for(lambda r=r: version_of(r.port) == final, 60, f"replica :{r.port} at version {final}",
                     ignore=(httpx.TransportError,))
        answer = predict(cfg.port)
        assert answer["model_version"] == final and all(predict(r.port) == answer for r in replicas)
        metrics = httpx.get(f"http://127.0.0.1:{replicas[0].port}/metrics").text
        assert f"mepo_model_version {final:.1f}" in metrics and "mepo_replica_lag_versions 0.0" in metrics
        assert "mepo_replica_snapshot_age_seconds" in metrics and "mepo_samples_learned_total" not in metrics

        procs[1].send_signal(signal.SIGKILL)  # a replica dies hard, and comes back
        procs[1].wait()
        procs[1] = serve_process(replicas[0], tmp_path / "serve-1.log")
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{replicas[0].port}/readyz").status_code == 200, 60,
                 "the restarted replica to be ready", ignore=(httpx.TransportError,))
        assert version_of(replicas[0].port) == final and predict(replicas[0].port) == answer

        procs[0].send_signal(signal.SIGTERM)  # the learner goes away; the replicas keep serving its last snapshot
        procs[0].wait(60)
        for r in replicas:
            assert httpx.get(f"http://127.0.0.1:{r.port}/readyz").status_code == 200 and predict(r.port) == answer
    finally:
        for p in procs:
            p.terminate()
            p.wait(60)


# --- in-process replicas: refusals ------------------------------------------------------------------------------
def learner_snapshot(cfg: ServeConfig, version: int = 1) -> tuple[Snapshot, bytes]:
    """A learner of ``cfg`` (built as the service builds it) after one mini-batch, and its published blob."""
    torch.manual_seed(cfg.seed)
    learner = build_learner(cfg, 10)
    labels = torch.tensor([0, 1, 2, 3] * 4)
    learner.observe(color_images(labels), labels)
    snapshot = take_snapshot(learner, version, cfg.alignment.inference_mode)
    origin = Origin(cfg.model_name, model_config(cfg).to_json(), tuple(list_files(DATA, "train").class_names),
                    learner.method.backbone_sha256, None)
    return snapshot, encode(snapshot.model.trainable_state_dict(), origin, version, learner.samples_seen,
                            tuple(learner.exposed), time.time())


def send(cfg: ServeConfig, records: list) -> None:
    producer = KafkaProducer(**cfg.kafka.client_options(), acks="all", max_request_size=4_000_000)
    for key, value, headers in records:
        producer.send(cfg.kafka.snapshot_topic, key=key, value=value, headers=headers)
    producer.flush()
    producer.close()


def refused(metrics: ServerMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value("mepo_replica_snapshots_refused_total", {"reason": reason}) or 0.0


@pytest.fixture
def replica(broker, tmp_path):
    """Start an in-process replica of a config (``replica(cfg)``); every one is stopped at the end."""
    started = []

    def start(cfg: ServeConfig) -> ReplicaService:
        started.append(ReplicaService.start(cfg, ServerMetrics("replica")))
        return started[-1]

    yield start
    for service in started:
        service.stop()


def test_a_snapshot_from_another_backbone_is_refused_with_a_clear_log_line(broker, tmp_path, replica, caplog):
    cfg = learner_settings(broker, tmp_path)
    _, blob = learner_snapshot(cfg)
    other = replica(replica_settings(cfg, backbone=replace(TINY, img_size=48)))  # resampled positions: other weights
    with caplog.at_level(logging.ERROR, logger="server.replica"):
        send(cfg, to_records(blob, cfg.model_name, 1, cfg.kafka.snapshot_chunk_bytes))
        wait_for(lambda: refused(other.state.metrics, "backbone_mismatch") == 1, 60, "the refusal")
    assert not other.readiness().checks["snapshot_loaded"] and other.state.snapshot.version == 0
    assert "refused snapshot version 1: --backbone.img_size 48 contradicts the learner's 32" in caplog.text


def test_corrupt_snapshot_records_are_skipped_and_counted_and_the_next_good_one_loads(broker, tmp_path, replica):
    cfg = learner_settings(broker, tmp_path)
    snapshot, blob = learner_snapshot(cfg, version=2)
    follower = replica(replica_settings(cfg))
    good = to_records(blob, cfg.model_name, 2, chunk_bytes=4096)  # many small parts
    assert len(good) > 2
    flipped = bytearray(good[0][1])
    flipped[100] ^= 0xFF
    garbage = b"not a snapshot" * 10
    bad = [(b"mepo/0", garbage, []),  # no headers at all
           (good[0][0], bytes(flipped), good[0][2]), *good[1:],  # a part changed: the sha256 does not match
           *to_records(garbage, cfg.model_name, 1, 4096)]  # parts that check out but hold no safetensors
    send(cfg, bad)
    wait_for(lambda: refused(follower.state.metrics, "corrupt") == 3, 60, "three corrupt snapshots skipped")
    send(cfg, good)
    wait_for(lambda: follower.state.snapshot.version == 2, 60, "the good snapshot after the corrupt ones")
    assert refused(follower.state.metrics, "corrupt") == 3
    images = color_images(torch.tensor([0, 1, 2, 3, 5]))
    assert torch.equal(follower.state.snapshot.probabilities(images), snapshot.probabilities(images))
    assert follower.state.snapshot.exposed == snapshot.exposed and follower.readiness().checks["snapshot_loaded"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="int8 runs on the CPU only; a CUDA host's learner is on the GPU")
def test_a_replica_of_an_int8_learner_quantises_its_backbone_and_answers_as_the_learner(broker, tmp_path, replica):
    """The precision travels in the snapshot's model config: the replica builds the same int8 backbone."""
    cfg = learner_settings(broker, tmp_path)
    cfg = replace(cfg, learner=replace(cfg.learner, precision="int8"))
    snapshot, blob = learner_snapshot(cfg)
    follower = replica(replica_settings(cfg))
    send(cfg, to_records(blob, cfg.model_name, 1, cfg.kafka.snapshot_chunk_bytes))
    wait_for(lambda: follower.state.snapshot.version == 1, 60, "the int8 snapshot")
    served = follower.state.snapshot.model.backbone.blocks[0].mlp.fc1
    assert served._get_name() == "Int8Linear"
    images = color_images(torch.tensor([0, 1, 2, 3, 5]))
    assert torch.equal(follower.state.snapshot.probabilities(images), snapshot.probabilities(images))


# --- the wire format, no broker ---------------------------------------------------------------------------------
def test_parts_of_different_publications_never_mix_and_the_newest_complete_one_wins():
    origin = Origin("mepo", "frozen", ("a",), "0" * 64, None)
    blobs = [encode({"w": torch.full((300,), float(v))}, origin, v, v, (0,), 0.0) for v in (1, 2)]
    v1, v2 = (to_records(b, "mepo", v, 512) for v, b in zip((1, 2), blobs, strict=True))
    assembler = Assembler("mepo")
    assert [assembler.add(*r) for r in v1[:-1] + v2] == [None] * (len(v1) - 1 + len(v2) - 1) + [blobs[1]]
    assert assembler.add(*v1[-1]) is None  # v1 was dropped when the newer v2 completed
    assert assembler.add(b"other/0", b"x", [("model", b"other")]) is None  # another model's record
    republished = encode({"w": torch.zeros(300)}, origin, 2, 2, (0,), 1.0)  # version 2 again, other bytes
    mixed = [to_records(republished, "mepo", 2, 512)[0], *v2[1:]]
    assert hashlib.sha256(republished).hexdigest() != hashlib.sha256(blobs[1]).hexdigest()
    assert [assembler.add(*r) for r in mixed] == [None] * len(mixed)  # never a blob of both
    fresh, (key, value, headers) = Assembler("mepo"), v2[0]
    with pytest.raises(CorruptSnapshot, match="sha256"):
        for record in [(key, value[::-1], headers), *v2[1:]]:
            fresh.add(*record)


def test_a_replica_of_any_learner_config_keeps_its_broker_and_model_and_runs_as_mepo_replica():
    """``replica_of`` takes the replica's fields from a learner's config of any command (a demo's too)."""
    demo = DemoConfig(port=9001)
    replica = replica_of(demo, port=9002)
    assert isinstance(replica, ReplicaConfig)
    assert (replica.role, replica.command, replica.port) == ("replica", "replica", 9002)
    assert (replica.kafka, replica.backbone, replica.mepo) == (demo.kafka, demo.backbone, demo.mepo)
