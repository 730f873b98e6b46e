"""``mepo export`` against a running learner: ONNX Runtime's answers on a test set equal the server's own
(``/v1/predict``: probabilities within 1e-4, the same top-1), exported from the learner's snapshot and from its
checkpoint, and the Triton repository is what Triton reads (its config parsed by Triton's own protobuf schema); other
hosts and heads (prompts, NCM, the linear head, Meta Cov) export as the model predicts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from mepo_stream.checkpoint import LearnerCheckpoint, StreamPosition
from mepo_stream.cli import config_options
from mepo_stream.data import load_split
from mepo_stream.errors import ConfigError
from mepo_stream.export import ProbabilityGraph, onnx_model, onnx_package
from mepo_stream.learner import LearnerConfig, OnlineLearner
from mepo_stream.model import BundleParts, ModelConfig, create_model
from mepo_stream.sampler import SiBlurryConfig
from producers.siblurry import ReplayConfig, produce
from server.config import ServeConfig, model_config
from server.export import ExportConfig, export
from server.learner.state import CHECKPOINT
from tests.helpers import (
    DATA,
    NO_BROKER,
    ROOT,
    TINY,
    LiveServer,
    checkpoint_samples,
    code_blocks,
    color_images,
    png_bytes,
    settings,
    wait_for,
)

LEARNED = 64  # two checkpoints' worth (--checkpoint_every 32): the checkpoint then holds the served model
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def learner(broker, tmp_path_factory):
    """A learner in fp32 (ONNX Runtime runs fp32) serving 32-px images at the backbone's 32 px, idle once it has
    learned ``LEARNED`` samples and checkpointed them."""
    cfg = settings(broker, tmp_path_factory.mktemp("export"))
    cfg = replace(cfg, learner=replace(cfg.learner, precision="fp32"),
                  kafka=replace(cfg.kafka, snapshot_topic=f"snapshots-{cfg.kafka.group_id}"))
    with LiveServer(cfg) as http:
        produce(DATA, SiBlurryConfig(seed=1), cfg.kafka, ReplayConfig(limit=LEARNED))
        wait_for(lambda: checkpoint_samples(cfg) == LEARNED, what="the checkpoint of every sample")
        yield cfg, http


@pytest.fixture(scope="module")
def test_images() -> torch.Tensor:
    return load_split(replace(DATA, load_size=32), "test").images  # [N, 3, 32, 32] uint8, N = 50


def run_export(cfg: ServeConfig, **options) -> dict:
    """``mepo export`` as its own process, with the learner's options and ``options``; its summary line."""
    export_cfg = ExportConfig(**{f.name: getattr(cfg, f.name) for f in fields(ServeConfig)}, **options)
    done = subprocess.run([sys.executable, "-m", "mepo_stream.cli", "export", *config_options(export_cfg)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def server_answers(http: httpx.Client, images: torch.Tensor) -> tuple[list[dict[int, float]], list[float]]:
    """``/v1/predict``'s probability of every seen class (top_k = all of them), per image: label -> probability;
    and each image's novelty score."""
    rows, novelty = [], []
    for chunk in images.split(16):  # --max_files
        files = [("files", (f"{i}.png", png_bytes(image), "image/png")) for i, image in enumerate(chunk)]
        answer = http.post("/v1/predict", params={"top_k": 100}, files=files)
        assert answer.status_code == 200, answer.text
        rows += [{c["label"]: c["probability"] for c in p["top_k"]} for p in answer.json()["predictions"]]
        novelty += [p["novelty"] for p in answer.json()["predictions"]]
    return rows, novelty


def assert_onnx_answers_as_the_server(path: Path, http: httpx.Client, images: torch.Tensor) -> None:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    exposed = json.loads(session.get_modelmeta().custom_metadata_map["exposed"])
    probs, novelty = session.run(["probability", "novelty"], {"image": images.numpy()})  # [N, K], [N, 1]
    served, served_novelty = server_answers(http, images)
    np.testing.assert_allclose(novelty[:, 0], served_novelty, rtol=1e-4)  # the score travels with the model
    assert [set(row) for row in served] == [set(exposed)] * len(images)  # the same classes: the seen ones
    expected = np.array([[row[label] for label in exposed] for row in served])  # [N, K] in the ONNX output order
    assert np.abs(probs - expected).max() <= TOLERANCE
    assert [exposed[k] for k in probs.argmax(1)] == [max(row, key=row.get) for row in served]  # top-1


@pytest.mark.parametrize("source", ["snapshot", "checkpoint"])
def test_onnx_answers_as_the_server(learner, test_images, tmp_path, source):
    cfg, http = learner
    summary = run_export(cfg, format="onnx", source=source, out=tmp_path / "model.onnx")
    assert summary["model_version"] == http.get("/v1/status").json()["model_version"]
    model = onnx.load(tmp_path / "model.onnx")
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"  # a dynamic batch dimension
    assert_onnx_answers_as_the_server(tmp_path / "model.onnx", http, test_images)
    [example] = [b for b in code_blocks((ROOT / "docs" / "export.md").read_text(), "python") if "onnxruntime" in b]
    ran = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip().startswith("["), ran.stderr[-2000:]  # the docs' example runs


@pytest.mark.parametrize("source", ["snapshot", "checkpoint"])
def test_triton_repository_is_what_triton_reads_and_answers_as_the_server(learner, test_images, tmp_path, source):
    cfg, http = learner
    summary = run_export(cfg, format="triton", source=source, out=tmp_path / "repository")
    folder = tmp_path / "repository" / cfg.model_name
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == [
        "1", "1/model.onnx", "config.pbtxt", "labels.txt"]
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert (config.name, config.platform, config.max_batch_size) == (cfg.model_name, "onnxruntime_onnx", 64)
    [image], [probability, novelty] = config.input, config.output
    session = ort.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    [onnx_in], [onnx_out, onnx_novelty] = session.get_inputs(), session.get_outputs()
    assert (novelty.name, novelty.data_type, list(novelty.dims)) == (onnx_novelty.name, model_config_pb2.TYPE_FP32,
                                                                     [1])  # the score, [N, 1]
    assert (image.name, image.data_type, list(image.dims)) == (onnx_in.name, model_config_pb2.TYPE_UINT8,
                                                               onnx_in.shape[1:])
    assert (probability.name, probability.data_type) == (onnx_out.name, model_config_pb2.TYPE_FP32)
    labels = (folder / probability.label_filename).read_text().splitlines()
    names = json.loads(session.get_modelmeta().custom_metadata_map["labels"])
    assert labels == names and list(probability.dims) == [len(labels)] == [summary["classes"]]
    assert_onnx_answers_as_the_server(folder / "1" / "model.onnx", http, test_images)


def test_exports_without_a_model_say_what_to_do(broker, tmp_path):
    cfg = settings(broker, tmp_path)
    cfg = ExportConfig(**{f.name: getattr(cfg, f.name) for f in fields(ServeConfig)}, out=tmp_path / "m.onnx")
    with pytest.raises(ConfigError, match="no learner checkpoint at .*: pass the learner's --checkpoint_dir"):
        export(replace(cfg, source="checkpoint"))
    topic = replace(cfg.kafka, snapshot_topic=f"empty-{cfg.kafka.group_id}")
    with pytest.raises(ConfigError, match="no whole snapshot of model 'mepo' on empty-.* within 2 s"):
        export(replace(cfg, kafka=topic, wait_s=2.0))
    assert not (tmp_path / "m.onnx").exists()


def test_a_model_that_has_learned_nothing_is_not_exported():
    with pytest.raises(ValueError, match="has not learned any class yet"):
        ProbabilityGraph(create_model(ModelConfig(backbone=TINY), 3).inference_copy(), n_seen=0)


def test_without_onnx_export_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'mepo-stream\[export\]'"):
        onnx_package()


@pytest.mark.parametrize(("method", "classifier", "meta_cov"), [
    ("frozen", "ncm", True), ("misa", "linear", True), ("coda_p", "lda", False)])
def test_the_graph_is_the_models_prediction_path_for_other_hosts_and_heads(tmp_path, method, classifier, meta_cov):
    """Prompt hosts, NCM, the linear head and Meta Cov's running alignment export as the model predicts."""
    np.save(tmp_path / "cov.npy", np.eye(64) + 0.1)
    cfg = LearnerConfig(autoaugment=None, precision="fp32", classifier=classifier)
    model = create_model(ModelConfig(method=method, backbone=TINY, learner=cfg,
                                     mepo=BundleParts(cov=tmp_path / "cov.npy" if meta_cov else None)), 5)
    learner = OnlineLearner(model, cfg)
    for seed in range(3):
        images = color_images(torch.tensor([0, 1, 2, 3] * 4), seed=seed)  # [16, 3, 32, 32]
        learner.observe(images, torch.tensor([0, 1, 2, 3] * 4))
    served = model.inference_copy()
    graph = ProbabilityGraph(served, len(learner.exposed))
    session = ort.InferenceSession(onnx_model(graph, {}).SerializeToString(), providers=["CPUExecutionProvider"])
    test = color_images(torch.tensor([3, 2, 1, 0, 1]), seed=9)
    probs = session.run(["probability"], {"image": test.numpy()})[0]
    expected = served.predict_proba(test, len(learner.exposed)).numpy()
    assert np.abs(probs - expected).max() <= TOLERANCE and (probs.argmax(1) == expected.argmax(1)).all()


def test_a_bf16_learners_checkpoint_exports_its_weights_as_loaded_not_as_cast(tmp_path):
    """A bf16 learner stores its frozen backbone cast to bf16; the export builds the model in fp32 instead, so the
    graph holds the weights as loaded and answers as the fp32 model does."""
    cfg = ExportConfig(**{f.name: getattr(settings(NO_BROKER, tmp_path), f.name) for f in fields(ServeConfig)},
                       source="checkpoint", out=tmp_path / "model.onnx")
    bf16 = replace(cfg, learner=replace(cfg.learner, precision="bf16"))
    learner = OnlineLearner(create_model(model_config(bf16), 10), bf16.learner)
    noise = torch.Generator().manual_seed(0)  # noise, not colours: probabilities short of 0 and 1 show a difference
    for _ in range(3):
        learner.observe(torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=noise),
                        torch.tensor([0, 1, 2, 3] * 4))
    LearnerCheckpoint(learner.state_dict(), 3, 0.0, StreamPosition({}, {}), {}, None, torch.get_rng_state()).save(
        cfg.checkpoint_dir / CHECKPOINT)
    export(cfg)
    fp32 = create_model(model_config(replace(cfg, learner=replace(cfg.learner, precision="fp32"))), 10)
    fp32.load_trainable_state_dict(learner.state_dict()["method"])
    test = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8, generator=noise)
    expected = fp32.inference_copy().predict_proba(test, len(learner.exposed)).numpy()
    session = ort.InferenceSession(str(cfg.out), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(["probability"], {"image": test.numpy()})[0] - expected).max() <= TOLERANCE
