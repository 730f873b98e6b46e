"""Test helpers: tiny model and data settings, the service's config as ``mepo serve`` flags, a live HTTP server,
polled waits, and the learner checkpoint. Tests import from here; ``conftest.py`` holds only fixtures."""

from __future__ import annotations

import io
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import httpx
import numpy as np
import torch
import uvicorn
from PIL import Image

from mepo_stream.alignment import AlignmentConfig
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.backbone import BackboneConfig
from mepo_stream.checkpoint import load_checkpoint
from mepo_stream.cli import config_options
from mepo_stream.data import DataConfig, list_files
from mepo_stream.images import ImageLimits
from mepo_stream.kafka import KafkaConfig
from mepo_stream.learner import LearnerConfig, OnlineLearner
from mepo_stream.model import BundleParts, ModelConfig, create_model
from mepo_stream.sampler import SiBlurryConfig, si_blurry_stream
from producers.siblurry import stream_id
from server.broker import free_port
from server.config import ServeConfig
from server.consumer import LoopHealth
from server.learner.state import CHECKPOINT
from server.serve import start_role
from server.web.app import create_app

T = TypeVar("T")
ROOT = Path(__file__).parents[1]
TINY = BackboneConfig(name="test_vit", weights=None, img_size=32)
DATA = DataConfig(dataset="cifar10", train_per_class=20, test_per_class=5)  # a 200-image stream
NO_BROKER = SimpleNamespace(bootstrap="127.0.0.1:9")
"""A broker address nothing answers at, for ``settings`` of a state built without Kafka."""


def png_bytes(image: torch.Tensor) -> bytes:
    """A uint8 image [3, H, W] as a PNG file: lossless, so a server decodes exactly these pixels."""
    buf = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buf, format="PNG")
    return buf.getvalue()


def color_images(labels: torch.Tensor, size: int = 32, noise: int = 40, seed: int | None = None) -> torch.Tensor:
    """uint8 images [B, 3, size, size] whose colour encodes the label: an easy, learnable stream (the noise is
    drawn from ``seed``, by default the labels' sum)."""
    g = torch.Generator().manual_seed(int(labels.sum()) if seed is None else seed)
    palette = torch.tensor([[230, 30, 30], [30, 230, 30], [30, 30, 230], [230, 230, 30], [30, 230, 230],
                            [230, 30, 230], [128, 128, 128], [250, 250, 250]])
    base = palette[labels][:, :, None, None].expand(-1, -1, size, size).float()
    return (base + torch.randint(-noise, noise + 1, base.shape, generator=g)).clamp(0, 255).to(torch.uint8)


def color_folder(root: Path, n_classes: int = 4, per_split: dict[str, int] | None = None) -> Path:
    """An ImageFolder (``train/`` and ``test/``, PNG) of ``color_images``: a dataset any backbone separates."""
    for seed, (split, n) in enumerate((per_split or {"train": 16, "test": 8}).items()):
        labels = torch.arange(n_classes).repeat_interleave(n)
        for i, (img, y) in enumerate(zip(color_images(labels, seed=seed), labels, strict=True)):
            (root / split / f"c{y}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(img.permute(1, 2, 0).numpy()).save(root / split / f"c{y}" / f"{i}.png")
    return root


# --- waiting ----------------------------------------------------------------------------------------------------
RUNNING = LoopHealth(running=True, kafka_connected=True, paused=False, consumer_lag={}, error=None)
"""A learning thread's health with nothing to report, for a learner's status read without its thread."""


def wait_for(predicate: Callable[[], T], timeout: float = 180.0, what: str = "condition",
             ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``predicate`` until it returns something truthy and return that; fail after ``timeout`` seconds
    with what was awaited and the last value seen. Exceptions of the types in ``ignore`` count as not yet."""
    deadline, value = time.monotonic() + timeout, None
    while True:
        try:
            value = predicate()
        except ignore as e:
            value = e
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {value!r})")
        time.sleep(0.1)


def holds_for(predicate: Callable[[], Any], seconds: float, what: str) -> int:
    """Assert that ``predicate`` stays truthy on every poll for ``seconds``; returns how many polls held."""
    deadline, polls = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        assert predicate(), f"{what} stopped holding after {polls} polls"
        polls += 1
        time.sleep(0.25)
    return polls


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each of a process's threads (``/proc/<pid>/task/*/stat``)."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # the thread ended while listed
            continue
    return states


@contextmanager
def stalled(process: subprocess.Popen) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the block, and continued after it. ``kill`` returns before every thread has
    stopped: on a busy machine a thread waiting for a core answers requests for tens of milliseconds more, so the
    block starts only when each thread is seen stopped."""
    process.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: all(s in "Tt" for s in thread_states(process.pid)), 10, "every thread stopped")
        yield
    finally:
        process.send_signal(signal.SIGCONT)


# --- the service's configuration --------------------------------------------------------------------------------
def settings(broker, tmp_path: Path, **kw) -> ServeConfig:
    """A ServeConfig for the tiny ViT on fresh topics and consumer group of ``broker``, on a free port."""
    name = uuid.uuid4().hex[:8]
    kafka = KafkaConfig(bootstrap_servers=broker.bootstrap, topic=f"images-{name}", dead_letter_topic=f"dlq-{name}",
                        group_id=f"learner-{name}")
    cfg = ServeConfig(kafka=kafka, data=DATA, backbone=TINY, checkpoint_dir=tmp_path / "ckpt",
                      protocol=ProtocolConfig(eval_period=64),
                      checkpoint_every=32, checkpoint_min_interval_s=0.0,  # crash points every few samples
                      limits=ImageLimits(size=32), admin_token="s3cret", port=free_port(),
                      learner=LearnerConfig(batch_size=16, online_iter=1, autoaugment=None, samples_per_slot=64))
    return replace(cfg, **kw)


def serve_args(cfg: ServeConfig) -> list[str]:
    """``cfg`` as ``mepo serve`` flags (``mepo_stream.cli.config_options``, the one place that knows the option
    layout); ``tests/test_cli.py`` parses the flags back and checks that the command gets exactly ``cfg``."""
    return config_options(cfg)


class ServeProcess(subprocess.Popen):
    """``mepo serve`` with ``cfg`` as its own process (what a crash test can kill), output appended to ``log``."""

    alive: set[ServeProcess] = set()
    """Every one started and not yet reaped: ``reap_all`` kills what a test left running (a wait that failed)."""

    def __init__(self, cfg: ServeConfig, log: Path):
        self.log = log
        ServeProcess.alive.add(self)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(log, "ab") as out:
            super().__init__([sys.executable, "-m", "mepo_stream.cli", cfg.command, *serve_args(cfg)], stdout=out,
                             stderr=subprocess.STDOUT, env=env)

    def running(self) -> bool:
        """True while it runs; once it has exited, fail at once with the end of its log (in a ``wait_for``
        predicate this stops the wait instead of timing out on a process that is gone)."""
        if self.poll() is not None:
            raise AssertionError(f"mepo serve exited with {self.returncode}:\n{self.log.read_text()[-3000:]}")
        return True

    @classmethod
    def reap_all(cls) -> None:
        while cls.alive:
            process = cls.alive.pop()
            if process.poll() is None:
                process.kill()
                process.wait()


serve_process = ServeProcess


def http_client(cfg: ServeConfig, timeout: float = 10) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{cfg.port}", timeout=timeout)


class LiveServer:
    """uvicorn serving the app on a free port in a background thread."""

    def __init__(self, cfg: ServeConfig):
        self.port = free_port()
        self.app = create_app(cfg, start_role)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> httpx.Client:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 60, "the HTTP server to start")
        assert self.server.started, "the HTTP server thread exited before it started"
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        return self.client

    def __exit__(self, *exc) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the HTTP server (and the service it stops) did not stop within 60 s"


# --- the learner checkpoint -------------------------------------------------------------------------------------
def checkpoint(cfg: ServeConfig) -> dict | None:
    """The learner checkpoint on disk (None before the first one)."""
    path = cfg.checkpoint_dir / CHECKPOINT
    return load_checkpoint(path) if path.is_file() else None


def checkpoint_samples(cfg: ServeConfig) -> int:
    state = checkpoint(cfg)
    return int(state["learner"]["samples_seen"]) if state else 0


def stream_handled(cfg: ServeConfig, records: int) -> dict | None:
    """The checkpoint once all ``records`` of the (one-partition) topic are handled, else None: nothing is left
    to learn, so nothing can change after it."""
    state = checkpoint(cfg)
    return state if state and state["offsets"].get(f"{cfg.kafka.topic}:0") == records else None


def assert_learned_exactly_once(state: dict, data: DataConfig, stream: SiBlurryConfig, replays: int = 0) -> None:
    """A checkpoint learned every sample of the stream exactly once: its learned ids are the stream's, it took
    as many learning steps' samples as there are ids (a sample learned twice would add one), and it skipped
    exactly ``replays`` records as replays (a clean stream has none: an offset rolled back further than the
    model would show up here, as skipped replays, instead of being silently absorbed)."""
    listing = list_files(data, "train")
    order = si_blurry_stream(listing.targets, stream.n_tasks, stream.n, stream.m, stream.seed).order
    learned = state["learned"][stream_id(data, stream)].tolist()
    assert learned == sorted(order), f"{len(set(order) - set(learned))} samples never learned"
    assert int(state["learner"]["samples_seen"]) == len(order), "a sample was learned twice"
    assert int(state["replays_skipped"]) == replays


def assert_same_learner_state(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Two checkpoints' learners are the same: labels, sample counts, and every trainable tensor within float
    tolerance (the classifier's statistics included)."""
    la, lb = a["learner"], b["learner"]
    assert la["exposed"] == lb["exposed"] and la["samples_seen"] == lb["samples_seen"]
    assert la["method"].keys() == lb["method"].keys()
    for key, ta in la["method"].items():
        tb = lb["method"][key]
        assert ta.shape == tb.shape and ta.dtype == tb.dtype, key
        assert torch.allclose(ta, tb, rtol=rtol, atol=atol), (key, (ta - tb).abs().max().item())


def learner_of(method: str, cfg: LearnerConfig, n_classes: int = 4, cov: Path | None = None,
               alignment: AlignmentConfig = AlignmentConfig(), backbone: BackboneConfig = TINY) -> OnlineLearner:
    """A learner around the model the factory builds (CPU, seed 0: the same model every call), with Meta Cov to
    the Sigma_pre in ``cov`` (a ``.npy``: ``sigma_file``) when given."""
    model = ModelConfig(method, backbone=backbone, mepo=BundleParts(cov=cov), alignment=alignment, learner=cfg)
    return OnlineLearner(create_model(model, n_classes), cfg)


def sigma_file(folder: Path, sigma: torch.Tensor) -> Path:
    """Sigma_pre [D, D] as a MePo release ``cov_*.npy`` in ``folder``, for ``BundleParts(cov=...)``."""
    path = folder / "cov_test.npy"
    np.save(path, sigma.double().numpy())
    return path


# --- the docs' examples -----------------------------------------------------------------------------------------
def code_blocks(markdown: str, lang: str) -> list[str]:
    """The fenced code blocks of ``lang`` in a Markdown text, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", markdown, flags=re.M | re.S)


def mepo_commands(markdown: str) -> list[list[str]]:
    """Every ``mepo`` command line of a page's bash blocks as its arguments (continuation lines joined, comments
    dropped; ``.venv/bin/mepo``, ``mepo`` and ``-m mepo_stream.cli`` alike)."""
    commands = []
    for block in code_blocks(markdown, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            starts = [i for i, w in enumerate(words) if w.endswith("/mepo") or w in ("mepo", "mepo_stream.cli")]
            if starts and not (words[0] in ("docker", "make", "curl") or "compose" in words):
                commands.append(words[starts[0] + 1:])
    return commands


# --- the Hugging Face cache -------------------------------------------------------------------------------------
def fill_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """Put ``files`` in a Hugging Face hub cache (``$HF_HOME/hub``) as a download of ``repo_id`` would have left
    them (``models--org--name/refs/main`` naming a snapshot folder that holds the files); returns that folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (snapshot / name).write_bytes(data)
    return snapshot
