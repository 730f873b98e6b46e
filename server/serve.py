"""``mepo serve`` (the learner and the API in one process) and ``mepo demo`` (all of it on an embedded broker)."""

from __future__ import annotations

import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import uvicorn

from mepo_stream.data import DataConfig
from mepo_stream.records import KafkaConfig
from server.app import create_app
from server.broker import EmbeddedBroker
from server.config import ServeConfig
from server.stream import ensure_topics

log = logging.getLogger(__name__)


def serve(cfg: ServeConfig = ServeConfig()) -> None:
    """Learn the Kafka stream in one pass and serve predictions, status and metrics over HTTP.

    Args:
        cfg: Service settings (--cfg.kafka.bootstrap_servers, --cfg.mepo BUNDLE, --cfg.port, ...).
    """
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="info")


def demo(
    dataset: str = "cifar10",
    train_per_class: int = 50,
    test_per_class: int = 20,
    mepo: Path | None = None,
    img_size: int = 84,
    port: int = 8000,
    rate: float | None = None,
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
        out: Folder for the checkpoint and the broker log.
    """
    out.mkdir(parents=True, exist_ok=True)
    with EmbeddedBroker(log_path=out / "broker.log") as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap)
        ensure_topics(kafka)
        produce = [sys.executable, "-m", "mepo_stream.cli", "produce", "--data.dataset", dataset,
                   "--data.train_per_class", str(train_per_class), "--kafka.bootstrap_servers", broker.bootstrap]
        if rate:
            produce += ["--replay.rate", str(rate)]
        producer = subprocess.Popen(produce)
        cfg = ServeConfig(kafka=kafka, data=DataConfig(dataset, test_per_class=test_per_class), mepo=mepo,
                          checkpoint_dir=out / "checkpoint", port=port, eval_period=250, checkpoint_every=256)
        cfg = replace(cfg, backbone=replace(cfg.backbone, img_size=img_size))
        print(f"broker {broker.bootstrap}; API http://127.0.0.1:{port}/docs ; status http://127.0.0.1:{port}/v1/status "
              f"; metrics http://127.0.0.1:{port}/metrics", flush=True)
        try:
            serve(cfg)
        finally:
            producer.terminate()
            producer.wait()
