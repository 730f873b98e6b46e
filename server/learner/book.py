"""What the learner has done with the stream, kept with the model so that both roll back together.

``StreamBook`` is the one place that decides whether a record is a replay and where the offsets stand (owned by
``Intake``). ``offsets`` (what a checkpoint stores, what is committed) never pass a pending record: a crash loses
nothing.

Example:
    >>> def sample(index: int) -> Sample:
    ...     return Sample(torch.zeros(3, 2, 2, dtype=torch.uint8), RecordMeta(0, index, index, "s"))
    >>> book, first = StreamBook(), sample(0)
    >>> book.claim("s", 0), book.claim("s", 0)  # the second copy is a replay of a pending sample
    (True, False)
    >>> book.add_pending("images:0", 0, first); book.skip("images:0", 1)  # offset 1 holds that replay
    >>> book.offsets  # nothing is handled before the pending record
    {}
    >>> book.mark_learned([first])
    >>> book.offsets, book.claim("s", 0), book.replays_skipped
    ({'images:0': 2}, False, 2)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mepo_stream.checkpoint import StreamPosition
from mepo_stream.label_join import Joined
from mepo_stream.records import RecordMeta
from server.learner.consumer import PartitionKey
from server.learner.corrections import Change


def tp_key(tp) -> str:
    """The book's name of a partition (of a record, or anything with ``topic`` and ``partition``)."""
    return str(PartitionKey.of(tp))


@dataclass
class Sample:
    """A decoded, validated record waiting to be learned: its image, or the feature it had when it arrived."""

    image: torch.Tensor | None  # uint8 [3, S, S]; None when ``feature`` is given
    meta: RecordMeta
    feature: torch.Tensor | None = None  # [D], ``OnlineLearner.observe_features``'s input
    prediction: int | None = None  # made when the image arrived (labels that come later; None: none was made)
    joined: Joined | None = None  # its label came later: the join to confirm once it is learned
    change: Change | None = None  # not a sample: a correction or deletion of one (``server.learner.corrections``)

    @property
    def id(self) -> tuple[str, int]:
        """What "learned exactly once" counts for a labelled record (a joined one: the ``LabelJoin``)."""
        return self.meta.stream_id, self.meta.sample_index

    @property
    def label(self) -> int:
        label = self.joined.label if self.joined is not None else self.meta.label
        assert label is not None, "a sample waits for its mini-batch only once its label is known"
        return label


class Pending(NamedTuple):
    """A record whose sample waits for its mini-batch; its offset holds its partition's offset back."""

    key: str  # "topic:partition"
    offset: int
    sample: Sample


@dataclass
class StreamBook:
    """Sample ids, record offsets and stream counters, behind one lock (other threads read and unsave offsets)."""

    learn_replays: bool = False  # claim every record, so a replayed sample is learned again
    by_partition: bool = False  # also keep the ids learned from each partition (a learner in a group writes them)
    dead_lettered: int = field(default=0, init=False)  # counted by skip(dead_letter=True)
    replays_skipped: int = field(default=0, init=False)  # counted by claim()
    _learned: dict[str, set[int]] = field(default_factory=dict, init=False, repr=False)
    _learned_in: dict[str, dict[str, set[int]]] = field(default_factory=dict, init=False, repr=False)  # per partition
    _in_flight: dict[str, set[int]] = field(default_factory=dict, init=False, repr=False)
    _pending: list[Pending] = field(default_factory=list, init=False, repr=False)
    _handled: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # what `offsets` answers
    _read: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # next offset read, per partition
    _saved: dict[str, int] = field(default_factory=dict, init=False, repr=False)  # the last checkpoint's offsets
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def claim(self, stream_id: str, index: int) -> bool:
        """Take a sample id for learning; False (and counted as a skipped replay) if learned or in flight."""
        with self._lock:
            seen = index in self._learned.get(stream_id, ()) or index in self._in_flight.get(stream_id, ())
            if seen and not self.learn_replays:
                self.replays_skipped += 1
                return False
            self._in_flight.setdefault(stream_id, set()).add(index)
            return True

    def release(self, stream_id: str, index: int) -> None:
        """Give back one claim whose record turned out bad, so a good copy of the sample is still learned."""
        with self._lock:
            self._in_flight.get(stream_id, set()).discard(index)

    def add_pending(self, key: str, offset: int, sample: Sample) -> None:
        """The record's sample waits for its mini-batch; its partition's offset stays behind it until learned."""
        with self._lock:
            self._read[key] = offset + 1
            self._pending.append(Pending(key, offset, sample))

    def skip(self, key: str, offset: int, dead_letter: bool = False) -> None:
        """The record needs no more work (a replay, or a dead letter); the offset passes it unless one is pending."""
        with self._lock:
            self.dead_lettered += dead_letter
            self._read[key] = offset + 1
            if not any(p.key == key for p in self._pending):
                self._handled[key] = offset + 1

    @property
    def pending(self) -> list[Pending]:
        """The records waiting for a mini-batch, in the order they were read."""
        with self._lock:
            return list(self._pending)

    def mark_learned(self, batch: list[Sample]) -> None:
        """The mini-batch was learned: its ids -> learned, every record read handled up to the first one pending."""
        learned = {id(s) for s in batch}
        with self._lock:
            for stream_id, index in (s.id for s in batch if s.joined is None and s.change is None):
                self._in_flight.get(stream_id, set()).discard(index)
                self._learned.setdefault(stream_id, set()).add(index)
            if self.by_partition:
                for p in self._pending:
                    if id(p.sample) in learned:
                        self._learned_in.setdefault(p.key, {}).setdefault(p.sample.meta.stream_id, set()).add(
                            p.sample.meta.sample_index)
            self._pending = [p for p in self._pending if id(p.sample) not in learned]
            for key, upto in self._read.items():
                self._handled[key] = min((p.offset for p in self._pending if p.key == key), default=upto)

    def reread(self) -> None:
        """Forget the pending records and every claim: they will be read, and claimed, again from ``offsets``."""
        with self._lock:
            self._pending.clear()
            self._in_flight.clear()
            self._read = dict(self._handled)

    @property
    def offsets(self) -> dict[str, int]:
        """Next offset per partition with every record before it handled: where to resume, what to commit."""
        with self._lock:
            return dict(self._handled)

    def mark_saved(self, offsets: dict[str, int], failed: bool = False) -> None:
        """A checkpoint holding ``offsets`` is on disk; ``failed``: its write failed, so they count as unsaved again."""
        with self._lock:
            if not failed:
                self._saved = dict(offsets)
                return
            for key, offset in offsets.items():
                if self._saved.get(key) == offset:
                    del self._saved[key]

    def partition(self, key: str) -> tuple[int | None, dict[str, list[int]]]:
        """The partition's next offset (None before any record is handled) and the ids learned from it."""
        with self._lock:
            learned = {s: sorted(ids) for s, ids in self._learned_in.get(key, {}).items()}
            return self._handled.get(key), learned

    def adopt(self, key: str, offset: int, learned: dict[str, list[int]]) -> None:
        """Take a partition over at ``offset``, with the ids its earlier owners learned from it."""
        with self._lock:
            self._handled[key] = self._saved[key] = self._read[key] = offset
            self._learned_in[key] = {s: set(ids) for s, ids in learned.items()}
            for stream_id, ids in learned.items():
                self._learned.setdefault(stream_id, set()).update(ids)

    def drop(self, key: str) -> None:
        """Let a partition go (nothing of it may be pending): its offsets and learned ids leave the book."""
        with self._lock:
            if any(p.key == key for p in self._pending):
                raise RuntimeError(f"{key} still has records waiting for a mini-batch")
            for stream_id, ids in self._learned_in.pop(key, {}).items():
                self._learned.get(stream_id, set()).difference_update(ids)
            for table in (self._handled, self._saved, self._read):
                table.pop(key, None)

    def unsaved_keys(self) -> list[str]:
        """The partitions whose offsets moved since the last ``mark_saved`` (by learning or not)."""
        with self._lock:
            return [k for k, v in self._handled.items() if self._saved.get(k) != v]

    def position(self) -> StreamPosition:
        """Where the stream stands for a checkpoint: offsets, learned ids as index tensors per stream, the counters
        (never the in-flight; the join is the intake's)."""
        with self._lock:
            return StreamPosition(dict(self._handled), {k: torch.tensor(sorted(v)) for k, v in self._learned.items()},
                                  self.dead_lettered, self.replays_skipped)

    def load(self, saved: StreamPosition) -> None:
        """Back to a checkpoint's position: its offsets, learned ids and counters; nothing pending, nothing in
        flight."""
        with self._lock:
            self._handled = {k: int(v) for k, v in saved.offsets.items()}
            self._saved, self._read = dict(self._handled), dict(self._handled)
            self._learned = {k: set(v.tolist()) for k, v in saved.learned.items()}
            self._in_flight, self._pending = {}, []
            self.dead_lettered, self.replays_skipped = int(saved.dead_lettered), int(saved.replays_skipped)
