"""A record's intake: claim its sample id, decode its image, book it; and the label join, where labels come later.

No Kafka here, and no learning: ``server.learner.stream`` polls the records and hands each poll to ``accept``,
which claims each sample id in the ``StreamBook`` (``server.learner.book``) before its image is decoded, and books
each record in offset order as pending, a skipped replay or a dead letter (the loop sends those to the
dead-letter topic). The learning step (``server.learner.state``) learns what is pending.

Labels that come later (``--kafka.labels_topic``): the loop also reads the labels topic. Every image of a poll is
predicted as it arrives (``server.learner.arrival``); one without a label waits in the ``LabelJoin`` with its
feature (or its image) and its prediction, which goes to the predictions topic; a label waits there for its
image. The record that completes a join stays pending until the join is learned, and the join's state is in the
checkpoint with the model and both topics' offsets, so a crash neither learns a label twice nor drops one.
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


def open_corrections(cfg: ServeConfig, learner: OnlineLearner, book: StreamBook) -> Corrections | None:
    """The corrections of ``--corrections.enabled`` (None: off), refused at start where they cannot be exact."""
    if not cfg.corrections.enabled:
        return None
    return Corrections(cfg.corrections, learner, cfg.checkpoint_dir, by_partition=book.by_partition)


def decode_on_device(records: list, labels_topic: str | None, limits: ImageLimits,
                     device: torch.device | None) -> dict[int, torch.Tensor | ImageError]:
    """Where JPEGs decode on the GPU (``device``; None: nowhere): the images of the poll (not the labels topic's
    records) by index, decoded in one batch before any claim. Decoding is pure, so claims, releases and the order
    are as if each were decoded as it is claimed; a replay's image is decoded for nothing."""
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


def refuse(book: StreamBook, record, why: str) -> DeadLetter:
    """A correction or deletion that cannot be applied: a dead letter (``not_correctable``)."""
    book.skip(tp_key(record), record.offset, dead_letter=True)
    return DeadLetter(record, "not_correctable", why)


def elsewhere(book: StreamBook, key: str) -> str:
    """What else a refused change may mean in a group: it was not sent to its image's partition."""
    if not book.by_partition:
        return ""
    return f", or its image is not on {key} (in a group, key images and their changes by id)"


Outgoing = DeadLetter | Prediction | Retraction
"""What ``accept`` hands back for the loop to send: dead letters, predictions of images without a label, and the
tombstones that retract the predictions of deleted ids."""


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
    """Claims, decodes and books the records of each poll; the one owner of the ``StreamBook`` and the label join.

    ``version`` tells the model version a prediction of an arriving image is made with; ``lock`` is the one the
    learning step holds while it changes the model (an arrival's forward reads it)."""

    def __init__(self, cfg: ServeConfig, learner: OnlineLearner, class_names: dict[int, str], metrics: ServerMetrics,
                 model_thread: ModelThread, lock: threading.Lock, version: Callable[[], int], book: StreamBook):
        self.cfg, self.learner, self.class_names, self.metrics = cfg, learner, class_names, metrics
        self.model_thread, self.lock, self.version = model_thread, lock, version
        self.book = book
        self.join = LabelJoin(cfg.join, cfg.corrections.enabled) if cfg.kafka.labels_topic is not None else None
        """Images waiting for labels that come later and labels waiting for images (None: labels come attached)."""
        self.corrections = open_corrections(cfg, learner, book)
        """The sample table and its changes (None: ``--corrections.enabled`` is off)."""
        self.stream_time = 0.0  # the newest record timestamp read (s): the join's clock
        self.limits = cfg.limits.at(learner.method.input_size)
        """What a record's image may be, and the model's size it is decoded to."""
        self.decode_device = gpu_decode_device(cfg.gpu_decode, learner.device)
        """Where each poll's JPEGs decode in one batch (None: one at a time, on the CPU)."""

    def accept(self, records: list) -> list[Outgoing]:
        """Claim the records' sample ids in offset order, decoding each image as it is claimed (a poll's JPEGs at
        once on the GPU, where they decode there), and book the outcomes in offset order (pending, a skipped replay,
        or a dead letter); returns the dead letters (and, where labels come later, the predictions of images without
        one), for the loop to send before its next checkpoint. In the model thread, which owns the book."""
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
        """Parse the headers and claim the sample id before decoding (None: a replay); a label record is only
        parsed, and an image without a label claims nothing (the join refuses a second image of its id).
        ``ready``: the image (or its error) when the poll was decoded on the GPU. A bad image gives its claim back,
        so a good copy of the sample later in the stream is still learned."""
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
        """Book one record, in offset order: pending, a skipped replay, or a dead letter with its reason; where
        labels come later, a label or an image without one goes to the join (``_book_join``)."""
        key = tp_key(record)
        at = self._clock(record)  # every record moves the stream's clock: what a sample table's entry is timed by
        if outcome is None:
            self.metrics.replays_skipped.inc()
            self.book.skip(key, record.offset)
            return None
        if isinstance(outcome, _Tombstone):
            return self._book_tombstone(record, outcome.id, at)
        if isinstance(outcome, _Label):
            if self.corrections is not None:
                kind = self.corrections.kind_of_label(outcome.id, self.join, at,
                                                      waits_for(outcome.id, self.book), key)
                if kind is LabelKind.CORRECTION:
                    book_change(self.book, record, Relabel(outcome.id, outcome.label, at))
                    return None
                if kind is LabelKind.NOT_CORRECTABLE:
                    return refuse(self.book, record, f"{outcome.id} is not correctable: learned more than "
                                                     f"--corrections.retention_s ago, or (labels inline) never"
                                                     f"{elsewhere(self.book, key)}")
            assert self.join is not None  # a label without corrections is read only where labels come later
            source = (record.topic, record.partition, record.offset)
            return self._book_join(record, self.join.add_label(outcome.id, outcome.label, at, source))
        image = outcome if isinstance(outcome, RecordError) else outcome.image
        if isinstance(image, (RecordError, ImageError)):
            self.book.skip(key, record.offset, dead_letter=True)
            return DeadLetter(record, image.reason, image.message)
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

    def _book_tombstone(self, record, id: str, at: float) -> Outgoing | None:
        """A deletion: pending in its place if the id is learned (or about to be), done now if it only waited in the
        join; either way its prediction is retracted. Refused if nothing of it is kept."""
        key = tp_key(record)
        assert self.corrections is not None  # a null value is a tombstone only with corrections on
        kind = self.corrections.kind_of_tombstone(id, self.join, at, waits_for(id, self.book), key)
        if kind is TombstoneKind.NOT_CORRECTABLE:
            return refuse(self.book, record, f"no sample with id {id} can be deleted: none was received, or it was "
                                             f"learned more than --corrections.retention_s ago"
                                             f"{elsewhere(self.book, key)}")
        if kind is TombstoneKind.FORGET:
            book_change(self.book, record, Forget(id))
        else:
            self.book.skip(tp_key(record), record.offset)
        return Retraction(id) if self.join is not None else None  # predictions are written where labels come later

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
        good = {i: c.image for i, c in enumerate(claimed) if isinstance(c, _Claimed) and
                not isinstance(c.image, ImageError)}
        if not good:
            return {}
        with self.lock:
            arrivals = arrive(self.learner, torch.stack(list(good.values())), self.cfg.top_k, self.class_names,
                              self.cfg.alignment.inference_mode)
        return dict(zip(good, arrivals, strict=True))

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

    def learned(self, batch: list[Sample], features: torch.Tensor | None = None, key: str | None = None) -> None:
        """A mini-batch (of partition ``key``) was learned: its samples are learned in the book (and kept in the sample
        table, with their ``features`` [B, D] where learned from images), and the joins it completed confirmed."""
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
        """Forget the pending records and every claim, and put the joins they completed back: the loop reads them
        again from the book's offsets."""
        self.book.reread()
        if self.join is not None:
            self.join.rollback()

    def waiting(self) -> Counter[str]:
        """Records waiting for a mini-batch, per partition (the loop sizes its polls and its lag by them)."""
        return Counter(p.key for p in self.book.pending)

    def position(self) -> StreamPosition:
        """Where the stream stands for a checkpoint: the book's offsets, learned ids and counts, the join and its
        clock."""
        book = self.book.state_dict()
        return StreamPosition(book["offsets"], book["learned"], book["dead_lettered"], book["replays_skipped"],
                              None if self.join is None else self.join.state_dict(), self.stream_time)

    def restore(self, saved: StreamPosition) -> None:
        """Back to a checkpoint's position: nothing pending, nothing in flight."""
        self.book.load_state_dict({"offsets": saved.offsets, "learned": saved.learned,
                                   "dead_lettered": saved.dead_lettered, "replays_skipped": saved.replays_skipped})
        if self.join is not None and saved.join is not None:
            self.join.load_state_dict(saved.join)
            self.stream_time = float(saved.stream_time)
