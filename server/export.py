"""``mepo export``: the current model, from a running learner's snapshot (built as a replica builds it) or its
checkpoint (built from the options), in fp32, as ONNX or a Triton model repository (``mepo_stream.export``).

Example:
    mepo export --format triton --kafka.bootstrap_servers k1:9092 --mepo runs/refined --out runs/triton
    tritonserver --model-repository runs/triton
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, Literal

from kafka import KafkaConsumer, TopicPartition

from mepo_stream.backbone import device
from mepo_stream.checkpoint import LearnerCheckpoint
from mepo_stream.data import list_files
from mepo_stream.errors import ConfigError, StateRefused
from mepo_stream.export import ProbabilityGraph, labels_metadata, onnx_model, write_onnx, write_triton_repository
from mepo_stream.learner import OnlineLearner
from mepo_stream.model import ModelConfig, create_model
from mepo_stream.novelty import DEFAULT_SCORE, NoveltyThreshold
from server.config import ServeConfig, model_config
from server.learner.state import CHECKPOINT
from server.replica.follower import ReplicaModel, SnapshotRefused
from server.snapshot import Snapshot, take_snapshot
from server.snapshot_topic import Assembler, SnapshotMessage, decode

IDLE_POLL_MS = 1000
"""A poll this long that brings nothing, once a snapshot is whole: the topic is read to its end."""


@dataclass(frozen=True)
class ExportConfig(ServeConfig):
    """Export the current model as ONNX or a Triton model repository; every ``mepo serve`` option says where the
    model comes from and how it is built.

    Example: ``mepo export --format onnx --source checkpoint --checkpoint_dir runs/serve --out model.onnx``.
    """

    command: ClassVar[str] = "export"

    format: Literal["onnx", "triton"] = "onnx"
    """``onnx``: one .onnx file at --out. ``triton``: a model repository at --out (``<model_name>/config.pbtxt``,
    ``1/model.onnx``, ``labels.txt``), for ``tritonserver --model-repository <out>``."""
    source: Literal["snapshot", "checkpoint"] = "snapshot"
    """``snapshot``: the newest snapshot a learner published to --kafka.snapshot_topic (--model_name's).
    ``checkpoint``: the learner checkpoint in --checkpoint_dir."""
    out: Path = Path("runs/export")
    """Where to write: the .onnx file (--format onnx) or the repository folder (--format triton), replaced whole."""
    wait_s: float = 30.0
    """Longest wait for a whole snapshot on the snapshot topic."""
    max_batch_size: int = 64
    """Triton's max_batch_size (its dynamic batcher's largest batch)."""


def read_snapshot(cfg: ServeConfig, wait_s: float) -> SnapshotMessage:
    """The newest whole snapshot of ``cfg.model_name`` on the snapshot topic, read from its beginning."""
    topic = cfg.kafka.snapshot_topic
    if topic is None:
        raise ConfigError("--source snapshot needs --kafka.snapshot_topic (the topic the learner publishes to)")
    consumer = KafkaConsumer(**cfg.kafka.client_options(), group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest", max_partition_fetch_bytes=4 * cfg.kafka.snapshot_chunk_bytes)
    deadline = time.monotonic() + wait_s
    try:
        while not (partitions := consumer.partitions_for_topic(topic)) and time.monotonic() < deadline:
            time.sleep(0.5)  # the topic is made by the learner's publisher: it may not be there yet
        consumer.assign([TopicPartition(topic, p) for p in sorted(partitions or ())])
        blob = _newest_blob(consumer, Assembler(cfg.model_name), deadline) if partitions else None
    finally:
        consumer.close()
    if blob is None:
        raise ConfigError(f"no whole snapshot of model {cfg.model_name!r} on {topic} at {cfg.kafka.bootstrap_servers} "
                          f"within {wait_s:.0f} s: is a learner publishing there (--kafka.snapshot_topic, "
                          f"--model_name)? Or export its checkpoint: --source checkpoint")
    return decode(blob)


def _newest_blob(consumer: KafkaConsumer, assembler: Assembler, deadline: float) -> bytes | None:
    """The newest whole snapshot, once the topic is read to its end (``IDLE_POLL_MS``) or at the deadline."""
    newest = None
    while time.monotonic() < deadline:
        polled = consumer.poll(timeout_ms=IDLE_POLL_MS)
        if not polled and newest is not None:
            break
        for record in sorted((r for rs in polled.values() for r in rs), key=lambda r: (r.partition, r.offset)):
            newest = assembler.add(record.key, record.value, record.headers) or newest
    return newest


def in_fp32(config: ModelConfig) -> ModelConfig:
    """``config`` at ``--learner.precision fp32``: the graph runs fp32 and must hold the weights as loaded."""
    return replace(config, learner=replace(config.learner, precision="fp32"))


def from_snapshot(cfg: ExportConfig) -> tuple[Snapshot, list[str]]:
    """The learner's newest snapshot, built as a replica builds it (in fp32), and its class names."""
    message = read_snapshot(cfg, cfg.wait_s)
    learner = in_fp32(ModelConfig.from_json(message.origin.model_config))
    message = replace(message, origin=replace(message.origin, model_config=learner.to_json()))
    try:
        snapshot = ReplicaModel(cfg).snapshot(message)
    except SnapshotRefused as e:
        raise ConfigError(f"cannot build the snapshot's model here: {e}") from e
    return snapshot, list(message.origin.class_names)


def from_checkpoint(cfg: ExportConfig) -> tuple[Snapshot, list[str]]:
    """The model in ``--checkpoint_dir``'s learner checkpoint, built from the options, and the data's class names."""
    path = cfg.checkpoint_dir / CHECKPOINT
    if not path.is_file():
        raise ConfigError(f"no learner checkpoint at {path}: pass the learner's --checkpoint_dir")
    saved = LearnerCheckpoint.load(path)
    names = list_files(cfg.data, "train").class_names
    config = in_fp32(model_config(cfg))
    learner = OnlineLearner(create_model(config, len(names), device()), config.learner)
    learner.novelty_threshold = NoveltyThreshold(cfg.novelty.false_alarm, cfg.novelty.half_life)  # restored below
    try:
        learner.load_state_dict(saved.learner)
    except StateRefused as e:
        raise ConfigError(f"{path} was written by another model than these options build (give the learner's "
                          f"--method, --backbone.*, --mepo, --learner.* options): {e}") from e
    return take_snapshot(learner, saved.version, cfg.alignment.inference_mode, cfg.novelty.score), names


def export(cfg: ExportConfig) -> Path:
    """Write the current model as ``--format`` says, from ``--source``; returns what was written."""
    snapshot, names = (from_snapshot if cfg.source == "snapshot" else from_checkpoint)(cfg)
    if not snapshot.exposed:
        raise ConfigError("the model has not learned any class yet: nothing to export")
    assert snapshot.model is not None  # a snapshot with classes has its model
    graph = ProbabilityGraph(snapshot.model, len(snapshot.exposed), snapshot.align_mode,
                             snapshot.novelty_score or DEFAULT_SCORE)
    labels = [names[y] for y in snapshot.exposed]
    model = onnx_model(graph, labels_metadata(labels, list(snapshot.exposed), snapshot.version,
                                              snapshot.samples_seen, snapshot.novelty_threshold))
    written = (write_onnx(model, cfg.out) if cfg.format == "onnx" else
               write_triton_repository(cfg.out, cfg.model_name, model, labels, graph.image_size, cfg.max_batch_size))
    print(json.dumps({"format": cfg.format, "out": str(written), "source": cfg.source,
                      "model_version": snapshot.version, "samples_seen": snapshot.samples_seen,
                      "classes": len(labels), "image_size": graph.image_size}))
    return written
