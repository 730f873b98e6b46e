"""Labels that come later: images joined with their labels by id, in bounded memory (issue 35's core, no Kafka).

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

Times are the caller's (record timestamps, or ``time.time()``), so a replay of the same topics gives the same joins.

Example:
    >>> join = LabelJoin(JoinConfig(max_images=2))
    >>> join.add_image("a", "feature-a", prediction=3, now=0.0)
    >>> join.add_label("a", 3, now=5.0)
    Joined(id='a', item='feature-a', label=3, prediction=3, delay_s=5.0)
    >>> join.add_label("a", 3, now=6.0)
    Refused(id='a', reason='duplicate_label', message='a label for a was already joined')
    >>> join.add_label("b", 1, now=6.0) is None  # waits for its image
    True
    >>> join.add_image("b", "feature-b", prediction=0, now=7.0).delay_s  # the label was there first
    0.0
    >>> join.counts()
    {'joined': 2, 'waiting_images': 0, 'waiting_labels': 0, 'expired_images': 0, 'refused_labels': 1, 'images': 2}
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JoinConfig:
    """How long, and how many, images and labels may wait for each other."""

    max_images: int = 10_000
    """Images (their features, or the images themselves) waiting for a label; past it the oldest expires."""
    image_ttl_s: float = 3600.0
    """Seconds an image waits for its label before it expires (counted, never learned)."""
    max_labels: int = 10_000
    """Labels waiting for their image; past it the oldest is refused as unknown_id."""
    label_ttl_s: float = 300.0
    """Seconds a label waits for its image before it is refused as unknown_id."""
    delays_kept: int = 10_000
    """Most recent label delays kept for their quantiles."""
    ids_kept: int = 100_000
    """Most recent joined ids remembered, to refuse a duplicate label (an older id's duplicate goes unnoticed)."""


@dataclass(frozen=True)
class Joined:
    """An image and its label together: learn ``item`` with ``label``, and score ``prediction`` against it."""

    id: str
    item: Any
    label: int
    prediction: int | None
    """The top-1 class predicted when the image arrived (None: nothing was learned yet)."""
    delay_s: float
    """Seconds from the image's arrival to its label's (0 when the label came first)."""


@dataclass(frozen=True)
class Refused:
    """A label (or an image) that cannot be joined, with the dead-letter topic's reason."""

    id: str
    reason: str
    message: str


@dataclass
class _Waiting:
    item: Any
    prediction: int | None
    since: float


class LabelJoin:
    """The images waiting for labels and the labels waiting for images, joined by id (one thread: the learner's)."""

    def __init__(self, cfg: JoinConfig = JoinConfig()):
        self.cfg = cfg
        self.images: OrderedDict[str, _Waiting] = OrderedDict()  # oldest first
        self.labels: OrderedDict[str, tuple[int, float]] = OrderedDict()  # id -> (label, since), oldest first
        self.joined_ids: OrderedDict[str, None] = OrderedDict()  # the most recent ``ids_kept``
        self.delays: deque[float] = deque(maxlen=cfg.delays_kept)
        self.evicted: list[str] = []  # images let go to keep ``max_images``, until ``expire`` reports them
        self.overflow: list[str] = []  # labels let go to keep ``max_labels``, until ``expire`` refuses them
        self.hits = self.scored = self.joined = self.expired_images = self.refused_labels = self.images_seen = 0

    def add_image(self, id: str, item: Any, prediction: int | None, now: float) -> Joined | Refused | None:
        """An image arrived (already predicted): joined at once if its label waits, else kept (None)."""
        if id in self.images or id in self.joined_ids:
            return Refused(id, "duplicate_id", f"an image with id {id} was already received")
        self.images_seen += 1
        if id in self.labels:
            label, _ = self.labels.pop(id)
            return self._join(id, item, label, prediction, 0.0)
        self.images[id] = _Waiting(item, prediction, now)
        while len(self.images) > self.cfg.max_images:  # the bound holds at every moment, not only at ``expire``
            self.evicted.append(self.images.popitem(last=False)[0])
            self.expired_images += 1
        return None

    def add_label(self, id: str, label: int, now: float) -> Joined | Refused | None:
        """A label arrived: joined if its image waits, refused if one was joined already, else kept (None)."""
        if id in self.joined_ids or id in self.labels:
            self.refused_labels += 1
            what = "joined" if id in self.joined_ids else "waiting"
            return Refused(id, "duplicate_label", f"a label for {id} was already {what}")
        if (waiting := self.images.pop(id, None)) is not None:
            return self._join(id, waiting.item, label, waiting.prediction, now - waiting.since)
        self.labels[id] = (label, now)
        while len(self.labels) > self.cfg.max_labels:
            self.overflow.append(self.labels.popitem(last=False)[0])
        return None

    def expire(self, now: float) -> tuple[list[str], list[Refused]]:
        """Let go of what waited too long or no longer fits: the expired images' ids, and the labels refused as
        ``unknown_id`` (for the dead-letter topic)."""
        old = [i for i, w in self.images.items() if now - w.since > self.cfg.image_ttl_s]
        for i in old:
            del self.images[i]
        self.expired_images += len(old)
        expired, self.evicted = [*self.evicted, *old], []
        stale = [i for i, (_, since) in self.labels.items() if now - since > self.cfg.label_ttl_s]
        for i in stale:
            del self.labels[i]
        stale, self.overflow = [*self.overflow, *stale], []
        refused = [Refused(i, "unknown_id", f"no image with id {i} arrived within {self.cfg.label_ttl_s:g} s, or "
                                            f"{self.cfg.max_labels} newer labels waited") for i in stale]
        self.refused_labels += len(refused)
        return expired, refused

    def _join(self, id: str, item: Any, label: int, prediction: int | None, delay_s: float) -> Joined:
        self.joined += 1
        self.joined_ids[id] = None
        if len(self.joined_ids) > self.cfg.ids_kept:
            self.joined_ids.popitem(last=False)
        self.delays.append(delay_s)
        if prediction is not None:
            self.scored += 1
            self.hits += int(prediction == label)
        return Joined(id, item, label, prediction, delay_s)

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
        """What became of every image and label: images = joined + waiting + expired."""
        return {"joined": self.joined, "waiting_images": len(self.images), "waiting_labels": len(self.labels),
                "expired_images": self.expired_images, "refused_labels": self.refused_labels,
                "images": self.images_seen}
