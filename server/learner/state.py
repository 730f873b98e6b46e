"""The service's model state: learner, published snapshot, stream bookkeeping, metrics and checkpoints.

No Kafka here: ``server.learner.stream`` reads the records and tells the state what became of each one (``claim``,
``add_pending``, ``skip``, ``dead_letter``, ``release``), then has it ``learn`` the pending ones, ``capture`` a
checkpoint and ``write`` it. The state is the one owner of the ``StreamBook`` (``server.learner.book``): it books
the records the loop reports, marks a mini-batch learned in the same step that learns it, and saves and restores
the book with the model. A checkpoint holds the trainable state, optimizer, seen classes, running alignment
statistics, monitor state, any-time history, the learned sample ids per stream, and the next offset per
partition, so model and offsets roll back together.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from mepo_stream.anytime import AnytimeCurve, AnytimeEvaluation
from mepo_stream.backbone import device
from mepo_stream.checkpoint import load_checkpoint, save_checkpoint
from mepo_stream.data import list_files, load_split
from mepo_stream.learner import OnlineLearner
from mepo_stream.model import create_model
from server.config import ServeConfig, model_config
from server.learner.book import Pending, Sample, StreamBook
from server.learner.monitor import StreamMonitor
from server.learner.staging import stack_images
from server.metrics import ServerMetrics
from server.model_thread import ModelThread
from server.snapshot import Snapshot, take_snapshot
from server.snapshot_topic import Origin

log = logging.getLogger(__name__)
CHECKPOINT = "learner.pt"
CHECKPOINT_FORMAT = "mepo-checkpoint/2"
"""What a checkpoint holds: version 2 is version 1 (no ``format`` key, written before 2026-11-25) with the key."""
READABLE_FORMATS = ("mepo-checkpoint/1", CHECKPOINT_FORMAT)


def read_checkpoint(path: Path) -> dict:
    """A learner checkpoint this version reads; another format is refused whole, with what to do."""
    state = load_checkpoint(path)
    fmt = state.get("format", "mepo-checkpoint/1")
    if fmt not in READABLE_FORMATS:
        raise ValueError(f"{path} is a checkpoint of format {fmt!r}; this version of mepo reads {READABLE_FORMATS}. "
                         f"Run the version that wrote it, or move it away to start learning from scratch")
    return state


def build_learner(cfg: ServeConfig, n_classes: int) -> OnlineLearner:
    """The learner around the model the factory builds from ``cfg`` (every part of the MePo bundle it has)."""
    return OnlineLearner(create_model(model_config(cfg), n_classes, device()), cfg.learner)


class ServiceState:
    """Shared by the learner thread (writes) and request handlers (read the published snapshot)."""

    def __init__(self, cfg: ServeConfig, metrics: ServerMetrics, model_thread: ModelThread | None = None):
        self.cfg, self.metrics = cfg, metrics
        self.model_thread = model_thread or ModelThread()  # build the state in it too (``Service.start``)
        listing = list_files(cfg.data, "train")
        self.class_names = dict(enumerate(listing.class_names))
        self.n_classes = len(listing.classes)
        self.evaluation: AnytimeEvaluation | None = None
        if cfg.protocol.eval_period > 0:  # the schedule, scoring and curve of `mepo evaluate`, in the served mode
            test = load_split(replace(cfg.data, load_size=cfg.limits.size), "test")  # decoded as records are
            self.evaluation = AnytimeEvaluation(test, cfg.protocol.eval_period,
                                                cfg.protocol.eval_batch_size, (cfg.alignment.inference_mode,))
        self.learner = build_learner(cfg, self.n_classes)  # seeded: the augmentation's draws follow from the seed
        self.on_learned: Callable[[], None] | None = None  # told of every new version (the publisher)
        self.monitor = StreamMonitor(cfg.monitor)
        self.book = StreamBook(learn_replays=cfg.learn_replays, by_partition=self.scales_out)  # written here only
        self.version = 0
        self.last_checkpoint_time = math.nan
        self.last_learned_time = math.nan  # wall time of the last learned mini-batch (not checkpointed)
        self.class_accuracy: dict[int, float] = {}  # per class id, of the latest evaluation
        self._since_checkpoint = 0
        self._idle_eval_at = -1
        self._lock = threading.Lock()  # one writer at a time: the learner thread, or kafka-python's in a rebalance
        self.samples_seen = 0  # of the last whole step (``learner.samples_seen`` moves inside the step)
        self.restore()
        self._snapshot: Snapshot = take_snapshot(self.learner, self.version, self.cfg.alignment.inference_mode)
        metrics.info.info({"backbone": cfg.backbone.name, "mepo_bundle": str(cfg.mepo or ""),
                           "method": cfg.method, "n_classes": str(self.n_classes)})
        self._export()

    @functools.cached_property
    def origin(self) -> Origin:
        """What this learner's snapshots and partition states share, and what a reader must match to use them
        (fixed once the model is built)."""
        names = tuple(self.class_names[label] for label in range(self.n_classes))
        return Origin(self.cfg.model_name, model_config(self.cfg).to_json(), names,
                      self.learner.method.backbone_sha256, model_config(self.cfg).mepo.sha256())

    @property
    def checkpoint_path(self) -> Path:
        return self.cfg.checkpoint_dir / CHECKPOINT

    # --- serving ------------------------------------------------------------------------------------------
    @property
    def snapshot(self) -> Snapshot:
        """What predictions use: the learner's newest version (a request during a step gets the version after
        it: one thread runs the model, ``server.model_thread``)."""
        return self._snapshot if self._snapshot.version == self.version else self.fresh_snapshot()

    def fresh_snapshot(self) -> Snapshot:
        """A snapshot of the learner's current version, made now (in the model thread) if the learner moved on
        since the last one.

        Why on demand: making one solves the LDA and copies the trainable state, a few ms that a learner taking
        15 mini-batches a second would otherwise spend on every one of them, for snapshots nobody reads.
        """
        return self.model_thread.run(self._fresh_snapshot)

    def _fresh_snapshot(self) -> Snapshot:
        with self._lock:
            if self._snapshot.version != self.version:
                self._snapshot = take_snapshot(self.learner, self.version, self.cfg.alignment.inference_mode)
            return self._snapshot

    # --- the stream's records, as the loop reports them (the book is the state's: it rolls back with the model) -----
    def claim(self, sample_id: tuple[str, int]) -> bool:
        """Take a sample id before decoding its image; False: a replay (learned or in flight), counted."""
        return self.book.claim(*sample_id)

    def release(self, sample_id: tuple[str, int]) -> None:
        """Give back the claim of a record whose image is bad (any thread: the decode pool calls it)."""
        self.book.release(*sample_id)

    def add_pending(self, key: str, offset: int, sample: Sample) -> None:
        """The record at ``offset`` of partition ``key`` holds a decoded sample that waits for its mini-batch."""
        self.book.add_pending(key, offset, sample)

    def skip(self, key: str, offset: int) -> None:
        """The record is a replay: nothing more to do."""
        self.book.skip(key, offset)

    def dead_letter(self, key: str, offset: int) -> None:
        """The record went to the dead-letter topic: counted, nothing more to do."""
        self.book.dead_letter(key, offset)

    def reread(self) -> None:
        """Forget the pending records and every claim: the loop reads them again from ``offsets``."""
        self.book.reread()

    @property
    def pending(self) -> list[Pending]:
        """The records waiting for a mini-batch, in the order they were read."""
        return self.book.pending

    @property
    def offsets(self) -> dict[str, int]:
        """Next offset per partition with every record before it handled: where a consumer seeks."""
        return self.book.offsets

    # --- partitions (a learner in a group keeps state per partition: ``server.learner.partitioned``) -------------
    scales_out = False
    refusal: str | None = None
    """Why learning must stop (a learner in a group: a state of another model on the state topic)."""

    def assign_partitions(self, keys: list[str]) -> None:
        """Partitions assigned to this learner: its checkpoint already holds where each one stands."""

    def revoke_partitions(self, keys: list[str]) -> None:
        """Partitions taken away (after a checkpoint): the checkpoint keeps them, nothing to do."""

    def _adopt_partition(self, key: str, offset: int, learned: dict[str, list[int]]) -> None:
        """Book a partition taken over at ``offset``, with the ids its earlier owners learned from it."""
        self.book.adopt(key, offset, learned)

    def _drop_partition(self, key: str) -> None:
        """Let a partition go from the book (its records are all learned and persisted)."""
        self.book.drop(key)

    def _moved_partitions(self) -> list[tuple[str, int, dict[str, list[int]]]]:
        """(partition, next offset, learned ids) of each partition whose offset moved since the last capture;
        they count as saved from here (a learner in a group writes them to its state topic)."""
        moved = [(key, *self.book.partition(key)) for key in self.book.unsaved_keys()]
        self.book.mark_saved(self.book.offsets)
        return moved

    # --- learning -------------------------------------------------------------------------------------------
    @property
    def batch_limit(self) -> int:
        """The most samples the next mini-batch may hold: the learner's batch size, cut at the next scheduled
        any-time evaluation so that it runs exactly there, as in ``mepo evaluate``."""
        if self.evaluation is None:
            return self.cfg.learner.batch_size
        return self.evaluation.room(self.learner, self.cfg.learner.batch_size)

    def groups(self, pending: list[Pending]) -> list[list[Pending]]:
        """The pending records as the groups mini-batches are cut from, in order: one group here (mini-batches may
        span partitions); a learner in a group learns each partition on its own (``server.learner.partitioned``)."""
        return [pending]

    def learn(self, batch: list[Sample]) -> None:
        """Test-then-train one mini-batch and run a due evaluation (in the model thread), then show the new
        version: ``version`` and ``samples_seen`` move only once the step is whole, so a reader who sees them sees
        the model behind them."""
        self.model_thread.run(self._learn, batch)

    def _learn(self, batch: list[Sample]) -> None:
        images = stack_images([s.image for s in batch], self.learner.device)  # [B, 3, S, S] uint8, pinned on CUDA
        labels = torch.tensor([s.meta.label for s in batch])
        with self._lock:
            start = time.perf_counter()
            self._step(images, labels, batch)
            self.book.mark_learned(batch)
            self._since_checkpoint += len(batch)
            self.metrics.step_seconds.observe(time.perf_counter() - start)
            self._changed()
        self._announce(len(batch))

    def _changed(self) -> None:
        """The model changed: run the evaluations now due, then move ``version`` and ``samples_seen``."""
        while self.evaluation is not None and (results := self.evaluation.after_batch(self.learner)):
            self.metrics.anytime_evals.inc()
            self.class_accuracy = results[self.cfg.alignment.inference_mode][1]
        self.version, self.samples_seen = self._next_version(), self.learner.samples_seen

    def _next_version(self) -> int:
        return self.version + 1

    def _announce(self, learned: int) -> None:
        """Tell the publisher and the metrics of a new version (``learned`` samples learned here for it)."""
        if self.on_learned is not None:
            self.on_learned()
        if learned:
            self.last_learned_time = time.time()
            self.metrics.learn_steps.inc()
            self.metrics.samples_learned.inc(learned)
        self._export()

    def _step(self, images: torch.Tensor, labels: torch.Tensor, batch: list[Sample]) -> None:
        """The learner's step on one mini-batch; its test-then-train predictions feed the drift monitor."""
        seen_before = self.learner.samples_seen
        if not self.cfg.prequential:
            self.learner.observe(images, labels)
            return
        self._monitor(labels, self.learner.test_then_train(images, labels, self.cfg.alignment.inference_mode),
                      seen_before)

    def _monitor(self, labels: torch.Tensor, pred: torch.Tensor | None, seen_before: int) -> None:
        """Feed the test-then-train predictions (None before any class is known) to the drift monitor."""
        if pred is None:
            return
        for event in self.monitor.update(labels.tolist(), pred.tolist(), seen_before):
            self.metrics.drift.labels(event["detector"]).inc()
            log.warning("drift detected at %d samples by %s", event["samples_seen"], event["detector"])

    def evaluate_now(self) -> float:
        """Accuracy where the stream went idle (A_last of the stream so far), in the served alignment mode."""
        return self.model_thread.run(self._evaluate_now)

    def _evaluate_now(self) -> float:
        if self.evaluation is None or not self.learner.exposed:
            return math.nan
        with self._lock:
            acc, self.class_accuracy = self.evaluation.end_of_task(self.learner)[self.cfg.alignment.inference_mode]
            self._idle_eval_at = self.learner.samples_seen
        self._export()
        return acc

    @property
    def curve(self) -> AnytimeCurve:
        """The any-time accuracy curve of the stream so far (empty without a test set)."""
        mode = self.cfg.alignment.inference_mode
        return AnytimeCurve() if self.evaluation is None else self.evaluation.curves[mode]

    @property
    def checkpoint_due(self) -> bool:
        return self._since_checkpoint >= self.cfg.checkpoint_every

    @property
    def unsaved(self) -> bool:
        """A checkpoint now would differ from the last one: samples learned or offsets moved since."""
        return self._since_checkpoint > 0 or self.book.offsets_unsaved

    @property
    def idle_evaluation_due(self) -> bool:
        """The stream went idle after new learning: measure the accuracy there (A_last of the stream so far)."""
        return (self.evaluation is not None and bool(self.learner.exposed)
                and self._idle_eval_at != self.learner.samples_seen)

    # --- checkpoints ----------------------------------------------------------------------------------------
    def capture(self) -> dict:
        """A copy of everything a checkpoint holds, consistent (taken between two steps, in the model thread)
        and detached (learning on changes none of it), so ``write`` may run while the learner goes on; the book
        counts its offsets as saved from here (a failed write stops the loop)."""
        return self.model_thread.run(self._capture)

    def _capture(self) -> dict:
        with self._lock:
            state = copy.deepcopy({
                "format": CHECKPOINT_FORMAT, "learner": self.learner.state_dict(),
                "monitor": self.monitor.state_dict(), "version": self.version,
                **self.book.state_dict(), "time": time.time(),
                "anytime": None if self.evaluation is None else self.evaluation.state_dict(),
                "rng": torch.get_rng_state(),  # the augmentation draws continue as if nothing had happened
            })
            self.book.mark_saved(state["offsets"])
            self._since_checkpoint = 0
        return state

    def write(self, state: dict) -> dict[str, int]:
        """Write what ``capture`` took, atomically (temporary file, fsync, rename); returns its offsets."""
        start = time.perf_counter()
        save_checkpoint(self.checkpoint_path, state)
        self.last_checkpoint_time = state["time"]
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - start)
        self.metrics.last_checkpoint.set(self.last_checkpoint_time)
        return state["offsets"]

    def restore(self) -> None:
        if not self.checkpoint_path.is_file():
            return
        state = read_checkpoint(self.checkpoint_path)
        self.learner.load_state_dict(state["learner"])
        self.monitor.load_state_dict(state["monitor"])
        self.version, self.samples_seen = int(state["version"]), self.learner.samples_seen
        self.book.load_state_dict(state)
        if self.evaluation is not None and state["anytime"] is not None:
            self.evaluation.load_state_dict(state["anytime"])
            self.class_accuracy = dict(next(reversed(self.curve.task_class_accuracy), {}))
        torch.set_rng_state(state["rng"])
        self.last_checkpoint_time = float(state["time"])
        log.info("restored checkpoint %s: %d samples learned, offsets %s", self.checkpoint_path,
                 self.learner.samples_seen, self.book.offsets)

    # --- reporting ------------------------------------------------------------------------------------------
    def _export(self) -> None:  # pragma: no mutate block (reporting: tests/test_deploy.py, test_streaming.py)
        m = self.metrics
        m.seen_classes.set(len(self.learner.exposed))
        m.model_version.set(self.version)
        if self.monitor.total:
            m.prequential.set(self.monitor.cumulative)
            m.rolling.set(self.monitor.rolling)
        curve = self.curve
        if curve.accuracy:
            m.anytime.set(curve.accuracy[-1])
            m.a_auc.set(curve.a_auc)
        if curve.task_accuracy:
            m.last_accuracy.set(curve.a_last)
        for c, acc in self.class_accuracy.items():
            m.class_accuracy.labels(self.class_names.get(c, str(c))).set(acc)
        if not math.isnan(self.last_learned_time):
            m.last_learned.set(self.last_learned_time)

    def status(self) -> dict:  # pragma: no mutate block (reporting: tests/test_streaming.py, test_page.py)
        b, curve = self.book, self.curve
        return {
            "samples_seen": self.samples_seen,
            "classes_seen": len(self.learner.exposed),
            "model_version": self.version,
            "anytime_accuracy": {"last": curve.accuracy[-1] if curve.accuracy else None,
                                 "a_auc": curve.a_auc if curve.accuracy else None,
                                 "evaluations": len(curve.accuracy), "samples": curve.samples,
                                 "accuracy": curve.accuracy},
            "a_last": curve.a_last if curve.task_accuracy else None,
            "prequential_accuracy": {"cumulative": self.monitor.cumulative if self.monitor.total else None,
                                     "rolling": self.monitor.rolling if self.monitor.total else None,
                                     "samples": self.monitor.total},
            "drift_events": self.monitor.events,
            "dead_lettered": b.dead_lettered,
            "replays_skipped": b.replays_skipped,
            "checkpoint_age_seconds": None if math.isnan(self.last_checkpoint_time)
            else round(time.time() - self.last_checkpoint_time, 1),
            "idle_seconds": None if math.isnan(self.last_learned_time)
            else round(time.time() - self.last_learned_time, 1),
            "class_accuracy": {self.class_names.get(c, str(c)): acc for c, acc in sorted(self.class_accuracy.items())},
        }
