"""The learner's state: the learning step over the concerns it composes, and a learner alone's checkpoint file.

As Kafka Streams splits a stateful task: the intake (``server.learner.intake``) books each record, the learning
step (``LearnerState``) learns pending samples in the model thread, the ``Evaluator`` runs the any-time evaluations,
and a ``Membership`` persists: ``Alone`` (a checkpoint file) or ``InGroup`` (``server.learner.partitioned``, partition
states in the state topic), both answering the same verbs. ``open_learner`` and ``open_group_learner`` restore.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from itertools import groupby
from pathlib import Path
from typing import Protocol

import torch

from mepo_stream.anytime import AnytimeEvaluation
from mepo_stream.backbone import device
from mepo_stream.checkpoint import LearnerCheckpoint
from mepo_stream.data import list_files, load_split
from mepo_stream.errors import StateRefused
from mepo_stream.learner import OnlineLearner
from mepo_stream.methods.base import Encoded
from mepo_stream.model import create_model
from mepo_stream.novelty import NoveltyThreshold, resolve
from server.config import ServeConfig, model_config
from server.learner.book import Pending, Sample, StreamBook
from server.learner.corrections import Corrections, ModelEdits
from server.learner.evaluation import Evaluator
from server.learner.intake import Intake, Outgoing
from server.learner.monitor import StreamMonitor
from server.learner.reporter import StateReporter
from server.learner.sample_table import SampleTable
from server.learner.staging import stack_images
from server.learner.view import GroupView, LearnerView, join_summary
from server.metrics import ServerMetrics
from server.model_thread import ModelThread
from server.snapshot import Snapshot, take_snapshot
from server.snapshot_topic import Origin
from server.state_topic import PartitionState

log = logging.getLogger(__name__)
CHECKPOINT = "learner.pt"


class StateWriteFailed(RuntimeError):
    """A failed state write stops the learner (a ``KafkaError`` reconnects): nothing was committed past it."""

    def __init__(self, offsets: dict[str, int], cause: BaseException):
        where = ", ".join(f"{key} at offset {offset}" for key, offset in sorted(offsets.items())) or "no partition"
        why = str(cause) if str(cause).startswith(type(cause).__name__) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"the state write of {where} failed ({why}); the learner stops: "
                         f"nothing was committed past its last written state, a restart resumes from there")
        self.offsets = dict(offsets)


@dataclass(frozen=True)
class Capture:
    """What one write persists, copied between two steps in the model thread so the write may run meanwhile."""

    offsets: dict[str, int]  # the next offset to read per ``topic:partition``: safe to commit once written
    time: float  # wall time it was taken


@dataclass(frozen=True)
class CheckpointCapture(Capture):
    """A learner alone's: the content of its checkpoint file (model, offsets and learned ids together)."""

    checkpoint: LearnerCheckpoint


@dataclass(frozen=True)
class Restored:
    """What a restore brings back: the version to show, and a learner alone's checkpoint to load."""

    version: int
    checkpoint: LearnerCheckpoint | None = None


@dataclass(frozen=True)
class Adopted:
    """A partition a learner in a group takes over: where it stands, and its sample table (corrections on)."""

    key: str
    offset: int
    learned: dict[str, list[int]]
    table: SampleTable | None = None
    changes: dict[str, int] | None = None  # the counts of the corrections its state includes
    stale: bool = False  # its changelog holds writes its state does not include: written again at the next capture


@dataclass(frozen=True)
class Incoming:
    """A rebalance's read: every partition's newest state, the assigned ones' sample tables (and whether stale)."""

    states: dict[str, PartitionState]
    tables: dict[str, tuple[SampleTable, bool]]


@dataclass(frozen=True)
class Booked:
    """What a booking hands the loop, copied in the model thread: the loop never reads the model thread's state."""

    outgoing: list[Outgoing]  # dead letters and predictions, sent before the next checkpoint
    learns: bool  # the model thread goes on to learn everything pending (the loop polls meanwhile)
    waiting: Counter[str]  # records waiting for a mini-batch after the booking, per partition
    limit: int  # the next mini-batch's size (``LearnerState.batch_limit``)
    changes_waiting: bool  # a correction or deletion waits for its turn (``changes_waiting``)
    checkpoint_due: bool  # the periodic checkpoint is due (``checkpoint_due``, with the writer idle)


def runs_of_samples(samples: list[Sample]) -> list[list[Sample]]:
    """The pending samples cut into runs of samples (to learn in mini-batches) and runs of changes.

    Samples first, then changes: a change between two samples would cut their mini-batch in two (each costs its
    test-then-train solves), and the model is a sum. In order only where a change names a later sample (an id
    deleted, then received again)."""
    changes = [s for s in samples if s.change is not None]
    named = {s.change.id for s in changes if s.change is not None}
    first = next((i for i, s in enumerate(samples) if s.change is not None), len(samples))
    later = {s.joined.id if s.joined is not None else s.meta.id for s in samples[first:] if s.change is None}
    if not named & later:
        return [run for run in ([s for s in samples if s.change is None], changes) if run]
    return [list(run) for _, run in groupby(samples, key=lambda s: s.change is None)]


def build_learner(cfg: ServeConfig, n_classes: int) -> OnlineLearner:
    """The learner around the model ``cfg`` builds, scoring novelty and calibrating its threshold on the stream."""
    learner = OnlineLearner(create_model(model_config(cfg), n_classes, device()), cfg.learner)
    learner.novelty_score = cfg.novelty.score
    learner.novelty_threshold = NoveltyThreshold(cfg.novelty.false_alarm, cfg.novelty.half_life)
    return learner


class Membership(Protocol):
    """Where a learner alone's or a group's state persists and how its steps are cut; every call but ``read``,
    ``group_view`` and the following runs in the model thread, returning what the state applies."""

    def new_book(self, learn_replays: bool) -> StreamBook: ...
    def restore(self, learner: OnlineLearner, origin: Origin) -> Restored | None: ...
    def groups(self, pending: list[Pending]) -> list[tuple[str | None, list[Pending]]]: ...
    def update(self, learner: OnlineLearner, images: torch.Tensor, labels: torch.Tensor, encoded: Encoded | None,
               key: str | None, positions: torch.Tensor) -> torch.Tensor | None: ...
    def edits(self, learner: OnlineLearner, key: str | None) -> ModelEdits: ...
    def check_assignment(self, images: set[int], everything: set[int] | None) -> StateRefused | None: ...
    def next_version(self, version: int) -> int: ...
    def capture(self, checkpoint: Callable[[], LearnerCheckpoint], moved: list[tuple[str, int | None, dict]],
                corrections: Corrections | None) -> Capture: ...
    def write(self, captured: Capture, corrections: Corrections | None) -> None: ...
    def read(self, keys: list[str], corrections: Corrections | None) -> Incoming | None: ...
    def adopt(self, learner: OnlineLearner, keys: list[str], incoming: Incoming) -> list[Adopted]: ...
    def revoke(self, learner: OnlineLearner, keys: list[str]) -> list[str]: ...
    def merge(self, learner: OnlineLearner, remote: PartitionState) -> bool: ...
    def group_view(self) -> GroupView | None: ...
    def start_following(self, lag: dict[str, int], on_state: Callable[[PartitionState], None],
                        on_error: Callable[[StateRefused], None]) -> None: ...
    def stop_following(self) -> None: ...


def watch_drift(monitor: StreamMonitor, metrics: ServerMetrics, labels: torch.Tensor, pred: torch.Tensor | None,
                seen_before: int) -> None:
    """Feed the test-then-train predictions (None before any class is known) to the drift monitor."""
    if pred is None:
        return
    for event in monitor.update(labels.tolist(), pred.tolist(), seen_before):
        metrics.drift.labels(event["detector"]).inc()
        log.warning("drift detected at %d samples by %s", event["samples_seen"], event["detector"])


def checkpoint_due(s: LearnerState) -> bool:
    """``--checkpoint_every`` samples learned since the last capture, ``--checkpoint_min_interval_s`` ago at least."""
    return (s.since_checkpoint >= s.cfg.checkpoint_every
            and time.monotonic() - s.captured_at >= s.cfg.checkpoint_min_interval_s)


def changes_waiting(s: LearnerState) -> bool:
    """A correction or deletion waits: learned once the topic goes quiet, not waiting to fill the mini-batch."""
    return s.intake.corrections is not None and any(p.sample.change is not None for p in s.intake.book.pending)


class LearnerState:
    """The learning step over its intake, evaluation and persistence, owned by the model thread."""

    def __init__(self, cfg: ServeConfig, metrics: ServerMetrics, model_thread: ModelThread, learner: OnlineLearner,
                 class_names: dict[int, str], origin: Origin, evaluator: Evaluator, membership: Membership):
        self.cfg, self.metrics, self.model_thread, self.learner = cfg, metrics, model_thread, learner
        self.class_names, self.origin, self.evaluator = class_names, origin, evaluator
        self.lock = threading.Lock()  # the model thread writes under it; the HTTP threads' view reads under it
        self.intake = Intake(cfg, learner, class_names, metrics, model_thread, self.lock, lambda: self.version,
                             membership.new_book(cfg.learn_replays))
        self.monitor = StreamMonitor(cfg.monitor)
        self.version = 0
        self.samples_seen = 0  # of the last whole step (``learner.samples_seen`` moves inside the step)
        self.since_checkpoint = 0  # samples learned since the last capture
        self.captured_at = -math.inf  # time.monotonic() of the last capture
        self.last_checkpoint_time = math.nan
        self.last_learned_time = math.nan  # wall time of the last learned mini-batch (not checkpointed)
        self.on_learned: Callable[[], None] | None = None  # told of every new version (the publisher)
        self.reporter = StateReporter(self.view, metrics)
        self.membership = membership
        self.refusal: StateRefused | None = None  # why learning must stop (another model's state): the loop raises it
        self._snapshot: Snapshot | None = None

    @property
    def snapshot(self) -> Snapshot:
        """The newest version, made on demand in the model thread: not on every mini-batch (docs/performance.md)."""
        if self._snapshot is not None and self._snapshot.version == self.version:
            return self._snapshot
        return self._fresh() if self.model_thread.owns() else self.model_thread.run(self._fresh)

    def _fresh(self) -> Snapshot:
        self.model_thread.check()
        with self.lock:
            if self._snapshot is None or self._snapshot.version != self.version:
                self._snapshot = take_snapshot(self.learner, self.version, self.cfg.alignment.inference_mode,
                                               self.learner.novelty_score)
            return self._snapshot

    def view(self) -> LearnerView:
        """A typed, read-only copy of what the reporter shows."""
        m, book = self.monitor, self.intake.book
        return LearnerView(
            self.samples_seen, self.version, len(self.learner.exposed), self.class_names, self.evaluator.curve,
            dict(self.evaluator.class_accuracy), self.evaluator.idle_due(self.learner), m.total, m.cumulative,
            m.rolling, list(m.events), book.dead_lettered, book.replays_skipped, self.last_checkpoint_time,
            self.last_learned_time, join_summary(self.intake.join), self.membership.group_view(),
            None if self.intake.corrections is None else self.intake.corrections.summary(), self._novelty())

    def _novelty(self) -> dict:
        score = resolve(self.learner.method.classifier, self.learner.novelty_score)
        with self.lock:  # the model thread moves it
            threshold = self.learner.novelty_threshold
            assert threshold is not None  # ``build_learner`` sets one
            value, detection = threshold.threshold, threshold.detection()
        return {"score": score, "threshold": value if math.isfinite(value) else None,
                "false_alarm": threshold.false_alarm, "detection": None if math.isnan(detection) else detection}

    @property
    def offsets(self) -> dict[str, int]:
        """Next offset per partition with every record before it handled: where a consumer seeks."""
        return self.intake.book.offsets

    @property
    def batch_limit(self) -> int:
        """The learner's batch size, cut at the next scheduled any-time evaluation so it runs exactly there."""
        return self.evaluator.room(self.learner, self.cfg.learner.batch_size)

    def learn_pending(self) -> None:
        """Learn the pending records in mini-batches of at most ``batch_limit``, in one turn of the model thread."""
        self.model_thread.run(self._learn_pending)

    def accept(self, records: list) -> Booked:
        """Book one poll's records in the model thread, learning nothing."""
        return self.model_thread.run(self._book, records, True)

    def accept_then_learn(self, records: list, booked: Future[Booked], writer_idle: bool) -> None:
        """In the model thread: book ``records`` into ``booked``, then learn once a mini-batch is full or a poll came
        back empty; not where a checkpoint is due, so the capture queued behind this need not wait for a step."""
        try:
            result = self._book(records, writer_idle)
        except BaseException as e:
            booked.set_exception(e)
            raise
        booked.set_result(result)
        if result.learns:
            self._learn_pending()

    def _book(self, records: list, writer_idle: bool) -> Booked:
        self.model_thread.check()
        outgoing = self.intake.accept(records)
        waiting, limit = self.intake.waiting(), self.batch_limit
        pending, due = sum(waiting.values()), writer_idle and checkpoint_due(self)
        learns = (pending >= limit and not due) or bool(pending and not records)
        return Booked(outgoing, learns, waiting, limit, changes_waiting(self), due)

    def _learn_pending(self) -> None:
        self.model_thread.check()
        for key, group in self.membership.groups(self.intake.book.pending):
            for run in runs_of_samples([p.sample for p in group]):
                while run:  # corrections and deletions in a row: one version
                    n = len(run) if run[0].change is not None else self.batch_limit
                    self.learn(run[:n], key)
                    run = run[n:]
        if (corrections := self.intake.corrections) is not None:  # the disk stays bounded without any correction
            corrections.expire(self.intake.stream_time)

    def learn(self, batch: list[Sample], key: str | None = None) -> None:
        """Test-then-train one mini-batch (of partition ``key``), or apply a run of changes, as one version: ``version``
        and ``samples_seen`` move only once the step is whole."""
        self.model_thread.check()
        if batch[0].change is not None:
            assert self.intake.corrections is not None
            with self.lock:
                model = self.membership.edits(self.learner, key)
                for s in batch:
                    assert s.change is not None  # a run of changes holds nothing else (``runs_of_samples``)
                    self.intake.corrections.apply(s.change, self.intake.join, model, key)
                self.intake.learned(batch)
                self.since_checkpoint += 1
                self.changed()
            self.announce(0)
            return
        labels, start = torch.tensor([s.label for s in batch]), time.perf_counter()
        kept = [s.feature for s in batch if s.feature is not None]  # at arrival (labels that come later): all or none
        images = None if kept else stack_images([s.image for s in batch if s.image is not None],
                                                self.learner.device)  # [B, 3, S, S]
        encoded: Encoded | None = None
        if images is not None and not self.learner.trains_by_gradient:  # answering predictions between its blocks
            encoded = self.learner.encode(images, self.model_thread.answer_waiting)
        with self.lock:
            seen_before = self.learner.samples_seen
            if kept:
                self.learner.observe_features(torch.stack(kept), labels)  # [B, D]
                scored = [(s.label, s.prediction) for s in batch if s.prediction is not None]
                labels, pred = torch.tensor(scored).T if scored else (labels, None)  # the predictions at arrival
            else:  # the learner's own forward where it trains by gradient; else the encoding above
                assert images is not None
                positions = torch.tensor([s.meta.sample_index for s in batch])  # [B]
                pred = self.membership.update(self.learner, images, labels, encoded, key, positions)
            if self.cfg.prequential:
                watch_drift(self.monitor, self.metrics, labels, pred, seen_before)
            self.intake.learned(batch, None if kept or encoded is None else encoded.feature, key)
            self.since_checkpoint += len(batch)
            self.metrics.step_seconds.observe(time.perf_counter() - start)
            self.changed()
        self.announce(len(batch))

    def restore(self) -> None:
        """Restore what the membership persisted, and show its version."""
        self.model_thread.check()
        restored = self.membership.restore(self.learner, self.origin)
        if (saved := None if restored is None else restored.checkpoint) is not None:
            self._load(saved)
        elif self.intake.corrections is not None and not self.intake.corrections.by_partition:
            self.intake.corrections.restore(None)
        if restored is not None:
            self.version, self.samples_seen = restored.version, self.learner.samples_seen

    def _load(self, saved: LearnerCheckpoint) -> None:
        try:
            self.learner.load_state_dict(saved.learner)
        except StateRefused as e:  # tensors of another model
            raise StateRefused(f"{self.cfg.checkpoint_dir / CHECKPOINT} was written by another model than these "
                               f"options build (start with the options that wrote it, or move it away to learn "
                               f"from scratch): {e}") from e
        self.monitor.load_state_dict(saved.monitor)
        self.intake.restore(saved.position)
        if self.intake.corrections is not None:
            self.intake.corrections.restore(saved.corrections)
        self.evaluator.load_state_dict(saved.anytime)
        torch.set_rng_state(saved.rng)
        self.last_checkpoint_time = saved.time
        log.info("restored checkpoint %s: %d samples learned, offsets %s", self.cfg.checkpoint_dir / CHECKPOINT,
                 saved.samples_seen, saved.position.offsets)

    def changed(self) -> None:
        """The model changed: run the evaluations now due, then move ``version`` and ``samples_seen``."""
        self.metrics.anytime_evals.inc(self.evaluator.after_batch(self.learner))
        self.version, self.samples_seen = self.membership.next_version(self.version), self.learner.samples_seen

    def announce(self, learned: int) -> None:
        """Tell the publisher and the metrics of a new version (``learned`` samples learned here for it)."""
        if self.on_learned is not None:
            self.on_learned()
        if learned:
            self.last_learned_time = time.time()
            self.metrics.learn_steps.inc()
            self.metrics.samples_learned.inc(learned)
        self.reporter.export()

    def on_idle(self) -> None:
        """The topic is drained: snapshot the newest version, and measure A_last once per stretch of learning."""
        self.model_thread.run(self._idle)

    def _idle(self) -> None:
        self.model_thread.check()
        self._fresh()
        if self.evaluator.idle_due(self.learner):
            with self.lock:
                self.evaluator.evaluate_idle(self.learner)
            self.reporter.export()

    def reread(self) -> None:
        """Forget what was read and not learned: the loop reads it again from ``positions``."""
        self.model_thread.run(self.intake.reread)

    def positions(self, keys: list[str]) -> dict[str, int]:
        """Where each of these partitions stands in the book (the next offset to read): where a consumer seeks."""
        return self.model_thread.run(lambda: {k: o for k, o in self.intake.book.offsets.items() if k in keys})

    def capture(self) -> Capture | None:
        """A copy of what the membership persists (None: unchanged); the book counts its offsets as saved from here."""
        return self.model_thread.run(self._capture)

    def _capture(self) -> Capture | None:
        self.model_thread.check()
        if not (self.since_checkpoint > 0 or self.intake.book.unsaved_keys()):
            return None
        book = self.intake.book
        with self.lock:
            moved = [(key, *book.partition(key)) for key in book.unsaved_keys()]
            self.learner.flush_novelty()  # the scores waiting for the calibration are in the states captured
            captured = self.membership.capture(self._checkpoint, moved, self.intake.corrections)
            book.mark_saved(book.offsets)
            self.since_checkpoint, self.captured_at = 0, time.monotonic()
        return captured

    def _checkpoint(self) -> LearnerCheckpoint:
        """A detached copy of everything a learner alone's checkpoint holds."""
        corrections = self.intake.corrections  # its table's changes are on disk before the checkpoint naming them
        return copy.deepcopy(LearnerCheckpoint(
            self.learner.state_dict(), self.version, time.time(), self.intake.position(), self.monitor.state_dict(),
            self.evaluator.state_dict(), torch.get_rng_state(),
            None if corrections is None else corrections.checkpoint()))

    def write(self, captured: Capture) -> dict[str, int]:
        """Persist what ``capture`` took; returns its offsets, or raises ``StateWriteFailed`` and unsaves them."""
        start = time.perf_counter()
        try:
            self.membership.write(captured, self.intake.corrections)
        except Exception as e:
            self.intake.book.mark_saved(captured.offsets, failed=True)
            raise StateWriteFailed(captured.offsets, e) from e
        self.last_checkpoint_time = captured.time
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - start)
        self.metrics.last_checkpoint.set(self.last_checkpoint_time)
        return captured.offsets

    def assign(self, keys: list[str]) -> None:
        """Partitions assigned (the rebalance's thread): read their states here, adopt them in the model thread."""
        if (incoming := self.membership.read(keys, self.intake.corrections)) is not None:
            self.model_thread.run(self._adopt, keys, incoming)

    def _adopt(self, keys: list[str], incoming: Incoming) -> None:
        self.model_thread.check()
        book, corrections = self.intake.book, self.intake.corrections
        with self.lock:
            for p in self.membership.adopt(self.learner, keys, incoming):
                book.adopt(p.key, p.offset, p.learned)
                if corrections is not None and p.table is not None:
                    corrections.adopt(p.key, p.table, p.changes or {})
                if p.stale:  # written out again at the next capture, under this owner's epoch
                    book.mark_saved({p.key: p.offset}, failed=True)
            self.changed()
        log.info("learning partitions %s from offsets %s", sorted(book.offsets), book.offsets)
        self.announce(0)

    def revoke(self, keys: list[str]) -> None:
        """Partitions taken away, persisted just before: the membership, book and sample tables let them go."""
        self.model_thread.run(self._let_go, keys)

    def _let_go(self, keys: list[str]) -> None:
        self.model_thread.check()
        with self.lock:
            for key in self.membership.revoke(self.learner, keys):
                self.intake.book.drop(key)
                if self.intake.corrections is not None and self.intake.corrections.by_partition:
                    self.intake.corrections.drop(key)
        self.reporter.export()

    def merge_remote(self, remote: PartitionState) -> None:
        """Another learner's newer state of a partition (the follower's thread), merged in the model thread."""
        self.model_thread.run(self._merge, remote)

    def _merge(self, remote: PartitionState) -> None:
        self.model_thread.check()
        try:
            with self.lock:
                if not self.membership.merge(self.learner, remote):
                    return
                self.changed()
        except StateRefused as e:
            self.refusal = e
            return
        self.metrics.state_merges.inc()
        self.announce(0)

    def start_following(self, lag: dict[str, int]) -> None:
        """Follow the group's other learners (``lag``: the loop's, per partition, which partition states report)."""
        self.membership.start_following(lag, self.merge_remote, partial(self.model_thread.run, self._refuse))

    def _refuse(self, refused: StateRefused) -> None:
        self.refusal = refused


class Alone:
    """One learner over the whole topic: its checkpoint file holds model, offsets and learned ids together."""

    def __init__(self, path: Path, cfg: ServeConfig):
        self.path, self.cfg = path, cfg

    def new_book(self, learn_replays: bool) -> StreamBook:
        return StreamBook(learn_replays=learn_replays)

    def restore(self, learner: OnlineLearner, origin: Origin) -> Restored | None:
        """The checkpoint file, if there is one, for the state to load."""
        if not self.path.is_file():
            return None
        saved = LearnerCheckpoint.load(self.path)
        return Restored(saved.version, saved)

    def groups(self, pending: list[Pending]) -> list[tuple[str | None, list[Pending]]]:
        """Mini-batches may mix every partition's records."""
        return [(None, pending)]

    def update(self, learner: OnlineLearner, images: torch.Tensor, labels: torch.Tensor, encoded: Encoded | None,
               key: str | None, positions: torch.Tensor) -> torch.Tensor | None:
        """Score the batch's novelty, then fold it into the model; returns its test-then-train predictions (or None)."""
        if not self.cfg.prequential:  # scored for the novelty threshold all the same, before it is learned
            learner.observe_novelty(learner.encode(images) if encoded is None else encoded, labels)
            learner.observe(images, labels, encoded)
            return None
        return learner.test_then_train(images, labels, self.cfg.alignment.inference_mode, encoded)

    def edits(self, learner: OnlineLearner, key: str | None) -> ModelEdits:
        """Changes are learned in the model itself."""
        return learner

    def check_assignment(self, images: set[int], everything: set[int] | None) -> StateRefused | None:
        """A learner alone must have the whole topic (None: it has, or the partitions are not known yet)."""
        if not everything or images == everything:
            return None
        kafka = self.cfg.kafka
        return StateRefused(f"another learner joined consumer group {kafka.group_id!r} and took some of "
                            f"{kafka.topic}'s partitions: each would learn a part of the stream into a model "
                            f"of its own. Learning in several processes needs --kafka.state_topic (docs: Scale-out), "
                            f"and a model whose sums add up")

    def next_version(self, version: int) -> int:
        return version + 1

    def capture(self, checkpoint: Callable[[], LearnerCheckpoint], moved: list[tuple[str, int | None, dict]],
                corrections: Corrections | None) -> CheckpointCapture:
        saved = checkpoint()
        return CheckpointCapture(saved.position.offsets, saved.time, saved)

    def write(self, captured: Capture, corrections: Corrections | None) -> None:
        """Write the copy atomically (temporary file, fsync, rename)."""
        assert isinstance(captured, CheckpointCapture)  # what this membership's capture took
        captured.checkpoint.save(self.path)
        if corrections is not None and captured.checkpoint.corrections is not None:
            corrections.settle(captured.checkpoint.corrections)

    def read(self, keys: list[str], corrections: Corrections | None) -> None:
        """The checkpoint already holds where each assigned partition stands."""

    def adopt(self, learner: OnlineLearner, keys: list[str], incoming: Incoming) -> list[Adopted]:
        return []

    def revoke(self, learner: OnlineLearner, keys: list[str]) -> list[str]:
        """Partitions taken away (after a checkpoint): the checkpoint keeps them, nothing to let go."""
        return []

    def merge(self, learner: OnlineLearner, remote: PartitionState) -> bool:
        """A learner alone follows no state topic: a partition state reaching it is a wiring error."""
        raise RuntimeError(f"a learner alone got {remote.key}'s state from a group's state topic")

    def group_view(self) -> None:
        return None

    def start_following(self, lag: dict[str, int], on_state: Callable[[PartitionState], None],
                        on_error: Callable[[StateRefused], None]) -> None:
        """A learner alone follows no other learner."""

    def stop_following(self) -> None:
        """Nothing followed, nothing to stop."""


def open_learner(cfg: ServeConfig, metrics: ServerMetrics, model_thread: ModelThread | None = None,
                 membership: Membership | None = None) -> LearnerState:
    """Build the learner and restore what ``membership`` persisted (default: its checkpoint), in the model thread."""
    model_thread = model_thread or ModelThread()
    return model_thread.run(_open, cfg, metrics, model_thread, membership)


def _open(cfg: ServeConfig, metrics: ServerMetrics, model_thread: ModelThread, membership: Membership | None
          ) -> LearnerState:
    listing = list_files(cfg.data, "train")
    class_names = dict(enumerate(listing.class_names))
    evaluation = None
    model = model_config(cfg)
    learner = build_learner(cfg, len(listing.classes))
    if cfg.protocol.eval_period > 0:  # the schedule, scoring and curve of `mepo evaluate`, in the served mode
        size = cfg.limits.at(learner.method.input_size).size
        test = load_split(replace(cfg.data, load_size=size), "test")  # decoded as records are (``Intake.limits``)
        evaluation = AnytimeEvaluation(test, cfg.protocol.eval_period, cfg.protocol.eval_batch_size,
                                       (cfg.alignment.inference_mode,))
    names = tuple(class_names[label] for label in range(len(class_names)))
    origin = Origin(cfg.model_name, model.to_json(), names, learner.method.backbone_sha256, model.mepo.sha256())
    state = LearnerState(cfg, metrics, model_thread, learner, class_names, origin,
                         Evaluator(evaluation, cfg.alignment.inference_mode),
                         membership or Alone(cfg.checkpoint_dir / CHECKPOINT, cfg))
    state.restore()
    metrics.info.info({"backbone": cfg.backbone.name, "mepo_bundle": str(cfg.mepo or ""), "method": cfg.method,
                       "n_classes": str(len(class_names))})
    state.reporter.export()
    return state
