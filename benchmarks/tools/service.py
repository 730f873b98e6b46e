"""Shared harness of the service benchmarks: a real broker, a stream in Kafka, ``mepo serve`` in its own process.

The service runs as users run it (``python -m mepo_stream.cli serve`` in a separate process, talking to an
embedded Tansu broker over TCP), and the benchmark talks to it over real HTTP. The bare-PyTorch references
(:func:`bare_learner`) are built here from the same library pieces (``mepo_stream.model.create_model`` and the
core ``OnlineLearner``), with the same configuration the service is given on its command line, on the same
device and under the same autocast dtype, so a ratio compares the same model doing the same arithmetic with
and without the service around it. :func:`seconds` is the one clock of every bare loop, and :func:`machine`
records where a result was measured.

Example (starts a broker and a service, so not a doctest)::

    with running_service(ServiceSpec(), work=Path("/tmp/bench")) as service:
        service.wait_learned(500)
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import torch

from benchmarks.tools.common import wait_until
from mepo_stream.backbone import BackboneConfig, device
from mepo_stream.cli import config_options
from mepo_stream.data import DataConfig, list_files
from mepo_stream.images import ImageLimits
from mepo_stream.kafka import KafkaConfig
from mepo_stream.learner import PAPER_RECIPE, LearnerConfig, OnlineLearner
from mepo_stream.methods.base import ContinualMethod
from mepo_stream.model import BundleParts, ModelConfig, create_model
from mepo_stream.novelty import NoveltyThreshold
from mepo_stream.precision import resolve_precision
from server.broker import EmbeddedBroker, free_port
from server.config import NoveltyConfig, ServeConfig
from server.learner.state import CHECKPOINT

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "mepo_stream.cli"]
PAPER_METHOD = "misa"
"""The paper's host method; ``PAPER_RECIPE`` holds the rest of its recipe (linear head, batch mask)."""


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
    """MePo bundle (backbone, Sigma_pre and/or prompts); null runs the host method alone."""
    method: str = ServeConfig.method
    """Host method."""
    learner: LearnerConfig = ServeConfig.learner
    """Online learning settings (classifier, steps, precision, ...), given to the service and the bare loop."""
    extra: tuple[str, ...] = ()
    """More ``mepo serve`` options, e.g. ("--protocol.eval_period", "0")."""

    @property
    def data(self) -> DataConfig:
        return DataConfig(self.dataset, train_per_class=self.train_per_class)

    @property
    def limits(self) -> ImageLimits:
        """The service's image limits, with the size it decodes to: the backbone's."""
        return ServeConfig.limits.at(self.img_size)

    def placement(self) -> tuple[torch.device, torch.dtype]:
        """The device and autocast dtype the service runs this spec with (the bare loops use the same)."""
        dev = device()
        return dev, resolve_precision(self.learner.precision, dev)

    def as_json(self) -> dict:
        """The spec as plain JSON values, for the result files."""
        return json.loads(json.dumps(asdict(self), default=str))


def paper_recipe(spec: ServiceSpec) -> ServiceSpec:
    """``spec`` with the paper's host and learner (MISA, SGD-trained linear head, ``online_iter`` Adam steps per
    batch): the expensive configuration. The precision stays the spec's."""
    return replace(spec, method=PAPER_METHOD, learner=replace(PAPER_RECIPE, precision=spec.learner.precision))


@dataclass
class ServiceUnderTest:
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
        """Resident set size of the service process."""
        return rss_bytes(self.process.pid)

    def wait_learned(self, n: int, timeout: float = 3600, poll: float = 0.25) -> dict:
        """Poll until ``n`` samples are learned, recording (time, samples, RSS, CPU seconds) in ``trace``."""

        def learned() -> dict | None:
            status = self.status()
            self.trace.append((time.monotonic(), status["samples_seen"], self.rss_bytes(),
                               cpu_seconds(self.process.pid)))
            return status if status["samples_seen"] >= n else None

        return wait_until(learned, f"{n} samples learned", timeout, poll, [self.process], transient=())


@contextmanager
def running_service(spec: ServiceSpec, work: Path, produce_first: bool = True) -> Iterator[ServiceUnderTest]:
    """Broker up, the whole stream produced (unless ``produce_first`` is false), ``mepo serve`` started and
    answering HTTP; everything stopped on exit. Logs go to ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    (work / CHECKPOINT).unlink(missing_ok=True)
    port = free_port()
    with EmbeddedBroker(log_path=work / "broker.log") as broker:
        if produce_first:
            produce(spec, broker.bootstrap)
        args = CLI + ["serve", "--kafka.bootstrap_servers", broker.bootstrap, "--data.dataset", spec.dataset,
                      "--data.train_per_class", str(spec.train_per_class), "--backbone.name", spec.model,
                      "--backbone.weights", spec.weights or "null", "--backbone.img_size", str(spec.img_size),
                      "--method", spec.method, *config_options(spec.learner, "--learner."),
                      "--checkpoint_dir", str(work), "--port", str(port),
                      *(["--mepo", str(spec.mepo)] if spec.mepo else []), *spec.extra]
        with open(work / "serve.log", "wb") as log:  # the child holds its own handle
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=url, timeout=120)
        try:
            wait_until(lambda: http.get("/livez") is not None, "mepo serve to answer HTTP", processes=[process])
            yield ServiceUnderTest(process, http, url, broker.bootstrap, spec)
        finally:
            http.close()
            process.terminate()
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()


def produce(spec: ServiceSpec, bootstrap: str) -> None:
    """The spec's Si-Blurry stream into the broker's default topic, as ``mepo produce`` sends it (its function, in
    this process: a process of its own would only add its start, before anything is timed)."""
    from producers.siblurry import produce as replay

    replay(spec.data, kafka=KafkaConfig(bootstrap_servers=bootstrap))


def bare_model(spec: ServiceSpec, n_classes: int) -> ContinualMethod:
    """The service's model (backbone, host method, every part of the MePo bundle, classifier, precision), built
    by the factory the service builds it with, on the device the service runs on."""
    cfg = ModelConfig(spec.method, ServeConfig.method_config, BackboneConfig(spec.model, spec.weights, spec.img_size),
                      BundleParts.of(spec.mepo), ServeConfig.alignment, spec.learner, ServeConfig.seed)
    return create_model(cfg, n_classes, device())


def bare_learner(spec: ServiceSpec, n_classes: int) -> OnlineLearner:
    """The service's learner without the service: its ``observe`` and ``predict`` on tensors already on the
    device are the bare PyTorch work of a mini-batch (the same autocast dtype, fused Adam on CUDA, and for a
    statistics classifier on a host without prompts no gradient step), minus Kafka, decoding and HTTP; its novelty
    threshold calibrated as the service's (``--novelty.*`` defaults)."""
    learner = OnlineLearner(bare_model(spec, n_classes), spec.learner)
    novelty = NoveltyConfig()
    learner.novelty_threshold = NoveltyThreshold(novelty.false_alarm, novelty.half_life)
    return learner


def synchronize(dev: torch.device) -> None:
    """Wait for the device's queued work (CUDA kernels run asynchronously; the CPU is always done)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def seconds(fn: Callable[[], object], dev: torch.device) -> float:
    """Wall seconds of one call of ``fn``, the device synchronised before both clock reads, so the clock
    measures the work and not just its launch."""
    synchronize(dev)
    start = time.perf_counter()
    fn()
    synchronize(dev)
    return time.perf_counter() - start


def timed(fn: Callable[[], object], repeats: int, dev: torch.device) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (each timed by ``seconds``), after one warm-up call."""
    fn()
    return [seconds(fn, dev) for _ in range(repeats)]


def cpu_seconds(pid: int | str = "self") -> float:
    """User and system CPU seconds a process has used, every thread (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14, 15 of stat


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process, this one by default (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found")


def quantiles(values: list[float]) -> dict[str, float]:
    """p50 and p99 in seconds."""
    q = statistics.quantiles(values, n=100) if len(values) >= 2 else [values[0] if values else float("nan")] * 99
    return {"p50_s": q[49], "p99_s": q[98]}


def device_name(dev: torch.device) -> str:
    """The GPU's name, or the CPU model from /proc/cpuinfo (``platform.processor()`` is often only "x86_64")."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.is_file() else []
    return models[0] if models else platform.processor() or platform.machine()


def machine(dev: torch.device, dtype: torch.dtype) -> dict:
    """Where a result was measured: the device and dtype both sides of its ratio ran with, and the software."""
    return {"device": dev.type, "device_name": device_name(dev), "dtype": str(dtype).removeprefix("torch."),
            "torch": torch.__version__, "cuda": torch.version.cuda, "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version()}


def write_result(result: dict, out: Path, dev: torch.device, dtype: torch.dtype) -> dict:
    """Write ``result`` with the machine it was measured on (``dev``, ``dtype``) and the time."""
    result = {**result, "machine": machine(dev, dtype),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result
