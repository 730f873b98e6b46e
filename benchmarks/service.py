"""Shared harness of the service benchmarks: a real broker, a stream in Kafka, ``mepo serve`` in its own process.

The service runs as users run it (``python -m mepo_stream.cli serve`` in a separate process, talking to an
embedded Tansu broker over TCP), and the benchmark talks to it over real HTTP. The bare-PyTorch references
(:func:`bare_method`, :func:`machine`) are built here from the same library pieces, so a ratio compares the
same model doing the same arithmetic with and without the service around it.

Example:
    >>> with running_service(ServiceSpec(), work=Path("/tmp/bench")) as service:  # doctest: +SKIP
    ...     service.wait_learned(500)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from mepo_stream.alignment import AlignmentConfig, FeatureAlignment
from mepo_stream.artifacts import load_sigma_pre, read_manifest
from mepo_stream.backbone import BackboneConfig, create_backbone
from mepo_stream.data import DataConfig, list_files
from mepo_stream.methods import MethodsConfig, create_method
from mepo_stream.methods.base import ContinualMethod
from server.broker import EmbeddedBroker, free_port

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "mepo_stream.cli"]


@dataclass(frozen=True)
class ServiceSpec:
    """What the service under test learns and with which model (the defaults of ``mepo serve`` elsewhere)."""

    dataset: str = "cifar10"
    """Bundled dataset or ImageFolder root streamed into Kafka."""
    train_per_class: int = 100
    """Stream images per class."""
    model: str = "vit_small_patch14_dinov2"
    """timm ViT name."""
    weights: str | None = "dinov2"
    """Backbone weights (dinov2, a file, or null for a random init; speed does not depend on the values)."""
    img_size: int = 84
    """Backbone resolution."""
    mepo: Path | None = None
    """MePo bundle (backbone and/or Sigma_pre); null runs the host method alone."""
    method: str = "misa"
    """Host method."""
    extra: tuple[str, ...] = ()
    """More ``mepo serve`` options, e.g. ("--cfg.eval_period", "0")."""

    @property
    def data(self) -> DataConfig:
        return DataConfig(self.dataset, train_per_class=self.train_per_class)

    def backbone(self) -> BackboneConfig:
        weights = self.weights
        if self.mepo is not None and "backbone.safetensors" in read_manifest(self.mepo)["files"]:
            weights = str(self.mepo)
        return BackboneConfig(self.model, weights, self.img_size)


@dataclass
class Service:
    process: subprocess.Popen
    http: httpx.Client
    url: str
    bootstrap: str
    spec: ServiceSpec
    trace: list[tuple[float, int, int]] = field(default_factory=list)  # (time, samples_seen, rss bytes)

    @property
    def stream_length(self) -> int:
        return len(list_files(self.spec.data, "train").files)

    def produce(self) -> None:
        """Replay the spec's Si-Blurry stream into the topic with ``mepo produce``."""
        produce(self.spec, self.bootstrap)

    def status(self) -> dict:
        return self.http.get("/v1/status").json()

    def rss_bytes(self) -> int:
        """Resident set size of the service process (Linux /proc)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("VmRSS not found")

    def wait_learned(self, n: int, timeout: float = 3600, poll: float = 0.25) -> dict:
        """Poll until ``n`` samples are learned, recording (time, samples, RSS) in ``trace``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mepo serve exited with code {self.process.returncode}")
            status = self.status()
            self.trace.append((time.monotonic(), status["samples_seen"], self.rss_bytes()))
            if status["samples_seen"] >= n:
                return status
            time.sleep(poll)
        raise TimeoutError(f"{n} samples not learned within {timeout} s")


@contextmanager
def running_service(spec: ServiceSpec, work: Path, produce_first: bool = True) -> Iterator[Service]:
    """Broker up, the whole stream produced (unless ``produce_first`` is false), ``mepo serve`` started and
    answering HTTP; everything stopped on exit. Logs go to ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "learner.pt").unlink(missing_ok=True)
    port = free_port()
    with EmbeddedBroker(log_path=work / "broker.log") as broker:
        if produce_first:
            produce(spec, broker.bootstrap)
        args = CLI + ["serve", "--cfg.kafka.bootstrap_servers", broker.bootstrap, "--cfg.data.dataset", spec.dataset,
                      "--cfg.data.train_per_class", str(spec.train_per_class), "--cfg.backbone.name", spec.model,
                      "--cfg.backbone.weights", spec.weights or "null", "--cfg.backbone.img_size", str(spec.img_size),
                      "--cfg.method", spec.method, "--cfg.checkpoint_dir", str(work), "--cfg.port", str(port),
                      *(["--cfg.mepo", str(spec.mepo)] if spec.mepo else []), *spec.extra]
        process = subprocess.Popen(args, stdout=open(work / "serve.log", "wb"), stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=url, timeout=120)
        try:
            _wait_http(http, process)
            yield Service(process, http, url, broker.bootstrap, spec)
        finally:
            http.close()
            process.terminate()
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()


def produce(spec: ServiceSpec, bootstrap: str) -> None:
    subprocess.run(CLI + ["produce", "--data.dataset", spec.dataset, "--data.train_per_class",
                          str(spec.train_per_class), "--kafka.bootstrap_servers", bootstrap],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def _wait_http(http: httpx.Client, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mepo serve exited with code {process.returncode}")
        try:
            http.get("/livez")
            return
        except httpx.TransportError:
            time.sleep(0.5)
    raise TimeoutError("mepo serve did not answer HTTP")


def bare_method(spec: ServiceSpec, n_classes: int) -> ContinualMethod:
    """The service's model (backbone, host method, Meta Cov alignment) built directly, for bare-loop references."""
    sigma = None
    if spec.mepo is not None and "sigma_pre.safetensors" in read_manifest(spec.mepo)["files"]:
        sigma = load_sigma_pre(spec.mepo)
    a = AlignmentConfig()  # the service's defaults
    align = None if sigma is None else FeatureAlignment(sigma, a.alpha, a.eps, a.momentum)
    return create_method(spec.method, create_backbone(spec.backbone()), n_classes, align, MethodsConfig())


def quantiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 in seconds."""
    q = statistics.quantiles(values, n=100) if len(values) >= 2 else [values[0] if values else float("nan")] * 99
    return {"p50_s": q[49], "p99_s": q[98]}


def machine() -> dict:
    """Where a result was measured."""
    return {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": "cuda" if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "python": platform.python_version()}


def write_result(result: dict, out: Path) -> dict:
    result = {**result, "machine": machine(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result
