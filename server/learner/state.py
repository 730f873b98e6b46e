"""The learner's state, the one owner of a record's life: claim, decode, book, learn, and checkpoint capture.

No Kafka here: ``server.learner.stream`` polls the records and hands them to ``accept``, which claims each sample
id in the ``StreamBook`` (``server.learner.book``) before its image is decoded, and books each record in offset
order as pending, a skipped replay or a dead letter (the loop sends those to the dead-letter topic).
``learn_pending`` learns the pending samples in mini-batches and marks them learned in the same step;
``capture`` takes a consistent checkpoint, which ``write`` puts on disk. A checkpoint holds the trainable state,
optimizer, seen classes, running alignment statistics, monitor state, any-time history, the learned sample ids
per stream, and the next offset per partition, so model and offsets roll back together. Status and metrics are
read by the state's ``reporter`` (``server.learner.reporter``).

Labels that come later (``--kafka.labels_topic``): the loop also reads the labels topic. Every image of a poll is
predicted as it arrives (``server.learner.arrival``); one without a label waits in the ``LabelJoin`` with its
feature (or its image) and its prediction, which goes to the predictions topic; a label waits there for its
image. The record that completes a join stays pending until the join is learned, and the join's state is in the
checkpoint with the model and both topics' offsets, so a crash neither learns a label twice nor drops one.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mepo_stream.anytime import AnytimeEvaluation
from mepo_stream.backbone import device
from mepo_stream.checkpoint import load_checkpoint, save_checkpoint
from mepo_stream.data import list_files, load_split
from mepo_stream.images import ImageError, decode_image
from mepo_stream.label_join import Joined, LabelJoin, Refused
from mepo_stream.learner import OnlineLearner
from mepo_stream.model import create_model
from mepo_stream.records import RecordError, RecordMeta, parse_headers, parse_label
from server.config import ServeConfig, model_config
from server.learner.arrival import Arrival, Prediction, arrive, kept_label
from server.learner.book import Pending, Sample, StreamBook, tp_key
from server.learner.monitor import StreamMonitor
from server.learner.reporter import StateReporter
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


@dataclass
class DeadLetter:
    """A record that cannot be learned, with the reason the dead-letter topic records."""

    record: object  # a kafka-python ConsumerRecord
    reason: str
    message: str


Outgoing = DeadLetter | Prediction
"""What ``accept`` hands back for the loop to send: dead letters, and predictions of images without a label."""


@dataclass
class _Claimed:
    """A record whose sample id is claimed (an image without a label: none) and whose image is being decoded."""

    meta: RecordMeta
    image: Future  # of a uint8 [3, S, S] tensor, or an ImageError (the claim is then given back)


@dataclass(frozen=True)
class _Label:
    """A record of the labels topic, validated."""

    id: str
    label: int


def build_learner(cfg: ServeConfig, n_classes: int) -> OnlineLearner:
    """The learner around the model the factory builds from ``cfg`` (every part of the MePo bundle it has)."""
    return OnlineLearner(create_model(model_config(cfg), n_classes, device()), cfg.learner)


class ServiceState:
    """Shared by the learner thread (writes) and request handlers (read the published snapshot)."""

    scales_out = False
    """A learner in a group keeps state per partition (``server.learner.partitioned``)."""
    refusal: str | None = None
    """Why learning must stop (a learner in a group: a state of another model on the state topic)."""
    reporter_class: type[StateReporter] = StateReporter

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
        self.checkpoint_path = cfg.checkpoint_dir / CHECKPOINT
        names = tuple(self.class_names[label] for label in range(self.n_classes))
        model = model_config(cfg)
        self.origin = Origin(cfg.model_name, model.to_json(), names, self.learner.method.backbone_sha256,
                             model.mepo.sha256())
        """What this learner's snapshots and partition states share, and what a reader must match to use them."""
        self.on_learned: Callable[[], None] | None = None  # told of every new version (the publisher)
        self.monitor = StreamMonitor(cfg.monitor)
        self.book = StreamBook(learn_replays=cfg.learn_replays, by_partition=self.scales_out)  # written here only
        self.join = LabelJoin(cfg.join) if cfg.kafka.labels_topic is not None else None
        """Images waiting for labels that come later and labels waiting for images (None: labels come attached)."""
        self.stream_time = 0.0  # the newest record timestamp read (s): the join's clock
        self.version = 0
        self.last_checkpoint_time = math.nan
        self.last_learned_time = math.nan  # wall time of the last learned mini-batch (not checkpointed)
        self.class_accuracy: dict[int, float] = {}  # per class id, of the latest evaluation
        self.idle_evaluated_at = -1  # samples seen at the last evaluation where the stream went idle
        self.lock = threading.Lock()  # one writer at a time: the learner thread, or kafka-python's in a rebalance
        self.samples_seen = 0  # of the last whole step (``learner.samples_seen`` moves inside the step)
        self._since_checkpoint = 0
        self._restore()
        self._snapshot: Snapshot = take_snapshot(self.learner, self.version, self.cfg.alignment.inference_mode)
        self.reporter = self.reporter_class(self)
        metrics.info.info({"backbone": cfg.backbone.name, "mepo_bundle": str(cfg.mepo or ""),
                           "method": cfg.method, "n_classes": str(self.n_classes)})
        self.reporter.export()

    # --- serving ------------------------------------------------------------------------------------------
    @property
    def snapshot(self) -> Snapshot:
        """What predictions use: the learner's newest version, made now (in the model thread) if the learner
        moved on since the last one (a request during a step gets the version after it: one thread runs the
        model, ``server.model_thread``).

        Why on demand: making one solves the LDA and copies the trainable state, a few ms that a learner taking
        15 mini-batches a second would otherwise spend on every one of them, for snapshots nobody reads.
        """
        return self._snapshot if self._snapshot.version == self.version else self.model_thread.run(self._fresh)

    def _fresh(self) -> Snapshot:
        with self.lock:
            if self._snapshot.version != self.version:
                self._snapshot = take_snapshot(self.learner, self.version, self.cfg.alignment.inference_mode)
            return self._snapshot

    # --- a record's life: claim, decode, book ---------------------------------------------------------------
    def accept(self, records: list, decoder: Executor, meanwhile: Callable[[], None] | None = None
               ) -> list[Outgoing]:
        """Claim the records' sample ids in offset order, decode their images in ``decoder``, book the outcomes in
        offset order (pending, a skipped replay, or a dead letter); returns the dead letters (and, where labels
        come later, the predictions of images without one), for the loop to send before its next checkpoint.

        ``meanwhile`` (learning the pending mini-batch) runs while the pool decodes: the images of the next
        mini-batch are ready when the step ends. It learns only samples booked before these records, so the order,
        the claims and the offsets are those of decoding first and learning after. Every decode has finished
        before this returns, even on an error, so no late claim release can race a reconnect's ``reread``.
        """
        decoding: dict[tuple[str, int], Future] = {}
        try:
            claimed = [self._claim(record, decoder, decoding) for record in records]
            if meanwhile is not None:
                meanwhile()
            arrivals = self._arrive(claimed) if self.join is not None else {}
            booked = [self._book(record, outcome, arrivals.get(i))
                      for i, (record, outcome) in enumerate(zip(records, claimed, strict=True))]
            return [out for out in booked if out is not None] + self._expire()
        finally:
            wait(decoding.values())

    def _claim(self, record, decoder: Executor, decoding: dict[tuple[str, int | str], Future]
               ) -> _Claimed | _Label | RecordError | None:
        """Parse the headers and claim the sample id before decoding (None: a replay); a label record is only
        parsed, and an image without a label claims nothing (the join refuses a second image of its id).

        An earlier copy of the same sample among the records is waited for first: if its image is bad it has
        given the claim back by then, and this copy is learned, as when records are decoded one at a time.
        """
        try:
            if self.join is not None and record.topic == self.cfg.kafka.labels_topic:
                return _Label(*parse_label(record.headers, self.n_classes))
            meta = parse_headers(record.headers, self.n_classes, ids=self.join is not None)
        except RecordError as e:
            return e
        if meta.label is None:
            decoding[(meta.stream_id, meta.id)] = decoder.submit(self._decode, record, meta)
            return _Claimed(meta, decoding[(meta.stream_id, meta.id)])
        sample_id = (meta.stream_id, meta.sample_index)
        if sample_id in decoding:
            wait([decoding[sample_id]])
        if not self.book.claim(*sample_id):  # learned or in flight: a replay
            return None
        decoding[sample_id] = decoder.submit(self._decode, record, meta)
        return _Claimed(meta, decoding[sample_id])

    def _decode(self, record, meta: RecordMeta) -> torch.Tensor:
        """The record's image; a bad one gives its claim back, so a good copy of the sample is still learned."""
        try:
            return decode_image(record.value or b"", self.cfg.limits)
        except ImageError:
            if meta.label is not None:
                self.book.release(meta.stream_id, meta.sample_index)
            raise

    def _book(self, record, outcome: _Claimed | _Label | RecordError | None, arrival: Arrival | None
              ) -> Outgoing | None:
        """Book one record, in offset order: pending, a skipped replay, or a dead letter with its reason; where
        labels come later, a label or an image without one goes to the join (``_book_join``)."""
        key = tp_key(record)
        self.metrics.records_consumed.inc()
        if outcome is None:
            self.metrics.replays_skipped.inc()
            self.book.skip(key, record.offset)
            return None
        if isinstance(outcome, _Label):
            source = (record.topic, record.partition, record.offset)
            return self._book_join(record, self.join.add_label(outcome.id, outcome.label, self._clock(record), source))
        try:
            if isinstance(outcome, RecordError):
                raise outcome
            image = outcome.image.result()
        except (RecordError, ImageError) as e:
            self.book.skip(key, record.offset, dead_letter=True)
            return DeadLetter(record, e.reason, e.message)
        meta = outcome.meta
        if arrival is None:
            self.book.add_pending(key, record.offset, Sample(image, meta))
            return None
        if meta.label is not None:  # labelled: learned as it comes, from what its arrival kept
            self.book.add_pending(key, record.offset, self._kept(arrival.item, meta, arrival.prediction))
            return None
        answered = meta.prediction is not None  # an HTTP upload (``server.uploads``): its answer is the one to score
        prediction = meta.prediction if answered else arrival.prediction
        dead = self._book_join(record, self.join.add_image(meta.id, arrival.item, prediction, self._clock(record)))
        if dead is not None or answered:
            return dead
        return Prediction(meta.id, arrival.top_k, self.version, time.time())

    def _book_join(self, record, joined: Joined | Refused | None) -> DeadLetter | None:
        """Book a record the join took: refused (a dead letter), waiting in the join (handled: the join's state
        is checkpointed), or completing a join (pending until the join is learned)."""
        key = tp_key(record)
        if isinstance(joined, Refused):
            self.book.skip(key, record.offset, dead_letter=True)
            return DeadLetter(record, joined.reason, joined.message)
        if joined is None:
            self.book.skip(key, record.offset)
            return None
        meta = RecordMeta(joined.label, -1, -1, "", joined.id)
        self.book.add_pending(key, record.offset, replace(self._kept(joined.item, meta, joined.prediction),
                                                          joined=joined))
        return None

    def _kept(self, item: torch.Tensor, meta: RecordMeta, prediction: int | None) -> Sample:
        """A sample from what its image's arrival kept: its feature, or the image of a learner that needs it."""
        if self.learner.learns_from_features:
            return Sample(None, meta, feature=item, prediction=prediction)
        return Sample(item, meta, prediction=prediction)

    def _arrive(self, claimed: list) -> dict[int, Arrival]:
        """Labels may come later: predict the poll's good images as they arrive (one forward, in the model
        thread), by their index among the records."""
        good = {i: c.image.result() for i, c in enumerate(claimed)
                if isinstance(c, _Claimed) and c.image.exception() is None}
        if not good:
            return {}
        arrivals = self.model_thread.run(self._predict_arrivals, torch.stack(list(good.values())))
        return dict(zip(good, arrivals, strict=True))

    def _predict_arrivals(self, images: torch.Tensor) -> list[Arrival]:
        with self.lock:
            return arrive(self.learner, images, self.cfg.top_k, self.class_names, self.cfg.alignment.inference_mode)

    def _clock(self, record) -> float:
        """A record's time in seconds (its Kafka timestamp; now, for a record without one), which moves the
        join's clock: waits are measured in stream time, so a replay of the topics joins and expires alike."""
        stamp = getattr(record, "timestamp", None)
        at = stamp / 1000 if isinstance(stamp, int) and stamp > 0 else time.time()
        self.stream_time = max(self.stream_time, at)
        return at

    def _expire(self) -> list[DeadLetter]:
        """Let go of what waited too long in the join: expired images are counted, labels refused as
        ``unknown_id`` become dead letters (rebuilt from where they came from)."""
        if self.join is None:
            return []
        expired, refused = self.join.expire(self.stream_time)
        if expired:
            log.info("%d images expired without their labels (%s ...)", len(expired), expired[0])
        return [DeadLetter(kept_label(r), r.reason, r.message) for r in refused]

    def reread(self) -> None:
        """Forget the pending records and every claim, and put the joins they completed back: the loop reads them
        again from ``offsets``."""
        self.book.reread()
        if self.join is not None:
            self.join.rollback()

    def waiting(self) -> Counter[str]:
        """Records waiting for a mini-batch, per partition (the loop sizes its polls and its lag by them)."""
        return Counter(p.key for p in self.book.pending)

    def _partition_of(self, batch: list[Sample]) -> str:
        """The one partition a mini-batch of a learner in a group comes from."""
        in_batch = {id(s) for s in batch}
        (key,) = {p.key for p in self.book.pending if id(p.sample) in in_batch}
        return key

    @property
    def offsets(self) -> dict[str, int]:
        """Next offset per partition with every record before it handled: where a consumer seeks."""
        return self.book.offsets

    # --- partitions (a learner in a group keeps state per partition: ``server.learner.partitioned``) -------------
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

    def learn_pending(self) -> None:
        """Learn the pending records in mini-batches of at most ``batch_limit`` (cut at a scheduled evaluation);
        records accepted while a step runs stay pending."""
        for group in self._groups(self.book.pending):
            waiting = [p.sample for p in group]
            while waiting:
                limit = self.batch_limit
                batch, waiting = waiting[:limit], waiting[limit:]
                self.learn(batch)

    def _groups(self, pending: list[Pending]) -> list[list[Pending]]:
        """The pending records as the groups mini-batches are cut from, in order: one group here (mini-batches may
        span partitions); a learner in a group learns each partition on its own (``server.learner.partitioned``)."""
        return [pending]

    def learn(self, batch: list[Sample]) -> None:
        """Test-then-train one mini-batch and run a due evaluation (in the model thread), then show the new
        version: ``version`` and ``samples_seen`` move only once the step is whole, so a reader who sees them sees
        the model behind them."""
        self.model_thread.run(self._learn, batch)

    def _learn(self, batch: list[Sample]) -> None:
        labels = torch.tensor([s.label for s in batch])
        features = batch[0].feature is not None  # kept at arrival (labels that come later): all or none are
        images = None if features else stack_images([s.image for s in batch], self.learner.device)  # [B, 3, S, S]
        with self.lock:
            start = time.perf_counter()
            if features:
                self._learn_features(batch, labels)
            else:
                self._step(images, labels, batch)
            self.book.mark_learned(batch)
            if self.join is not None:
                self.join.confirm([s.joined for s in batch if s.joined is not None])
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
        self.reporter.export()

    def _step(self, images: torch.Tensor, labels: torch.Tensor, batch: list[Sample]) -> None:
        """The learner's step on one mini-batch; its test-then-train predictions feed the drift monitor."""
        seen_before = self.learner.samples_seen
        if not self.cfg.prequential:
            self.learner.observe(images, labels)
            return
        self._monitor(labels, self.learner.test_then_train(images, labels, self.cfg.alignment.inference_mode),
                      seen_before)

    def _learn_features(self, batch: list[Sample], labels: torch.Tensor) -> None:
        """Learn the features kept at arrival; the drift monitor gets the predictions made then."""
        seen_before = self.learner.samples_seen
        self.learner.observe_features(torch.stack([s.feature for s in batch]), labels)  # [B, D]
        scored = [(s.label, s.prediction) for s in batch if s.prediction is not None]
        if scored and self.cfg.prequential:
            self._monitor(*torch.tensor(scored).T, seen_before)

    def _monitor(self, labels: torch.Tensor, pred: torch.Tensor | None, seen_before: int) -> None:
        """Feed the test-then-train predictions (None before any class is known) to the drift monitor."""
        if pred is None:
            return
        for event in self.monitor.update(labels.tolist(), pred.tolist(), seen_before):
            self.metrics.drift.labels(event["detector"]).inc()
            log.warning("drift detected at %d samples by %s", event["samples_seen"], event["detector"])

    def on_idle(self) -> None:
        """The topic is drained: snapshot the newest version (requests then never wait for it), and measure the
        accuracy here (A_last of the stream so far) once per new stretch of learning."""
        self.snapshot  # noqa: B018 (made now, in the model thread, if the learner moved on)
        if self.reporter.idle_evaluation_due:
            self.model_thread.run(self._evaluate_now)

    def _evaluate_now(self) -> None:
        with self.lock:
            results = self.evaluation.end_of_task(self.learner)[self.cfg.alignment.inference_mode]
            self.class_accuracy, self.idle_evaluated_at = results[1], self.learner.samples_seen
        self.reporter.export()

    # --- checkpoints ----------------------------------------------------------------------------------------
    def capture(self, due_only: bool = False, before: Callable[[], None] | None = None) -> dict | None:
        """A copy of everything a checkpoint holds, or None when it would equal the last one (or, ``due_only``,
        when fewer than ``--checkpoint_every`` samples were learned since). ``before`` runs first when a copy is
        taken (the loop flushes its dead letters: durable before the offsets that skip them).

        The copy is consistent (taken between two steps, in the model thread) and detached (learning on changes
        none of it), so ``write`` may run while the learner goes on; the book counts its offsets as saved from
        here (a failed write stops the loop)."""
        due = self._since_checkpoint >= self.cfg.checkpoint_every
        if (due_only and not due) or not (self._since_checkpoint > 0 or self.book.unsaved_keys()):
            return None
        if before is not None:
            before()
        return self.model_thread.run(self._capture)

    def _capture(self) -> dict:
        with self.lock:
            state = copy.deepcopy({
                "format": CHECKPOINT_FORMAT, "learner": self.learner.state_dict(),
                "monitor": self.monitor.state_dict(), "version": self.version,
                **self.book.state_dict(), "time": time.time(),
                "anytime": None if self.evaluation is None else self.evaluation.state_dict(),
                "join": None if self.join is None else self.join.state_dict(), "stream_time": self.stream_time,
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

    def _restore(self) -> None:
        if not self.checkpoint_path.is_file():
            return
        state = read_checkpoint(self.checkpoint_path)
        self.learner.load_state_dict(state["learner"])
        self.monitor.load_state_dict(state["monitor"])
        self.version, self.samples_seen = int(state["version"]), self.learner.samples_seen
        self.book.load_state_dict(state)
        if self.join is not None and state.get("join") is not None:
            self.join.load_state_dict(state["join"])
            self.stream_time = float(state["stream_time"])
        if self.evaluation is not None and state["anytime"] is not None:
            self.evaluation.load_state_dict(state["anytime"])
            curve = self.evaluation.curves[self.cfg.alignment.inference_mode]
            self.class_accuracy = dict(next(reversed(curve.task_class_accuracy), {}))
        torch.set_rng_state(state["rng"])
        self.last_checkpoint_time = float(state["time"])
        log.info("restored checkpoint %s: %d samples learned, offsets %s", self.checkpoint_path,
                 self.learner.samples_seen, self.book.offsets)
