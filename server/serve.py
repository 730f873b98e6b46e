"""``mepo serve`` (the learner and the API in one process) and ``mepo demo`` (all of it on an embedded broker)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from mepo_stream.data import DataConfig, list_files
from mepo_stream.kafka import KafkaConfig, ensure_topics
from server.app import create_app
from server.broker import EmbeddedBroker
from server.config import ServeConfig
from server.state import CHECKPOINT

log = logging.getLogger(__name__)


def serve(cfg: ServeConfig = ServeConfig()) -> None:
    """Learn the Kafka stream in one pass and serve predictions, status and metrics over HTTP.

    Args:
        cfg: Service settings (--cfg.kafka.bootstrap_servers, --cfg.mepo BUNDLE, --cfg.port, ...).
    """
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="info")


def _stop_when_learned(app: FastAPI, server: uvicorn.Server, producer: subprocess.Popen, expected: int) -> None:
    """Ask the server to exit once the producer is done and the learner has learned and evaluated it all."""
    while not server.should_exit:
        service = getattr(app.state, "service", None)
        if producer.poll() is not None and service is not None:
            state = service.state
            if state.learner.samples_seen >= expected and not state.idle_evaluation_due:
                server.should_exit = True
        time.sleep(1.0)


def demo(
    dataset: str = "cifar10",
    train_per_class: int = 50,
    test_per_class: int = 20,
    mepo: Path | None = None,
    img_size: int = 84,
    port: int = 8000,
    rate: float | None = None,
    until_done: bool = False,
    bootstrap_servers: str | None = None,
    out: Path = Path("runs/demo-serve"),
) -> None:
    """Start a local broker, replay a Si-Blurry stream of bundled data into it, and serve the learner.

    Args:
        dataset: Bundled dataset to stream (cifar10, tinyimagenet-downstream) or an ImageFolder root.
        train_per_class: Training images per class in the stream.
        test_per_class: Test images per class for the any-time accuracy.
        mepo: Optional MePo bundle (mepo refine or mepo covariance).
        img_size: Backbone input resolution.
        port: HTTP port.
        rate: Producer records per second (null: as fast as possible).
        until_done: Exit (and print a summary) once the whole stream is learned, instead of serving on.
        bootstrap_servers: Use this Kafka cluster instead of starting the embedded broker.
        out: Folder for the checkpoint and the broker log (a previous demo's checkpoint is removed).
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint" / CHECKPOINT).unlink(missing_ok=True)  # the in-memory broker starts empty too
    data = DataConfig(dataset, train_per_class=train_per_class, test_per_class=test_per_class)
    broker = EmbeddedBroker(log_path=out / "broker.log") if bootstrap_servers is None else nullcontext()
    with broker:
        kafka = KafkaConfig(bootstrap_servers=bootstrap_servers or broker.bootstrap)
        ensure_topics(kafka)
        produce = [sys.executable, "-m", "mepo_stream.cli", "produce", "--data.dataset", dataset,
                   "--data.train_per_class", str(train_per_class), "--kafka.bootstrap_servers", kafka.bootstrap_servers]
        producer = subprocess.Popen(produce + (["--replay.rate", str(rate)] if rate else []))
        cfg = ServeConfig(kafka=kafka, data=data, mepo=mepo, checkpoint_dir=out / "checkpoint", port=port,
                          eval_period=250, checkpoint_every=256)
        cfg = replace(cfg, backbone=replace(cfg.backbone, img_size=img_size))
        app = create_app(cfg)
        server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=port, log_level="warning"))
        if until_done:
            expected = len(list_files(data, "train").files)
            threading.Thread(target=_stop_when_learned, args=(app, server, producer, expected), daemon=True).start()
        where = f"embedded broker {broker.bootstrap} (pid {broker.process.pid})" if bootstrap_servers is None \
            else f"Kafka {bootstrap_servers}"
        print(f"live page: http://127.0.0.1:{port}/", flush=True)
        print(f"{where}; API docs http://127.0.0.1:{port}/docs ; status http://127.0.0.1:{port}/v1/status ; "
              f"metrics http://127.0.0.1:{port}/metrics", flush=True)
        start = time.monotonic()
        try:
            server.run()
        finally:
            producer.terminate()
            producer.wait()
        service = getattr(app.state, "service", None)
        if service is not None:
            status = service.state.status()
            status["wall_time_s"] = round(time.monotonic() - start, 1)
            keys = ("samples_seen", "classes_seen", "a_last", "dead_lettered", "wall_time_s")
            print(json.dumps({k: status[k] for k in keys} | {"a_auc": status["anytime_accuracy"]["a_auc"]}))
