"""A record's intake: claim its sample id, decode its image, book it; and the label join, where labels come later.

No Kafka here, and no learning. Where labels come later (``--kafka.labels_topic``) each image is predicted as it
arrives and waits in the ``LabelJoin`` for its label (or a label for its image); the completing record stays pending
until the join is learned, and the join is checkpointed with the offsets, so a crash neither learns a label twice nor
drops one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch

from mepo_stream.checkpoint import StreamPosition
from mepo_stream.errors import ConfigError
from mepo_stream.images import ImageError, ImageLimits, decode_image, decode_images
from mepo_stream.label_join import Joined, LabelJoin, Refused
from mepo_stream.learner import OnlineLearner
from mepo_stream.records import KafkaRecord, RecordError, RecordMeta, parse_headers, parse_label, record_id
from server.config import ServeConfig
from server.learner.arrival import Arrival, Prediction, Retraction, arrive, kept_label
from server.learner.book import Sample, StreamBook, tp_key
from server.learner.corrections import Change, Corrections, Forget, LabelKind, Relabel, TombstoneKind
from server.metrics import ServerMetrics
from server.model_thread import ModelThread

log = logging.getLogger(__name__)


@dataclass
class DeadLetter:
    """A record that cannot be learned, with the reason the dead-letter topic records."""

    record: KafkaRecord
    reason: str
    message: str


def gpu_decode_device(gpu_decode: bool | None, model_device: torch.device) -> torch.device | None:
    """Where a poll's JPEGs decode (``ServeConfig.gpu_decode``): the model's GPU, or None for the CPU path."""
    if gpu_decode is None:
        gpu_decode = model_device.type == "cuda"
    if gpu_decode and model_device.type != "cuda":
        raise ConfigError(f"--gpu_decode true needs the model on a CUDA GPU; it runs on {model_device}")
    return model_device if gpu_decode else None


def decode_on_device(records: list, labels_topic: str | None, limits: ImageLimits,
                     device: torch.device | None) -> dict[int, torch.Tensor | ImageError]:
    """The poll's images by index, decoded in one batch on ``device`` (None: none) before any claim (it is pure)."""
    if device is None:
        return {}
    images = [i for i, r in enumerate(records) if r.topic != labels_topic]
    decoded = decode_images([records[i].value or b"" for i in images], limits, device)
    return dict(zip(images, decoded, strict=True))


def book_change(book: StreamBook, record, change: Change) -> None:
    """A correction or deletion of a learned sample waits for its turn, after the samples read before it."""
    meta = RecordMeta(None, -1, -1, "", change.id)
    book.add_pending(tp_key(record), record.offset, Sample(None, meta, change=change))


def waits_for(id: str, book: StreamBook) -> bool:
    """A sample with this id (an image's, or a join's) waits for its mini-batch: a change to it comes after it."""
    return any(p.sample.change is None and id in (p.sample.meta.id, p.sample.joined and p.sample.joined.id)
               for p in book.pending)


def dead_letter(book: StreamBook, record, reason: str, message: str) -> DeadLetter:
    """Skip a record that cannot be learned (a correction that cannot be applied: ``not_correctable``)."""
    book.skip(tp_key(record), record.offset, dead_letter=True)
    return DeadLetter(record, reason, message)


def elsewhere(book: StreamBook, key: str) -> str:
    """What else a refused change may mean in a group: it was not sent to its image's partition."""
    return (f", or its image is not on {key} (in a group, key images and their changes by id)"
            if book.by_partition else "")


# what ``accept`` hands back for the loop to send: dead letters, predictions, retractions of deleted ids' predictions
Outgoing = DeadLetter | Prediction | Retraction


@dataclass
class _Claimed:
    """A record whose sample id is claimed (an image without a label: none), with its decoded image."""

    meta: RecordMeta
    image: torch.Tensor | ImageError  # uint8 [3, S, S], or why it is not an image (the claim was given back)


@dataclass(frozen=True)
class _Label:
    """A record of the labels topic, validated."""

    id: str
    label: int


@dataclass(frozen=True)
class _Tombstone:
    """A record with a null value keyed by an id (``--corrections.enabled``): delete that id."""

    id: str


class Intake:
    """Claims, decodes and books each poll's records; owns the ``StreamBook`` and the label join. ``lock`` is the
    learning step's (an arrival's forward reads the model); ``version`` tells an arrival's prediction's version."""

    def __init__(self, cfg: ServeConfig, learner: OnlineLearner, class_names: dict[int, str], metrics: ServerMetrics,
                 model_thread: ModelThread, lock: threading.Lock, version: Callable[[], int], book: StreamBook):
        self.cfg, self.learner, self.class_names, self.metrics = cfg, learner, class_names, metrics
        self.model_thread, self.lock, self.version = model_thread, lock, version
        self.book = book
        # images waiting for labels that come later and labels waiting for images (None: labels come attached)
        self.join = LabelJoin(cfg.join, cfg.corrections.enabled) if cfg.kafka.labels_topic is not None else None
        self.corrections = (Corrections(cfg.corrections, learner, cfg.checkpoint_dir, book.by_partition)
                            if cfg.corrections.enabled else None)  # the sample table and its changes (None: off)
        self.stream_time = 0.0  # the newest record timestamp read (s): the join's clock
        self.limits = cfg.limits.at(learner.method.input_size)  # what an image may be, and the size it decodes to
        self.decode_device = gpu_decode_device(cfg.gpu_decode, learner.device)  # None: one at a time, on the CPU

    def accept(self, records: list) -> list[Outgoing]:
        """Claim and book the records in offset order, in the model thread; returns the dead letters and predictions
        for the loop to send before its next checkpoint."""
        self.model_thread.check()
        ready = decode_on_device(records, self.cfg.kafka.labels_topic, self.limits, self.decode_device)
        claimed = [self._claim(record, ready.get(i)) for i, record in enumerate(records)]
        arrivals = self._arrive(claimed) if self.join is not None else {}
        booked = [self._book(record, claim, arrivals.get(i))
                  for i, (record, claim) in enumerate(zip(records, claimed, strict=True))]
        self.metrics.records_consumed.inc(len(records))
        return [out for out in booked if out is not None] + self._expire()

    def _claim(self, record, ready: torch.Tensor | ImageError | None = None
               ) -> _Claimed | _Label | _Tombstone | RecordError | None:
        """Parse the headers and claim the sample id before decoding (None: a replay); a bad image gives its claim
        back, so a good copy later is still learned (an image without a label claims nothing)."""
        n_classes = len(self.class_names)
        try:
            if self.corrections is not None and record.value is None:
                return _Tombstone(record_id(record.key))
            inline = self.corrections is not None and record.value == b"" and record.topic == self.cfg.kafka.topic
            if inline or (self.join is not None and record.topic == self.cfg.kafka.labels_topic):
                return _Label(*parse_label(record.headers, n_classes))  # inline: a correction, a label and no image
            meta = parse_headers(record.headers, n_classes, ids=self.join is not None)
        except RecordError as e:
            return e
        if meta.label is not None and not self.book.claim(meta.stream_id, meta.sample_index):
            return None  # learned or pending: a replay
        image = self._decode(record, ready)
        if isinstance(image, ImageError) and meta.label is not None:
            self.book.release(meta.stream_id, meta.sample_index)
        return _Claimed(meta, image)

    def _decode(self, record, ready: torch.Tensor | ImageError | None) -> torch.Tensor | ImageError:
        """The record's image, or why it is not one."""
        if ready is not None:
            return ready
        try:
            return decode_image(record.value or b"", self.limits)
        except ImageError as e:
            return e

    def _book(self, record, outcome: _Claimed | _Label | _Tombstone | RecordError | None, arrival: Arrival | None
              ) -> Outgoing | None:
        """Book one record, in offset order: pending, a skipped replay, or a dead letter; or hand it to the join."""
        key = tp_key(record)
        at = self._clock(record)  # every record moves the stream's clock: what a sample table's entry is timed by
        if outcome is None:
            self.metrics.replays_skipped.inc()
            self.book.skip(key, record.offset)
            return None
        if isinstance(outcome, _Tombstone):
            return self._book_tombstone(record, key, outcome.id, at)
        if isinstance(outcome, _Label):
            if self.corrections is not None:
                kind = self.corrections.kind_of_label(outcome.id, self.join, at, waits_for(outcome.id, self.book), key)
                if kind is LabelKind.CORRECTION:
                    book_change(self.book, record, Relabel(outcome.id, outcome.label, at))
                    return None
                if kind is LabelKind.NOT_CORRECTABLE:
                    return dead_letter(self.book, record, "not_correctable",
                                       f"{outcome.id} is not correctable: learned more than --corrections.retention_s "
                                       f"ago, or (labels inline) never{elsewhere(self.book, key)}")
            assert self.join is not None  # a label without corrections is read only where labels come later
            source = (record.topic, record.partition, record.offset)
            return self._book_join(record, self.join.add_label(outcome.id, outcome.label, at, source))
        image = outcome if isinstance(outcome, RecordError) else outcome.image
        if isinstance(image, (RecordError, ImageError)):
            return dead_letter(self.book, record, image.reason, image.message)
        meta = cast(_Claimed, outcome).meta
        if arrival is None:
            self.book.add_pending(key, record.offset, Sample(image, meta))
            return None
        if meta.label is not None:  # labelled: learned as it comes, from what its arrival kept
            self.book.add_pending(key, record.offset, self._kept(arrival.item, meta, arrival.prediction))
            return None
        assert self.join is not None and meta.id is not None  # an image without its label names its id
        answered = meta.prediction is not None  # an HTTP upload (``server.uploads``): its answer is the one to score
        prediction = meta.prediction if answered else arrival.prediction
        dead = self._book_join(record, self.join.add_image(meta.id, arrival.item, prediction, at))
        if dead is not None or answered:
            return dead
        return Prediction(meta.id, arrival.top_k, self.version(), time.time(), arrival.novelty, arrival.novel)

    def _book_tombstone(self, record, key: str, id: str, at: float) -> Outgoing | None:
        """A deletion: pending if the id is learned (or about to be), else done now; its prediction is retracted."""
        assert self.corrections is not None  # a null value is a tombstone only with corrections on
        kind = self.corrections.kind_of_tombstone(id, self.join, at, waits_for(id, self.book), key)
        if kind is TombstoneKind.NOT_CORRECTABLE:
            return dead_letter(self.book, record, "not_correctable", f"no sample with id {id} can be deleted: none was "
                               f"received, or it was learned more than --corrections.retention_s ago"
                               f"{elsewhere(self.book, key)}")
        if kind is TombstoneKind.FORGET:
            book_change(self.book, record, Forget(id))
        else:
            self.book.skip(key, record.offset)
        return Retraction(id) if self.join is not None else None  # predictions are written where labels come later

    def _book_join(self, record, joined: Joined | Refused | None) -> DeadLetter | None:
        """Book a record the join took: refused (a dead letter), waiting in the join, or completing a join (pending)."""
        key = tp_key(record)
        if isinstance(joined, Refused):
            return dead_letter(self.book, record, joined.reason, joined.message)
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
        """Predict the poll's good images as they arrive (one forward), by their index among the records."""
        good = {i: c.image for i, c in enumerate(claimed) if isinstance(c, _Claimed) and
                not isinstance(c.image, ImageError)}
        if not good:
            return {}
        with self.lock:
            arrivals = arrive(self.learner, torch.stack(list(good.values())), self.cfg.top_k, self.class_names,
                              self.cfg.alignment.inference_mode)
        return dict(zip(good, arrivals, strict=True))

    def _clock(self, record) -> float:
        """A record's time in s (its timestamp, else now): the join's clock, so a replay joins and expires alike."""
        stamp = getattr(record, "timestamp", None)
        at = stamp / 1000 if isinstance(stamp, int) and stamp > 0 else time.time()
        self.stream_time = max(self.stream_time, at)
        return at

    def _expire(self) -> list[DeadLetter]:
        """Let go of what waited too long in the join: labels refused as ``unknown_id`` become dead letters."""
        if self.join is None:
            return []
        expired, refused = self.join.expire(self.stream_time)
        if expired:
            log.info("%d images expired without their labels (%s ...)", len(expired), expired[0])
        return [DeadLetter(kept_label(r), r.reason, r.message) for r in refused]

    def learned(self, batch: list[Sample], features: torch.Tensor | None = None, key: str | None = None) -> None:
        """Book a learned mini-batch, keep it in the sample table (``features`` [B, D]) and confirm its joins."""
        if self.corrections is not None:
            for i, s in enumerate(batch):
                if s.change is None and (id := s.joined.id if s.joined is not None else s.meta.id) is not None:
                    at = s.joined.since + s.joined.delay_s if s.joined is not None else self.stream_time
                    feature = s.feature if features is None else features[i]
                    assert feature is not None  # kept at arrival, or encoded by the step that learned it
                    self.corrections.keep(id, s.label, at, feature, key)
        self.book.mark_learned(batch)
        if self.join is not None:
            self.join.confirm([s.joined for s in batch if s.joined is not None])

    def reread(self) -> None:
        """Forget the pending records, every claim, and the joins they completed: the loop reads them again."""
        self.book.reread()
        if self.join is not None:
            self.join.rollback()

    def waiting(self) -> Counter[str]:
        """Records waiting for a mini-batch, per partition (the loop sizes its polls and its lag by them)."""
        return Counter(p.key for p in self.book.pending)

    def position(self) -> StreamPosition:
        """Where the stream stands for a checkpoint: the book's offsets, learned ids and counts, the join, its clock."""
        return replace(self.book.position(), join=None if self.join is None else self.join.state_dict(),
                       stream_time=self.stream_time)

    def restore(self, saved: StreamPosition) -> None:
        """Back to a checkpoint's position: nothing pending, nothing in flight."""
        self.book.load(saved)
        if self.join is not None and saved.join is not None:
            self.join.load_state_dict(saved.join)
            self.stream_time = float(saved.stream_time)
