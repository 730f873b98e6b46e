"""Labels that come later: images joined with their labels by id, in bounded memory (no Kafka here).

An image comes first and is answered at once; its label comes later (a reviewer, a downstream signal), or never.
``LabelJoin`` keeps what learning needs of each image (its feature for an order-invariant head, the image itself for
a model that trains through the backbone) with the prediction made at arrival, until its label comes; a label that
comes before its image waits for it. Both waits are bounded in count and in time, and every item ends one way that
is counted: joined (learned, and the arrival prediction scored), expired, or refused with a reason.

* An image waits at most ``image_ttl_s`` and among at most ``max_images``; past either it expires (the oldest
  first), counted, never learned.
* A label waits for its image at most ``label_ttl_s`` and among at most ``max_labels``; past either it is refused as
  ``unknown_id`` (the dead-letter topic's reason).
* A second label for an id already joined, or already waiting, is refused as ``duplicate_label``; an image with an
  id already held, as ``duplicate_id``.

Exactly once: a join is *in flight* from the moment the second half arrives until the caller has learned it
(``confirm``). The record that completed it is still pending in the caller's book, so a checkpoint's
``state_dict`` holds an in-flight join as it was before that record (the first half waiting), and ``rollback``
(a reconnect that reads the pending records again) puts it back the same way: the record, read again, joins again,
and nothing is learned twice or lost.

Times are the caller's (record timestamps), so a replay of the same topics gives the same joins.

Example:
    >>> join = LabelJoin(JoinConfig(max_images=2))
    >>> join.add_image("a", torch.zeros(2), prediction=3, now=0.0)
    >>> joined = join.add_label("a", 3, now=5.0)
    >>> joined.label, joined.prediction, joined.delay_s
    (3, 3, 5.0)
    >>> join.confirm([joined])  # learned
    >>> join.add_label("a", 3, now=6.0)
    Refused(id='a', reason='duplicate_label', message='a label for a was already joined', source=None)
    >>> join.add_label("b", 1, now=6.0) is None  # waits for its image
    True
    >>> join.confirm([join.add_image("b", torch.ones(2), prediction=0, now=7.0)])  # the label was there first
    >>> join.counts()
    {'images': 2, 'joined': 2, 'in_flight': 0, 'waiting_images': 0, 'waiting_labels': 0, 'expired_images': 0, \
'refused_labels': 1, 'deleted_images': 0}
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class JoinConfig:
    """How long, and how many, images and labels may wait for each other."""

    max_images: int = 10_000
    """Images (their features, or the images themselves) waiting for a label; past it the oldest expires."""
    image_ttl_s: float = 3600.0
    """Seconds (of record time) an image waits for its label before it expires (counted, never learned)."""
    max_labels: int = 10_000
    """Labels waiting for their image; past it the oldest is refused as unknown_id."""
    label_ttl_s: float = 300.0
    """Seconds (of record time) a label waits for its image before it is refused as unknown_id."""
    delays_kept: int = 10_000
    """Most recent label delays kept for their quantiles."""
    ids_kept: int = 100_000
    """Most recent joined ids remembered, to refuse a duplicate label (an older id's duplicate goes unnoticed)."""


Source = tuple[str, int, int]
"""Where a label record came from (topic, partition, offset), for its dead letter if it is refused later."""


@dataclass(frozen=True)
class Joined:
    """An image and its label together: learn ``item`` with ``label``, and score ``prediction`` against it."""

    id: str
    item: torch.Tensor
    label: int
    prediction: int | None
    """The top-1 class predicted when the image arrived (None: nothing was learned yet)."""
    delay_s: float
    """Seconds from the image's arrival to its label's (0 when the label came first)."""
    completed_by: Literal["image", "label"]
    """Which half arrived second: its record is pending until the join is learned."""
    since: float
    """When the first half arrived (to put it back waiting, were the join rolled back)."""
    source: Source | None = None
    """The label record's origin, when the label waited (it waits again on a rollback)."""


@dataclass(frozen=True)
class Refused:
    """A label (or an image) that cannot be joined, with the dead-letter topic's reason."""

    id: str
    reason: str
    message: str
    source: Source | None = None
    """The refused label record's origin, when it was refused after it had been kept (``expire``)."""


@dataclass
class _Image:
    item: torch.Tensor
    prediction: int | None
    since: float


@dataclass
class _Label:
    label: int
    since: float
    source: Source | None


class LabelJoin:
    """The images waiting for labels and the labels waiting for images, joined by id (one thread: the learner's)."""

    def __init__(self, cfg: JoinConfig = JoinConfig(), latest_wins: bool = False):
        self.cfg, self.latest_wins = cfg, latest_wins
        """``latest_wins``: a second label for a waiting id replaces the first (corrections), not refused."""
        self.images: OrderedDict[str, _Image] = OrderedDict()  # oldest first
        self.labels: OrderedDict[str, _Label] = OrderedDict()  # oldest first
        self.in_flight: dict[str, Joined] = {}  # joined, not learned yet
        self.joined_ids: OrderedDict[str, None] = OrderedDict()  # the most recent ``ids_kept``
        self.delays: deque[float] = deque(maxlen=cfg.delays_kept)
        self.evicted: list[str] = []  # images let go to keep ``max_images``, until ``expire`` reports them
        self.overflow: list[tuple[str, _Label]] = []  # labels let go to keep ``max_labels``, until ``expire``
        self.hits = self.scored = self.joined = self.expired_images = self.refused_labels = self.deleted_images = 0

    # --- the two halves ---------------------------------------------------------------------------------------
    def add_image(self, id: str, item: torch.Tensor, prediction: int | None, now: float) -> Joined | Refused | None:
        """An image arrived (already predicted): joined at once (in flight) if its label waits, else kept (None)."""
        if id in self.images or id in self.in_flight or id in self.joined_ids:
            return Refused(id, "duplicate_id", f"an image with id {id} was already received")
        if (waiting := self.labels.pop(id, None)) is not None:
            return self._join(Joined(id, item, waiting.label, prediction, 0.0, "image", waiting.since,
                                     waiting.source))
        self.images[id] = _Image(item, prediction, now)
        while len(self.images) > self.cfg.max_images:  # the bound holds at every moment, not only at ``expire``
            self.evicted.append(self.images.popitem(last=False)[0])
            self.expired_images += 1
        return None

    def add_label(self, id: str, label: int, now: float, source: Source | None = None) -> Joined | Refused | None:
        """A label arrived: joined (in flight) if its image waits, refused if one was joined or waits already, else
        kept (None)."""
        if self.latest_wins and id in self.labels:
            self.labels.pop(id)
        if id in self.joined_ids or id in self.in_flight or id in self.labels:
            self.refused_labels += 1
            what = "waiting" if id in self.labels else "joined"
            return Refused(id, "duplicate_label", f"a label for {id} was already {what}", source)
        if (waiting := self.images.pop(id, None)) is not None:
            return self._join(Joined(id, waiting.item, label, waiting.prediction, now - waiting.since, "label",
                                     waiting.since))
        self.labels[id] = _Label(label, now, source)
        while len(self.labels) > self.cfg.max_labels:
            self.overflow.append(self.labels.popitem(last=False))
        return None

    def _join(self, joined: Joined) -> Joined:
        self.in_flight[joined.id] = joined
        return joined

    def forget(self, id: str) -> bool:
        """A deletion: let go of the id's waiting image or label, and of its memory as joined (a later label for it
        waits for a new image); True if an image or a label of it was waiting."""
        self.joined_ids.pop(id, None)
        if self.images.pop(id, None) is not None:
            self.deleted_images += 1
            return True
        return self.labels.pop(id, None) is not None

    # --- after learning, or instead of it ---------------------------------------------------------------------
    def confirm(self, joined: list[Joined]) -> None:
        """These joins were learned: count them, score their arrival predictions, remember their ids."""
        for j in joined:
            del self.in_flight[j.id]
            self.joined += 1
            self.joined_ids[j.id] = None
            if len(self.joined_ids) > self.cfg.ids_kept:
                self.joined_ids.popitem(last=False)
            self.delays.append(j.delay_s)
            if j.prediction is not None:
                self.scored += 1
                self.hits += int(j.prediction == j.label)

    def rollback(self) -> None:
        """Put every join in flight back as it was before the record that completed it (read again, it joins
        again): for a reconnect that forgets the pending records."""
        for j in self.in_flight.values():
            self._restore(j, self.images, self.labels)
        self.in_flight.clear()

    @staticmethod
    def _restore(j: Joined, images: OrderedDict[str, _Image], labels: OrderedDict[str, _Label]) -> None:
        if j.completed_by == "label":
            images[j.id] = _Image(j.item, j.prediction, j.since)
            images.move_to_end(j.id, last=False)  # it is older than anything that waits (as good as: TTL order)
        else:
            labels[j.id] = _Label(j.label, j.since, j.source)
            labels.move_to_end(j.id, last=False)

    def expire(self, now: float) -> tuple[list[str], list[Refused]]:
        """Let go of what waited too long or no longer fits: the expired images' ids, and the labels refused as
        ``unknown_id`` (for the dead-letter topic, with where each came from)."""
        old = [i for i, w in self.images.items() if now - w.since > self.cfg.image_ttl_s]
        for i in old:
            del self.images[i]
        self.expired_images += len(old)
        expired, self.evicted = [*self.evicted, *old], []
        stale = [(i, self.labels.pop(i)) for i, w in list(self.labels.items()) if now - w.since > self.cfg.label_ttl_s]
        stale, self.overflow = [*self.overflow, *stale], []
        refused = [Refused(i, "unknown_id", f"no image with id {i} arrived within {self.cfg.label_ttl_s:g} s, or "
                                            f"{self.cfg.max_labels} newer labels waited", w.source) for i, w in stale]
        self.refused_labels += len(refused)
        return expired, refused

    # --- what it shows ----------------------------------------------------------------------------------------
    @property
    def delayed_accuracy(self) -> float | None:
        """Accuracy of the predictions made at arrival, scored when their labels came (None before any)."""
        return self.hits / self.scored if self.scored else None

    def delay_quantile(self, q: float) -> float | None:
        """The ``q`` quantile of the recent label delays in seconds (None before any)."""
        if not self.delays:
            return None
        ordered = sorted(self.delays)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def counts(self) -> dict[str, int]:
        """What became of every image and label: images = joined + in flight + waiting + expired + deleted."""
        return {"images": self.joined + len(self.in_flight) + len(self.images) + self.expired_images
                + self.deleted_images,
                "joined": self.joined, "in_flight": len(self.in_flight), "waiting_images": len(self.images),
                "waiting_labels": len(self.labels), "expired_images": self.expired_images,
                "refused_labels": self.refused_labels, "deleted_images": self.deleted_images}

    # --- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything above as plain lists and one tensor of the waiting items, with every join in flight held as
        before the record that completed it (a checkpoint's offsets stop before that record)."""
        images, labels = OrderedDict(self.images), OrderedDict(self.labels)
        for j in self.in_flight.values():
            self._restore(j, images, labels)
        items = list(images.values())
        return {"image_ids": list(images), "items": torch.stack([w.item for w in items]) if items else None,
                "predictions": [-1 if w.prediction is None else w.prediction for w in items],
                "image_since": [w.since for w in items],
                "label_ids": list(labels), "labels": [w.label for w in labels.values()],
                "label_since": [w.since for w in labels.values()],
                "label_sources": [list(w.source) if w.source else [] for w in labels.values()],
                "joined_ids": list(self.joined_ids), "delays": list(self.delays),
                "counters": [self.hits, self.scored, self.joined, self.expired_images, self.refused_labels,
                             self.deleted_images]}

    def load_state_dict(self, state: dict) -> None:
        """Back to a ``state_dict``: nothing in flight."""
        items = state["items"]
        self.images = OrderedDict(
            (i, _Image(items[k], None if p < 0 else p, s))
            for k, (i, p, s) in enumerate(zip(state["image_ids"], state["predictions"], state["image_since"],
                                              strict=True)))
        self.labels = OrderedDict(
            (i, _Label(y, s, (src[0], int(src[1]), int(src[2])) if src else None))
            for i, y, s, src in zip(state["label_ids"], state["labels"], state["label_since"],
                                    state["label_sources"], strict=True))
        self.in_flight, self.evicted, self.overflow = {}, [], []
        self.joined_ids = OrderedDict.fromkeys(state["joined_ids"])
        self.delays = deque(state["delays"], maxlen=self.cfg.delays_kept)
        counters = [*state["counters"], 0][:6]  # a checkpoint without the deletions counter has five
        self.hits, self.scored, self.joined, self.expired_images, self.refused_labels, self.deleted_images = counters
