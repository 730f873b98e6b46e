"""A prediction replica (``mepo replica``): the learner's snapshots, followed from the compacted snapshot
topic and served through the same routers, in a process (or on a machine) of its own.

A replica reads the topic from its beginning with no consumer group and builds the model each snapshot's
``ModelConfig`` defines, with the backbone and bundle on its own disk. A snapshot is refused and counted
(``mepo_replica_snapshots_refused_total{reason}``: ``corrupt``, ``backbone_mismatch``, ``bundle_mismatch``,
``incompatible``), or swapped in by one reference assignment, so a replica at version v answers exactly what the
learner answers at v. Without the learner or the broker it keeps serving its last snapshot.

Example (a replica before its first snapshot: not ready, predictions answer 503):
    >>> NO_SNAPSHOT.version, NO_SNAPSHOT.exposed
    (0, ())
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields, is_dataclass, replace

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from mepo_stream.backbone import device
from mepo_stream.errors import StateRefused
from mepo_stream.methods.base import ContinualMethod
from mepo_stream.model import BundleParts, ModelConfig, create_model
from server.batching import MicroBatcher
from server.config import ServeConfig, model_config
from server.consumer import PROBE_EVERY_S, ConsumerThread, LoopHealth, broker_answers
from server.metrics import ServerMetrics
from server.model_thread import ModelThread
from server.serving import Serving
from server.snapshot import Snapshot
from server.snapshot_topic import Assembler, CorruptSnapshot, Origin, SnapshotMessage, decode, ensure_snapshot_topic
from server.status import ReplicaReadiness, ReplicaStatus, ReplicaView

log = logging.getLogger(__name__)
NO_SNAPSHOT = Snapshot(model=None, exposed=(), version=0, samples_seen=0)
"""What a replica serves before its first snapshot: no class, so predictions answer 503."""
RETRY_S = 2.0


class SnapshotRefused(ValueError):
    """A snapshot this replica cannot serve; ``reason`` labels the refusal metric."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def contradictions(given, learner, default, prefix: str = "--") -> list[tuple[str, object, object]]:
    """The options set on the replica (not left at their defaults) that differ from the learner's model
    configuration, as (option, replica's value, learner's value); nested config dataclasses are walked.

    Example:
        >>> from mepo_stream.backbone import BackboneConfig
        >>> mine = ModelConfig(backbone=BackboneConfig(img_size=48))
        >>> contradictions(mine, ModelConfig(backbone=BackboneConfig(img_size=84)), ModelConfig())
        [('--backbone.img_size', 48, 84)]
    """
    out = []
    for f in fields(given):
        mine, theirs, unset = getattr(given, f.name), getattr(learner, f.name), getattr(default, f.name)
        if is_dataclass(mine):
            out += contradictions(mine, theirs, unset, f"{prefix}{f.name}.")
        elif mine != unset and mine != theirs:
            out.append((f"{prefix}{f.name}", mine, theirs))
    return out


class ReplicaModel:
    """The model a snapshot's ``ModelConfig`` defines, built with the weights and bundle on this machine."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self._built: tuple[str, int, ContinualMethod] | None = None  # (config JSON, classes, model)

    def config(self, origin: Origin) -> ModelConfig:
        """The learner's model configuration with this replica's ``--mepo`` path, if any; ``SnapshotRefused`` if an
        option contradicts it or the bundle differs."""
        learner = ModelConfig.from_json(origin.model_config)
        mine, unset = model_config(self.cfg), model_config(ServeConfig())
        mine_but_bundle, learner_but_bundle = replace(mine, mepo=BundleParts()), replace(learner, mepo=BundleParts())
        for option, value, theirs in contradictions(mine_but_bundle, learner_but_bundle, unset):
            reason = "backbone_mismatch" if option.startswith("--backbone.") else "incompatible"
            raise SnapshotRefused(reason, f"{option} {value} contradicts the learner's {theirs}: a replica builds the "
                                          f"model its snapshots define; leave the option out")
        config = learner if not mine.mepo.bundles else replace(learner, mepo=mine.mepo)
        if config.mepo.sha256() != origin.bundle_sha256:
            learners, ours = str(origin.bundle_sha256)[:12], str(config.mepo.sha256())[:12]
            raise SnapshotRefused("bundle_mismatch", f"the learner's bundle has sha256 {learners}…, this replica's "
                                                     f"{ours}… (give it the learner's bundle with --mepo)")
        return config

    def snapshot(self, message: SnapshotMessage) -> Snapshot:
        """The message's tensors in the model its configuration defines, as the learner makes its snapshots."""
        config = self.config(message.origin)
        model = self._model(config, len(message.origin.class_names))
        if model.backbone_sha256 != message.origin.backbone_sha256:
            theirs, mine = message.origin.backbone_sha256 or "?", model.backbone_sha256 or "?"
            raise SnapshotRefused("backbone_mismatch", f"the learner's backbone has sha256 {theirs[:12]}…, this "
                                  f"replica's {mine[:12]}… (the backbone weights on this machine differ from the "
                                  f"learner's)")
        try:
            model.load_trainable_state_dict(message.tensors)
        except StateRefused as e:
            raise SnapshotRefused("incompatible", str(e)) from e
        return Snapshot(model.inference_copy(), message.exposed, message.version, message.samples_seen,
                        config.alignment.inference_mode, message.novelty_score, message.novelty_threshold)

    def _model(self, config: ModelConfig, n_classes: int) -> ContinualMethod:
        """The model the tensors are loaded into, built once per configuration and label space."""
        key = config.to_json()
        if self._built is None or self._built[:2] != (key, n_classes):
            self._built = (key, n_classes, create_model(config, n_classes, device()))
        return self._built[2]


class ReplicaState:
    """What the routers read on a replica (``snapshot``, ``class_names``, ``metrics``, ``status``), and the swap."""

    def __init__(self, cfg: ServeConfig, metrics: ServerMetrics, model_thread: ModelThread | None = None):
        self.cfg, self.metrics = cfg, metrics
        self.model_thread = model_thread or ModelThread()  # builds, loads and predicts (``server.model_thread``)
        self.model = ReplicaModel(cfg)
        self.snapshot: Snapshot = NO_SNAPSHOT
        self.class_names: dict[int, str] = {}
        self.published_at: float | None = None
        self.newest_version: int | None = None  # of the last snapshot record seen on the topic
        metrics.snapshot_age.set_function(lambda: self.age if self.age is not None else float("nan"))
        metrics.replica_lag.set_function(lambda: self.lag)

    @property
    def loaded(self) -> bool:
        return self.published_at is not None

    @property
    def age(self) -> float | None:
        """Seconds since the learner published the served snapshot (clocks of two machines: keep them in sync)."""
        return None if self.published_at is None else max(0.0, time.time() - self.published_at)

    def load(self, blob: bytes) -> None:
        """Decode, check and swap in one snapshot blob; a refusal is logged and counted and changes nothing."""
        start = time.perf_counter()
        try:
            message = decode(blob)
            snapshot = self.model_thread.run(self.model.snapshot, message)
        except CorruptSnapshot as e:
            self.refuse("corrupt", f"skipped a corrupt snapshot: {e}")
            return
        except SnapshotRefused as e:
            self.refuse(e.reason, f"refused snapshot version {message.version}: {e}")
            return
        self.class_names = dict(enumerate(message.origin.class_names))
        self.snapshot, self.published_at = snapshot, message.published_at  # the swap
        config, m = ModelConfig.from_json(message.origin.model_config), self.metrics
        m.info.info({"backbone": config.backbone.name, "mepo_bundle": ",".join(map(str, config.mepo.bundles)),
                     "method": config.method, "role": "replica",
                     "backbone_sha256": message.origin.backbone_sha256 or ""})
        m.snapshot_load_seconds.observe(time.perf_counter() - start)
        m.snapshots_loaded.inc()
        m.model_version.set(snapshot.version)
        m.seen_classes.set(len(snapshot.exposed))
        log.info("serving snapshot version %d (%d samples, %d classes), published %.1f s ago", snapshot.version,
                 snapshot.samples_seen, len(snapshot.exposed), self.age)

    def refuse(self, reason: str, message: str) -> None:
        self.metrics.snapshots_refused.labels(reason).inc()
        log.error("%s [%s]; still serving version %d", message, reason, self.snapshot.version)

    @property
    def lag(self) -> int:
        """Versions between the newest snapshot seen on the topic and the one served."""
        return 0 if self.newest_version is None else max(0, self.newest_version - self.snapshot.version)

    def status(self, health: LoopHealth) -> ReplicaStatus:
        """``/v1/status``: the snapshot served, with the following thread's ``health``."""
        snap = self.snapshot
        me = ReplicaView(model_version=snap.version, samples_seen=snap.samples_seen, lag_versions=self.lag,
                         snapshot_age_seconds=None if self.age is None else round(self.age, 1))
        return ReplicaStatus(**me.model_dump(), classes_seen=len(snap.exposed), snapshot_loaded=self.loaded,
                             replicas={f"{self.cfg.host}:{self.cfg.port}": me}, **health.status_fields(),
                             follower_error=health.error)


class SnapshotFollower(ConsumerThread):
    """The replica's loop: swaps in the newest complete snapshot of each poll (none while paused)."""

    def __init__(self, state: ReplicaState):
        self.state, self.kafka = state, state.cfg.kafka
        self.assembler = Assembler(state.cfg.model_name)
        self.positions: dict[TopicPartition, int] = {}  # next offset to read, kept across reconnects
        self.consumer: KafkaConsumer | None = None
        super().__init__("mepo-replica")

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._connect()
                self._follow()
            except KafkaError as e:
                log.warning("snapshot topic unavailable (%s); serving version %d, retrying in %.0f s", e,
                            self.state.snapshot.version, RETRY_S)
                self._close()
                self.stop_event.wait(RETRY_S)
            except Exception as e:  # a bug, not a broker problem: stop following, report it, keep serving
                log.exception("the snapshot follower failed")
                self.error = f"{type(e).__name__}: {e}"
                break
        self._close()

    def _connect(self) -> None:
        """Assign every partition of the snapshot topic, at the offsets reached so far or at its beginning."""
        ensure_snapshot_topic(self.kafka)  # a replica needs --kafka.snapshot_topic: refused without one
        topic = self.kafka.snapshot_topic
        self.consumer = consumer = KafkaConsumer(
            **self.kafka.client_options(), group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
            max_partition_fetch_bytes=4 * self.kafka.snapshot_chunk_bytes, fetch_max_bytes=64 * 1024 * 1024)
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not partitions:
            raise KafkaError(f"topic {topic} has no partitions yet")
        consumer.assign(partitions)
        for tp in partitions:
            if tp in self.positions:
                consumer.seek(tp, self.positions[tp])
            else:
                consumer.seek_to_beginning(tp)
        log.info("following %s from %s", topic, {tp.partition: self.positions.get(tp, 0) for tp in partitions})

    def _follow(self) -> None:
        while not self.stop_event.is_set():
            if self._paused.is_set():
                self.stop_event.wait(0.2)
                continue
            assert self.consumer is not None  # connected before the loop
            polled = self.consumer.poll(timeout_ms=500)
            self._probe(bool(polled))
            records = sorted((r for rs in polled.values() for r in rs), key=lambda r: (r.partition, r.offset))
            newest = None
            for record in records:
                self.positions[TopicPartition(record.topic, record.partition)] = record.offset + 1
                try:
                    newest = self.assembler.add(record.key, record.value, record.headers) or newest
                except CorruptSnapshot as e:
                    self.state.refuse("corrupt", f"skipped corrupt record {record.topic}:{record.partition}"
                                                 f"@{record.offset}: {e}")
            self.state.newest_version = self.assembler.newest_version
            if newest is not None:
                self.state.load(newest)

    def _probe(self, got_records: bool) -> None:
        """Records prove the broker answers; otherwise ask it every few seconds (and while disconnected)."""
        if got_records or time.monotonic() - self._probed_at > PROBE_EVERY_S or not self.connected:
            self.connected = got_records or broker_answers(self.consumer)
            self._probed_at = time.monotonic()
            self.state.metrics.replica_up.set(int(self.connected))

    def _close(self) -> None:
        if self.consumer is not None:
            try:
                self.consumer.close()
            except Exception:  # closing after a broker failure must not hide the failure itself
                log.exception("error while closing the snapshot consumer")
        self.consumer, self.connected = None, False
        self.state.metrics.replica_up.set(0)


@dataclass
class ReplicaService(Serving):
    """A replica's counterpart of ``server.learner.service.Service``: the same ``ServingModel`` for the routers."""

    state: ReplicaState
    loop: SnapshotFollower
    batcher: MicroBatcher

    @classmethod
    def start(cls, settings: ServeConfig, metrics: ServerMetrics) -> ReplicaService:
        """Build the backbone and bundle, then follow the snapshot topic in the follower's thread."""
        state = ReplicaState(settings, metrics)
        service = cls(state, SnapshotFollower(state), MicroBatcher(run=state.model_thread.run))
        service.loop.start()
        return service

    def stop(self) -> None:
        self.loop.stop()
        self.state.model_thread.shutdown()
        self._close_uploads()

    def status(self) -> ReplicaStatus:
        return self.state.status(self.loop.health())

    def readiness(self) -> ReplicaReadiness:
        """Ready once a snapshot is loaded (it keeps serving it while the learner or the broker is down)."""
        health = self.loop.health()
        return ReplicaReadiness(checks={"snapshot_loaded": self.state.loaded, "follower_running": health.running},
                                follower_error=health.error)
