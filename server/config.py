"""Typed configuration of ``mepo serve``, ``mepo demo`` and ``mepo replica`` (their CLI options and the FastAPI
settings dependency). The option groups are ``mepo evaluate``'s, so a flag learned on one command works on the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar, Literal

from mepo_stream.alignment import AlignmentConfig
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.backbone import DEFAULT_IMG_SIZE, BackboneConfig, sized
from mepo_stream.data import DataConfig
from mepo_stream.errors import ConfigError
from mepo_stream.images import ImageLimits
from mepo_stream.kafka import KafkaConfig, ReplayConfig
from mepo_stream.label_join import JoinConfig
from mepo_stream.learner import LearnerConfig
from mepo_stream.methods import MethodsConfig
from mepo_stream.model import BundleParts, ModelConfig
from mepo_stream.novelty import DEFAULT_SCORE, NoveltyScore


@dataclass(frozen=True)
class MonitorConfig:
    """Live-stream quality signals."""

    rolling_window: int = 1000
    """Samples in the rolling prequential accuracy."""
    detector: str = "ADWIN"
    """river drift detector on the 0/1 error stream: ADWIN, PageHinkley or KSWIN."""
    max_events: int = 100
    """Most recent drift events kept for /v1/status."""


@dataclass(frozen=True)
class CorrectionsConfig:
    """Corrections and deletions of learned samples (docs/corrections.md): the model follows the latest label of
    every id that still exists, as a Kafka Streams table follows its topic."""

    enabled: bool = False
    """A label for an id already learned corrects it (with labels inline: an empty value with id and label headers
    on the image topic); a tombstone (a null value keyed by the id) on the image or labels topic deletes it. Both are
    learned exactly, so the model is always a fresh learner's fed the final table. Needs a learner that is a sum of
    its samples (the default); refused at start otherwise."""
    retention_s: float = 7 * 86400.0
    """How long an id stays correctable, in record time since its last label (its feature, about 1.5 KiB at 384
    dimensions, is kept on disk until then); a later correction or deletion is dead-lettered as not_correctable."""
    compact_every_s: float = 3600.0
    """A deleted sample's bytes leave the sample table's files at the first checkpoint this many seconds after the
    last compaction (the table is copied without its free pages, where the old bytes stay until reused)."""


@dataclass(frozen=True)
class NoveltyConfig:
    """"Not seen yet": every answer says how likely its image is of a class not learned yet (docs/novelty.md)."""

    score: NoveltyScore = DEFAULT_SCORE
    """The novelty score, from the streaming LDA's own sums: stream_mahalanobis (the best measured), or
    relative_mahalanobis, mahalanobis, energy, max_softmax. A classifier without the LDA's covariance (the paper's
    linear head, NCM) answers energy."""
    false_alarm: float = 0.05
    """Target share of images of learned classes answered as novel: the threshold is the stream's own scores'
    upper quantile, calibrated on each image just before it is learned. In (0, 1)."""
    half_life: float = 400.0
    """Stream samples after which a score weighs half as much in the calibration: the threshold follows the stream."""

    def __post_init__(self) -> None:
        if not 0.0 < self.false_alarm < 1.0:
            raise ConfigError(f"--novelty.false_alarm must be in (0, 1): the share of learned classes' images "
                              f"answered as novel; got {self.false_alarm}")
        if not self.half_life > 0:
            raise ConfigError(f"--novelty.half_life must be a positive number of samples, got {self.half_life}")


@dataclass(frozen=True)
class ServeConfig:
    """Learn a Kafka stream of labelled images in one pass and serve predictions, status and metrics over HTTP.

    Example: ``mepo serve --kafka.bootstrap_servers k1:9092 --mepo runs/refined --port 8000``.
    """

    default_img_size: ClassVar[int] = DEFAULT_IMG_SIZE
    """The resolution when neither --backbone.img_size nor a bundle gives one (not an option: the command's)."""

    kafka: KafkaConfig = KafkaConfig()
    """Broker, topics and consumer group."""
    role: ClassVar[Literal["learner", "replica"]] = "learner"
    """The service this config starts: the learner (a ``ReplicaConfig`` starts a replica). Not an option."""
    command: ClassVar[str] = "serve"
    """The ``mepo`` command that takes this config."""
    publish_interval_s: float = 1.0
    """Least seconds between two snapshots the learner publishes: versions learned in between are skipped, the
    newest one is always published."""
    data: DataConfig = DataConfig(dataset="cifar10", test_per_class=100)
    """Label space and class names (from the train split's classes) and the held-out test split used for the
    any-time accuracy."""
    backbone: BackboneConfig = BackboneConfig()
    """Pretrained backbone (replaced by the bundle's when --mepo is given)."""
    mepo: Path | None = None
    """MePo bundle (mepo refine / covariance / isa): its backbone, Sigma_pre and ISA prompts, where it has them."""
    mepo_rep: Path | None = None
    """Meta Rep from this bundle: its backbone replaces --backbone.weights (and --mepo's), as in mepo evaluate."""
    mepo_cov: Path | None = None
    """Meta Cov from this bundle: its Sigma_pre (or a MePo release cov_*.npy) replaces --mepo's, as in mepo
    evaluate."""
    method: str = "frozen"
    """Host method: ``frozen`` (the backbone's feature, no prompts; with the default streaming-LDA classifier
    this is what learns best here), or a prompt-based host (misa, ...). The paper's recipe:
    ``--method misa --learner mepo_stream/recipes/paper.yaml``."""
    method_config: MethodsConfig = MethodsConfig()
    """Per-method hyperparameters (--method_config.misa.e_pool, ...)."""
    learner: LearnerConfig = LearnerConfig()
    """Online learning settings (classifier, mini-batch size, steps per mini-batch, lr, precision)."""
    alignment: AlignmentConfig = AlignmentConfig()
    """Meta Cov settings (used when the bundle has Sigma_pre)."""
    monitor: MonitorConfig = MonitorConfig()
    """Prequential accuracy and drift detection."""
    protocol: ProtocolConfig = ProtocolConfig()
    """Any-time evaluation on the seen classes' test images (the schedule and scoring of mepo evaluate)."""
    join: JoinConfig = JoinConfig()
    """Labels that come later (with --kafka.labels_topic): how many images and labels may wait for each other, and
    for how long (in record time)."""
    corrections: CorrectionsConfig = CorrectionsConfig()
    """Corrections and deletions of learned samples (off by default)."""
    novelty: NoveltyConfig = NoveltyConfig()
    """The novelty score every answer carries, and its threshold."""
    checkpoint_dir: Path = Path("runs/serve")
    """Where the learner checkpoint lives (it holds the Kafka offsets, so it is the source of truth)."""
    checkpoint_every: int = 512
    """Checkpoint after this many learned samples (and on shutdown)."""
    checkpoint_min_interval_s: float = 1.0
    """Seconds at least between two periodic checkpoints (each copies the state and writes it beside the next
    steps). A crash replays about this much more of the stream, yet learns nothing twice (the checkpoint holds the
    offsets); in a group it also bounds how often a partition's state is published. 0: every ``checkpoint_every``."""
    learn_replays: bool = False
    """Learn a sample of a stream again when it is replayed (by default replays are skipped and counted)."""
    seed: int = 0
    """Seed of the model's initialisation and of the augmentation draws (a checkpoint carries the RNG on)."""
    prequential: bool = True
    """Predict each mini-batch before learning it (test-then-train accuracy, drift detection)."""
    limits: ImageLimits = ImageLimits()
    """Upload and record limits, and the size images are decoded to (default: the model's input size)."""
    consumer: Literal["kafka-python", "librdkafka"] = "kafka-python"
    """The client the learner reads the stream with: kafka-python, or librdkafka (``confluent-kafka``, the
    ``librdkafka`` extra), which parses records in C, off the interpreter lock a fast model's step needs
    (docs/performance.md measures both)."""
    gpu_decode: bool | None = None
    """Decode the JPEGs of each Kafka poll on the model's GPU (nvjpeg, batched) and resize them there, instead of
    one by one in the model thread; other formats, and JPEGs the GPU cannot take, still decode on the CPU.
    Default: on when the model runs on CUDA. It needs a CUDA model."""
    max_files: int = 16
    """Most images in one prediction request."""
    max_inflight_bytes: int = 512 * 2**20
    """Most request-body bytes all HTTP requests in flight may hold together: a request that would pass it while
    others are in flight gets 503 with Retry-After (one request alone is bounded by its own limit)."""
    grpc_port: int | None = None
    """Also serve the Open Inference Protocol over gRPC on this port (KServe's and Triton's gRPC clients)."""
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


@dataclass(frozen=True)
class DemoConfig(ServeConfig):
    """Start a local broker, replay a Si-Blurry stream of bundled data into it, and serve the learner.

    Every ``mepo serve`` option applies; the defaults are a small CIFAR-10 stream at 84 px.
    Example: ``mepo demo --until_done true --data.train_per_class 50``.
    """

    data: DataConfig = DataConfig(dataset="cifar10", train_per_class=50, test_per_class=20)
    """Bundled dataset to stream (cifar10, tinyimagenet-downstream) or an ImageFolder root (train/ and test/ class
    folders): at most 50 training and 20 test images a class, a short first look (--data.train_per_class null
    --data.test_per_class null streams a folder whole)."""
    default_img_size: ClassVar[int] = 84
    """Without a bundle the demo runs at 84 px: fast on a CPU."""
    command: ClassVar[str] = "demo"

    protocol: ProtocolConfig = ProtocolConfig(eval_period=32)
    """Any-time evaluation every 32 samples: 15 points on the 500-sample stream's curve. A multiple of
    --learner.batch_size cuts no mini-batch short (a short one costs a whole padded forward; docs/performance.md)."""
    checkpoint_dir: Path = Path("runs/demo/checkpoint")
    """The demo's checkpoint (removed at start: the embedded broker starts empty too); the broker log goes beside."""
    checkpoint_every: int = 256
    """Checkpoint after this many learned samples."""
    replay: ReplayConfig = ReplayConfig()
    """The demo's producer (``mepo produce --replay.*``): records per second, how many, partitions."""
    until_done: bool = False
    """Exit (and print a summary) once the whole stream is learned, instead of serving on."""
    embedded_broker: bool = True
    """Start a local broker on --kafka.bootstrap_servers' loopback port (port 0: a free one, printed at start); false
    streams through the cluster at --kafka.bootstrap_servers instead."""


@dataclass(frozen=True)
class ReplicaConfig(ServeConfig):
    """Serve predictions from the learner's snapshots on --kafka.snapshot_topic; learn nothing, need no dataset.

    The model each snapshot defines is built with the backbone weights and --mepo bundle on this machine's disk. Of
    ``mepo serve``'s options it takes the broker's, the serving ones (``--port``, ``--grpc_port``, ``--limits.*``, ...)
    and the model's, which must agree with the snapshot's; the learner's own (data, checkpoints, learning) are ignored.
    Example: ``mepo replica --kafka.bootstrap_servers k1:9092 --port 8001``.
    """

    role: ClassVar[Literal["learner", "replica"]] = "replica"
    command: ClassVar[str] = "replica"


def replica_of(learner: ServeConfig, **changes: object) -> ReplicaConfig:
    """A replica of ``learner``'s configuration, with ``changes`` (a function: the CLI takes methods for commands)."""
    return ReplicaConfig(**{**{f.name: getattr(learner, f.name) for f in fields(ReplicaConfig)}, **changes})


def bundle_parts(cfg: ServeConfig) -> BundleParts:
    """The MePo parts of the model: every part --mepo has, Meta Rep from --mepo_rep and Meta Cov from --mepo_cov
    where they are given (a bundle that lacks its part is refused when the model is built).

    Example:
        >>> bundle_parts(ServeConfig(mepo_cov=Path("cov_vit.npy")))
        BundleParts(rep=None, cov=PosixPath('cov_vit.npy'), prompts=None)
    """
    parts = BundleParts.of(cfg.mepo)
    return replace(parts, rep=cfg.mepo_rep or parts.rep, cov=cfg.mepo_cov or parts.cov)


def model_config(cfg: ServeConfig) -> ModelConfig:
    """The model a service's configuration defines, at ``--backbone.img_size``, else its bundle's, else the command's
    ``default_img_size`` (a function: the CLI takes methods for commands)."""
    parts = bundle_parts(cfg)
    backbone = sized(cfg.backbone, parts.bundles, cfg.default_img_size)
    return ModelConfig(cfg.method, cfg.method_config, backbone, parts, cfg.alignment, cfg.learner, cfg.seed)
