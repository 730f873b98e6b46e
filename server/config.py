"""Typed configuration of ``mepo serve`` (CLI options and the FastAPI settings dependency)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mepo_stream.alignment import AlignmentConfig
from mepo_stream.backbone import BackboneConfig
from mepo_stream.data import DataConfig
from mepo_stream.images import ImageLimits
from mepo_stream.kafka import KafkaConfig
from mepo_stream.learner import LearnerConfig
from mepo_stream.methods import MethodsConfig
from server.monitor import MonitorConfig


@dataclass(frozen=True)
class ServeConfig:
    """Everything the learner and the API need."""

    kafka: KafkaConfig = KafkaConfig()
    """Broker, topics and consumer group."""
    data: DataConfig = DataConfig(dataset="cifar10", test_per_class=100)
    """Label space and class names (from the train split's classes) and the held-out test split used for the
    any-time accuracy."""
    backbone: BackboneConfig = BackboneConfig()
    """Pretrained backbone (replaced by the bundle's when --mepo is given)."""
    mepo: Path | None = None
    """MePo bundle (mepo refine / covariance / isa): its backbone, Sigma_pre and ISA prompts, where it has them."""
    method: str = "frozen"
    """Host method: ``frozen`` (the backbone's feature, no prompts; with the default streaming-LDA classifier
    this is what learns best here), or a prompt-based host (misa, ...). The paper's recipe:
    ``--cfg.method misa --cfg.learner mepo_stream/recipes/paper.yaml``."""
    methods: MethodsConfig = MethodsConfig()
    """Per-method hyperparameters (--cfg.methods.misa.e_pool, ...)."""
    learner: LearnerConfig = LearnerConfig()
    """Online learning settings (classifier, mini-batch size, steps per mini-batch, lr, precision)."""
    alignment: AlignmentConfig = AlignmentConfig()
    """Meta Cov settings (used when the bundle has Sigma_pre)."""
    monitor: MonitorConfig = MonitorConfig()
    """Prequential accuracy and drift detection."""
    eval_period: int = 1000
    """Any-time evaluation on the seen classes' test images every this many learned samples (0 = off)."""
    eval_batch_size: int = 128
    """Batch size of the any-time evaluation."""
    checkpoint_dir: Path = Path("runs/serve")
    """Where the learner checkpoint lives (it holds the Kafka offsets, so it is the source of truth)."""
    checkpoint_every: int = 512
    """Checkpoint after this many learned samples (and on shutdown)."""
    learn_replays: bool = False
    """Learn a sample of a stream again when it is replayed (by default replays are skipped and counted)."""
    seed: int = 0
    """Seed of the model's initialisation and of the augmentation draws (a checkpoint carries the RNG on)."""
    prequential: bool = True
    """Predict each mini-batch before learning it (test-then-train accuracy, drift detection)."""
    limits: ImageLimits = ImageLimits()
    """Upload and record limits; images are resized to limits.size for learning."""
    decode_workers: int = 4
    """Threads decoding and validating the images of one Kafka poll concurrently (PIL releases the GIL while
    decoding), so a mini-batch is ready sooner; 0 decodes inline in the learner thread."""
    max_files: int = 16
    """Most images in one prediction request."""
    top_k: int = 5
    """Labels returned per image."""
    model_name: str = "mepo"
    """Model name in the Open Inference Protocol routes."""
    admin_token: str | None = field(default=None, repr=False)
    """Bearer token for the admin routes (they are disabled without one)."""
    host: str = "127.0.0.1"
    """HTTP bind address."""
    port: int = 8000
    """HTTP port."""
