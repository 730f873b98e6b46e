"""Prediction replicas: a replica's latency while the learner trains, and the learner's throughput while clients
hit the replica instead of the learner.

The learner (``mepo serve``) and one replica (``mepo replica``) run as processes pinned to different
cores with ``os.sched_setaffinity``, one torch thread each: the learner and the broker on the first core, the
replica on the second. This process (the HTTP clients) runs on the replica's core: what clients cost lands where
it would with clients on other machines, away from the learner. Three runs, each on a fresh broker with the
whole stream already in Kafka:

* ``latency``: the replica, then the learner, start; from the moment both answer HTTP, one client posts
  single-image ``POST /v1/predict`` to the replica back to back until the learner has learned the stream (503s
  until the replica has a snapshot with classes are counted apart, not timed). The bare reference
  is the snapshot's forward of the same decoded image (``Snapshot.probabilities``) on the replica's core with one
  thread and nothing else running there (timed before the runs): the issue's ratio.
* ``clients``: the same with ``clients`` concurrent clients hammering the replica. The learner's samples/s here
  against the ``latency`` run's is the throughput ratio (the issue's goal: a drop of at most 30%).
* ``no_publishing``: the learner alone with ``--kafka.snapshot_topic null``: its samples/s against the ``latency``
  run's is what publishing snapshots (and a replica reading them) costs the learner.

Learner rates come from ``/v1/status`` polled every 0.25 s, from the last poll before 10% of the stream was
learned to the end of the stream. Any-time evaluation is off (``--protocol.eval_period 0``). At smoke sizes
(a tiny model learns a short stream in a second) the clients go on until two requests were answered.

Usage:
    python -m benchmarks.rows.replica_latency --spec.train_per_class 100
Writes ``benchmarks/results/replica_latency.json``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import torch

from benchmarks.rows.predict_latency import bare_predictor, sample_jpeg
from benchmarks.tools.common import wait_until
from benchmarks.tools.service import CLI as MEPO
from benchmarks.tools.service import ROOT, ServiceSpec, produce, quantiles, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.backbone import BackboneConfig
from mepo_stream.cli import config_options
from mepo_stream.data import list_files
from mepo_stream.images import decode_image
from mepo_stream.kafka import KafkaConfig
from server.broker import EmbeddedBroker, free_port
from server.config import ServeConfig, replica_of

POLL_S = 0.25
READY_ERRORS = (httpx.TransportError, KeyError, ValueError)
"""What a service answers before it is ready: no connection, or a status without its fields yet."""


def pin(pid: int, cores: set[int]) -> None:
    """Pin every thread of process ``pid`` (a running broker has many) to ``cores``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), cores)


def serve_configs(spec: ServiceSpec, bootstrap: str, work: Path) -> tuple[ServeConfig, ServeConfig]:
    """The learner's and the replica's configuration: the same model, flags and snapshot topic."""
    learner = ServeConfig(kafka=KafkaConfig(bootstrap_servers=bootstrap), data=spec.data,
                          backbone=BackboneConfig(spec.model, spec.weights, spec.img_size), mepo=spec.mepo,
                          method=spec.method, learner=spec.learner, protocol=ProtocolConfig(eval_period=0),
                          checkpoint_dir=work / "learner", port=free_port())
    return learner, replica_of(learner, port=free_port())


def start(cfg: ServeConfig, core: int, log: Path) -> subprocess.Popen:
    """``mepo serve`` (or ``mepo replica``) with ``cfg`` on ``core``, one torch thread, from its first instruction."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*MEPO, cfg.command, *config_options(cfg)], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))


@dataclass
class Cluster:
    learner: str  # base URLs
    replica: str | None
    stream: int  # samples in the stream


@contextmanager
def cluster(spec: ServiceSpec, work: Path, cores: tuple[int, int], replica: bool = True) -> Iterator[Cluster]:
    """A fresh broker holding the whole stream, then the replica and the learner (in that order, so the replica
    follows from the learner's first snapshot); yields once both answer HTTP; stops them on exit."""
    work.mkdir(parents=True, exist_ok=True)
    with EmbeddedBroker(log_path=work / "broker.log") as broker:
        pin(broker.process.pid, {cores[0]})
        produce(spec, broker.bootstrap)
        learner, follower = serve_configs(spec, broker.bootstrap, work)
        if not replica:
            learner = replace(learner, kafka=replace(learner.kafka, snapshot_topic=None))
        urls = Cluster(f"http://127.0.0.1:{learner.port}", f"http://127.0.0.1:{follower.port}" if replica else None,
                       len(list_files(spec.data, "train").files))
        procs = []
        try:
            if replica:
                procs.append(start(follower, cores[1], work / "replica.log"))
                wait_until(lambda: _status(urls.replica), "the replica to answer", poll=POLL_S, processes=procs,
                           transient=READY_ERRORS)
            procs.append(start(learner, cores[0], work / "learner.log"))
            wait_until(lambda: _status(urls.learner), "the learner to answer", poll=POLL_S, processes=procs,
                       transient=READY_ERRORS)
            yield urls
        finally:
            for p in procs:
                p.terminate()
                p.wait(120)


def _status(url: str) -> dict:
    return httpx.get(f"{url}/v1/status", timeout=30).json()


async def load_while_learning(urls: Cluster, jpeg: bytes, clients: int, min_answers: int = 2) -> dict:
    """``clients`` clients posting one image at a time to the replica until the learner has learned the stream
    (and ``min_answers`` were answered); the learner's status is traced meanwhile. Latencies of the answered
    requests, 503s before the replica had classes, other failures, and the versions that answered."""
    latencies, versions, trace, failed = [], set(), [], {"not_ready": 0, "other": 0}
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients + 1)) as http:

        async def client() -> None:
            while not done.is_set():
                start = time.perf_counter()
                r = await http.post(f"{urls.replica}/v1/predict", content=jpeg, headers={"content-type": "image/jpeg"})
                if r.status_code == 200:
                    latencies.append(time.perf_counter() - start)
                    versions.add(r.json()["model_version"])
                else:
                    failed["not_ready" if r.status_code == 503 and not latencies else "other"] += 1
                    await asyncio.sleep(0.05)

        async def monitor() -> None:
            while not done.is_set():
                trace.append((time.monotonic(), (await http.get(f"{urls.learner}/v1/status")).json()["samples_seen"]))
                if trace[-1][1] >= urls.stream and len(latencies) >= min_answers:
                    done.set()
                await asyncio.sleep(POLL_S)

        await asyncio.gather(monitor(), *(client() for _ in range(clients)))
    return {"latencies": latencies, "failed": failed, "versions": sorted(versions), "trace": trace}


def learner_rate(trace: list[tuple[float, int]], stream: int) -> dict:
    """Samples/s from the last point before 10% of the stream was learned (the first point, if the learner was past
    10% when the load began) to the first at its end."""
    t0, s0 = ([p for p in trace if p[1] < 0.1 * stream] or trace)[-1 if trace[0][1] < 0.1 * stream else 0]
    t1, s1 = next(p for p in trace if p[1] >= stream)
    return {"samples_per_s": (s1 - s0) / (t1 - t0), "between_samples": [s0, s1], "seconds": t1 - t0}


def trace_alone(urls: Cluster) -> list[tuple[float, int]]:
    """The learner's status trace until it has learned the stream, with no client at all."""
    trace = []
    while not trace or trace[-1][1] < urls.stream:
        trace.append((time.monotonic(), _status(urls.learner)["samples_seen"]))
        time.sleep(POLL_S)
    return trace


def publishing_cost(url: str) -> dict:
    """The learner's publisher, from its /metrics: snapshots published, mean publish time, last size."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
             if line.startswith(("mepo_snapshot_publish_duration_seconds_sum", "mepo_snapshot_publish_duration_"
                                 "seconds_count", "mepo_snapshot_bytes", "mepo_snapshots_published_total"))}
    count = value.get("mepo_snapshot_publish_duration_seconds_count", 0.0)
    return {"published": value.get("mepo_snapshots_published_total"), "bytes": value.get("mepo_snapshot_bytes"),
            "mean_publish_s": value["mepo_snapshot_publish_duration_seconds_sum"] / count if count else None}


def bare_latency(spec: ServiceSpec, repeats: int) -> dict:
    """p50/p99 of the snapshot's forward of one image, in this process (on the replica's core, one thread)."""
    forward = bare_predictor(spec, len(list_files(spec.data, "train").classes))
    image = decode_image(sample_jpeg(spec), spec.limits)[None]
    forward(image)  # warm-up
    return quantiles([forward(image) for _ in range(repeats)])


def main(spec: ServiceSpec = ServiceSpec(), clients: int = 16, bare_repeats: int = 100,
         work: Path = Path("benchmarks/results/work/replica"),
         out: Path = Path("benchmarks/results/replica_latency.json")) -> dict:
    """Measure a replica's latency while the learner trains and the learner's throughput under client load.

    Args:
        spec: Stream (it should last long enough for a few hundred requests), model and MePo bundle.
        clients: Concurrent clients of the throughput run.
        bare_repeats: Timed forwards of the bare reference.
        work: Broker and service logs and the learner's checkpoint.
        out: JSON result path.
    """
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        raise RuntimeError("the replica benchmark pins learner and replica to two different cores; this process "
                           f"may use only {available}")
    cores = (available[0], available[1])
    os.sched_setaffinity(0, {cores[1]})  # the clients and the bare reference share the replica's core
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bare, jpeg = bare_latency(spec, bare_repeats), sample_jpeg(spec)
    runs = {}
    for name, n_clients in (("latency", 1), ("clients", clients)):
        with cluster(spec, work / name, cores) as urls:
            load = asyncio.run(load_while_learning(urls, jpeg, n_clients))
            runs[name] = {**learner_rate(load["trace"], urls.stream), "clients": n_clients,
                          "answered": len(load["latencies"]), **load["failed"],
                          "versions_answered": load["versions"], "http": quantiles(load["latencies"]),
                          "publishing": publishing_cost(urls.learner)}
    with cluster(spec, work / "no_publishing", cores, replica=False) as urls:
        runs["no_publishing"] = learner_rate(trace_alone(urls), urls.stream)
    return write_result(summary(spec, cores, bare, runs), out, *spec.placement())


def summary(spec: ServiceSpec, cores: tuple[int, int], bare: dict, runs: dict) -> dict:
    """The result: the runs, and the ratios the benchmark table shows."""
    http, alone = runs["latency"]["http"], runs["latency"]["samples_per_s"]
    return {"benchmark": "replica_latency", "spec": spec.as_json(), "cores": {"learner_and_broker": cores[0],
            "replica_and_clients": cores[1]}, "torch_threads_per_process": 1, "bare_forward": bare, **runs,
            "ratio_p50": http["p50_s"] / bare["p50_s"], "ratio_p99": http["p99_s"] / bare["p99_s"],
            "throughput_ratio": runs["clients"]["samples_per_s"] / alone,
            "publishing_ratio": alone / runs["no_publishing"]["samples_per_s"]}


def table_rows(r: dict) -> list[Row]:
    """The table's rows: the replica's latency while the learner trains, and the learner's rate with clients."""
    rows: list[Row] = []
    for q, goal in (("p50", 1.3), ("p99", 3.0)):
        ratio = r[f"ratio_{q}"]
        rows.append((f"Predict latency {q} on a replica while the learner trains (own cores; bare: the replica's core)",
                     fmt(r["latency"]["http"][f"{q}_s"], "ms"), fmt(r["bare_forward"][f"{q}_s"], "ms"), ratio,
                     f"≤ {goal}", ratio <= goal))
    with_clients, ratio = r["clients"], r["throughput_ratio"]
    rows.append((f"Learner throughput with {with_clients['clients']} clients on a replica, ÷ without (samples/s)",
                 fmt(with_clients["samples_per_s"], "/s"), fmt(r["latency"]["samples_per_s"], "/s") + " (1 client)",
                 ratio, "≥ 0.70", ratio >= 0.7))
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
