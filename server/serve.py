"""``mepo serve`` (the learner and the API in one process) and ``mepo demo`` (all of it on an embedded broker).
Both stop gracefully on SIGINT and SIGTERM (the learner learns what it holds and checkpoints) and exit with 0."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import replace

import uvicorn
from fastapi import FastAPI

from mepo_stream.cli import config_options
from mepo_stream.data import list_files
from mepo_stream.errors import ConfigError
from mepo_stream.kafka import ensure_topics
from mepo_stream.label_delay import label_schedule
from mepo_stream.records import stream_id
from mepo_stream.sampler import SiBlurryConfig
from mepo_stream.shutdown import Stopped, child_process
from server.allocator import keep_freed_memory
from server.broker import EmbeddedBroker, embedded_port
from server.children import Child, Supervised, Watch, stderr_tail
from server.config import DemoConfig, ReplicaConfig, ServeConfig
from server.learner.corrections import TABLE
from server.learner.service import Service
from server.learner.state import CHECKPOINT
from server.metrics import ServerMetrics
from server.replica.follower import ReplicaService
from server.serving import ServingModel
from server.web.app import create_app

log = logging.getLogger(__name__)
DEMO_LABELS_TOPIC = "mepo.labels"
"""The demo's labels topic when ``--replay.label_delay`` is given without ``--kafka.labels_topic``."""
DEMO_LABELS_RATE = 25.0
"""The demo's replay rate when its labels come later: a delay of 50 to 200 records is then 2 to 8 s, which the
demo's learner keeps up with on a CPU (docs/labels-later.md)."""


def start_role(settings: ServeConfig, metrics: ServerMetrics) -> ServingModel:
    """Start the learner, or a replica for a ``ReplicaConfig`` (the composition root: the web app knows no role)."""
    return (ReplicaService if settings.role == "replica" else Service).start(settings, metrics)


def serve(cfg: ServeConfig = ServeConfig()) -> None:
    """Learn the Kafka stream in one pass and serve predictions, status and metrics over HTTP (the options are
    ``ServeConfig``'s fields: ``mepo serve --kafka.bootstrap_servers k1:9092 --mepo BUNDLE --port 8000``)."""
    keep_freed_memory()
    uvicorn.run(create_app(cfg, start_role), host=cfg.host, port=cfg.port, log_level="info")


def replica(cfg: ReplicaConfig = ReplicaConfig()) -> None:
    """Serve a learner's snapshots: predictions, status and metrics over HTTP, the model following the snapshot
    topic (``mepo replica --kafka.bootstrap_servers k1:9092 --port 8001``)."""
    serve(cfg)


def _stop_when_learned(app: FastAPI, server: uvicorn.Server, producer: subprocess.Popen, expected: int) -> None:
    while not server.should_exit:
        service = getattr(app.state, "service", None)
        if producer.poll() == 0 and service is not None and service.reporter.settled(expected):
            server.should_exit = True
        time.sleep(1.0)


def producer_command(cfg: DemoConfig) -> list[str]:
    """``mepo produce`` of the demo's dataset into its broker, with the demo's data, replay and topics options."""
    kafka = ["--kafka.bootstrap_servers", cfg.kafka.bootstrap_servers, "--kafka.topic", cfg.kafka.topic,
             "--kafka.labels_topic", cfg.kafka.labels_topic or "null"]
    return [sys.executable, "-m", "mepo_stream.cli", "produce", *config_options(cfg.data, "--data."), *kafka,
            *config_options(cfg.replay, "--replay.")]


def expected_samples(cfg: DemoConfig) -> int:
    """The samples the demo's stream teaches: every image, or those whose later label comes (as the producer draws)."""
    files = len(list_files(cfg.data, "train").files)
    n = files if cfg.replay.limit is None else min(files, cfg.replay.limit)
    if cfg.replay.label_delay is None:
        return n
    schedule = label_schedule(n, cfg.replay.label_delay, cfg.replay.label_delay_max, cfg.replay.label_loss,
                              SiBlurryConfig().seed)  # the producer's stream seed (the demo passes none)
    return sum(due is not None for due in schedule)


def _summary(app: FastAPI, wall_time: float) -> None:
    if (service := getattr(app.state, "service", None)) is not None:
        status = service.status()
        join = status.label_join
        later = {} if join is None else {"delayed_accuracy": join.delayed_accuracy,
                                         "images_waiting": join.images.waiting}
        summary = ({"samples_seen": status.samples_seen, "classes_seen": status.classes_seen,
                    "a_last": status.a_last, "dead_lettered": status.dead_lettered,
                    "prequential": status.prequential_accuracy.cumulative} | later
                   | {"a_auc": status.anytime_accuracy.a_auc, "evaluations": status.anytime_accuracy.evaluations,
                      "wall_time_s": round(wall_time, 1)})
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))


def demo(cfg: DemoConfig = DemoConfig()) -> None:
    """Start a local broker, replay a Si-Blurry stream of bundled data (or of your own ImageFolder) into it, and serve
    the learner (the options are ``DemoConfig``'s). A child that stops before its work is done is named in the log,
    ``/v1/status`` and ``/readyz``, and the demo exits non-zero (at once with --until_done, else when stopped)."""
    cfg = labels_later(cfg)
    broker = _broker(cfg)
    print(data_line(cfg), flush=True)
    cfg.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    (cfg.checkpoint_dir / CHECKPOINT).unlink(missing_ok=True)  # the in-memory broker starts empty too
    shutil.rmtree(cfg.checkpoint_dir / TABLE, ignore_errors=True)  # and the sample table with the checkpoint
    with broker or nullcontext():
        if broker is not None:
            cfg = replace(cfg, kafka=replace(cfg.kafka, bootstrap_servers=broker.bootstrap))
        ensure_topics(cfg.kafka)
        # stopped on every way out, as the broker is; its stderr is copied to ours, its last line kept
        with child_process(producer_command(cfg), stderr=subprocess.PIPE) as producer:
            children = [Child("the producer (mepo produce)", producer, True, stderr_tail(producer).last)]
            if broker is not None and broker.process is not None:
                children.append(Child("the embedded broker (tansu)", broker.process, False, broker.last_words))
            app, wall_time, failure = _serve_demo(cfg, children)
        _summary(app, wall_time)
    if failure is not None:
        raise SystemExit(f"mepo demo: {failure}")


def _broker(cfg: DemoConfig) -> EmbeddedBroker | None:
    """The embedded broker (not started) on --kafka.bootstrap_servers' port; None with --embedded_broker false."""
    if cfg.embedded_broker:
        return EmbeddedBroker(embedded_port(cfg.kafka.bootstrap_servers), cfg.checkpoint_dir.parent / "broker.log")
    if cfg.kafka.bootstrap_servers.endswith(":0"):
        raise ConfigError("--embedded_broker false streams through a cluster: give its --kafka.bootstrap_servers")
    return None


def data_line(cfg: DemoConfig) -> str:
    """One line at start: what the demo streams and tests on, what caps it, and its images' ids' stream id."""
    train, test = len(list_files(cfg.data, "train").files), len(list_files(cfg.data, "test").files)
    caps = [f"--data.{split}_per_class {n}" for split, n in (("train", cfg.data.train_per_class),
                                                             ("test", cfg.data.test_per_class)) if n is not None]
    lift = f" (capped by {' '.join(caps)}: null streams all)" if caps else " (all of it)"
    return (f"streaming {train} training images of {cfg.data.dataset}, testing on {test}{lift}; "
            f"image ids: {stream_id(cfg.data, SiBlurryConfig())}/<file>")


def labels_later(cfg: DemoConfig) -> DemoConfig:
    """``--replay.label_delay`` alone gives the demo a labels topic and a replay pace: unthrottled, the learner would
    read every image before the first label, and a delay in records means something only at a pace."""
    if cfg.replay.label_delay is None:
        return cfg
    if cfg.kafka.labels_topic is None:
        cfg = replace(cfg, kafka=replace(cfg.kafka, labels_topic=DEMO_LABELS_TOPIC))
    if cfg.replay.rate is None:
        log.info("labels later: replaying at %g records/s (--replay.rate sets it)", DEMO_LABELS_RATE)
        cfg = replace(cfg, replay=replace(cfg.replay, rate=DEMO_LABELS_RATE))
    return cfg


def _serve_demo(cfg: DemoConfig, children: list[Child]) -> tuple[FastAPI, float, str | None]:
    """Serve until stopped (or done): the app, the seconds served, and the failed child's error."""
    keep_freed_memory()

    def failed(failure: str) -> None:
        if cfg.until_done:  # done it will never be: exit now, non-zero; else serve on, not ready, naming why
            server.should_exit = True

    watch = Watch(children, stopping=lambda: server.should_exit, on_failure=failed)
    app = create_app(cfg, lambda settings, metrics: _supervised(settings, metrics, watch))
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning"))
    if cfg.until_done:
        expected = expected_samples(cfg)
        threading.Thread(target=_stop_when_learned, args=(app, server, children[0].process, expected),
                         daemon=True).start()
    url = f"http://127.0.0.1:{cfg.port}"
    print(f"live page: {url}/", flush=True)
    print(f"Kafka {cfg.kafka.bootstrap_servers}; API docs {url}/docs ; status {url}/v1/status ; "
          f"metrics {url}/metrics", flush=True)
    start = time.monotonic()
    watch.start()
    try:
        server.run()
    except Stopped as stop:  # uvicorn raises a stop signal again after its graceful shutdown: a normal end
        log.info("stopped by %s", stop.name)
    finally:
        watch.stop()
    return app, time.monotonic() - start, watch.failure


def _supervised(settings: ServeConfig, metrics: ServerMetrics, watch: Watch) -> Supervised:
    service = Supervised.start(settings, metrics)
    assert isinstance(service, Supervised)  # ``Service.start`` builds its own class
    service.watch = watch
    return service
