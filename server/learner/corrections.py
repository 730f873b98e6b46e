"""Corrections and deletions of learned samples (``--corrections.enabled``): the model as a table's view.

Kafka Streams turns a topic into a table: the latest value of each key wins, and a tombstone (a null value)
deletes the key. The learner follows the same rules for its samples, keyed by id: a label for an id it learned
already moves the sample to the new label, and a tombstone takes it out. Both are exact, because the default model
is a sum of its samples' features (``OnlineLearner.forget_features``): at every checkpoint the model equals a fresh
learner fed the latest label of every id that still exists.

The intake (``server.learner.intake``) decides what a record is when it reads it (``kind_of_label``,
``kind_of_tombstone``); a change is then learned in its place in the stream, after the samples read before it, by
``apply`` in the learning step. What it needs of a learned sample (its feature, label and record time) is in the
``SampleTable``, which commits with the checkpoint (``checkpoint``, ``settle``, ``restore``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from mepo_stream.errors import ConfigError
from mepo_stream.label_join import LabelJoin
from mepo_stream.learner import OnlineLearner
from server.config import CorrectionsConfig
from server.learner.sample_table import Entry, SampleTable

log = logging.getLogger(__name__)
TABLE = "samples"
"""The sample table's folder in the checkpoint directory."""


@dataclass(frozen=True)
class Relabel:
    """A correction: the sample with this id was learned; its label is now ``label``."""

    id: str
    label: int
    time: float
    """The correction's record time: the id stays correctable ``--corrections.retention_s`` from here."""


@dataclass(frozen=True)
class Forget:
    """A deletion: the sample with this id leaves the model and the table."""

    id: str


Change = Relabel | Forget


class Corrections:
    """The sample table and what changed it, for one learner alone."""

    def __init__(self, cfg: CorrectionsConfig, learner: OnlineLearner, checkpoint_dir: Path):
        if (why := learner.not_correctable) is not None:
            raise ConfigError(f"--corrections.enabled needs a learner that can take a sample out exactly, and {why}")
        self.learner = learner
        self.table = SampleTable(checkpoint_dir / TABLE, cfg.retention_s, cfg.compact_every_s)
        self.counts = {"corrections_applied": 0, "corrections_refused": 0, "deletions_applied": 0,
                       "deletions_refused": 0}

    # --- what a record is, when it is read ------------------------------------------------------------------------
    def kind_of_label(self, id: str, join: LabelJoin | None, now: float, pending: bool
                      ) -> Literal["correction", "not_correctable", "join"]:
        """A label for ``id`` read at record time ``now``: a correction of a sample learned or about to be (``pending``
        in the book, or its join in flight), refused for one learned but no longer in the table (or, with labels
        inline, one never learned), else a label for the join. The join is asked first: the learning step writes a
        sample to the table before it lets go of its join."""
        if self._learned(id, join, now, pending):
            return "correction"
        if join is None or id in join.joined_ids:
            self.counts["corrections_refused"] += 1
            return "not_correctable"
        return "join"

    def kind_of_tombstone(self, id: str, join: LabelJoin | None, now: float, pending: bool
                          ) -> Literal["forget", "waiting", "not_correctable"]:
        """A tombstone for ``id`` read at record time ``now``: a sample to take out (learned, ``pending`` or in
        flight), an image or label let go from the join now, or refused (never learned, or past retention)."""
        if self._learned(id, join, now, pending):
            return "forget"
        if join is not None and join.forget(id):
            self.counts["deletions_applied"] += 1
            return "waiting"
        self.counts["deletions_refused"] += 1
        return "not_correctable"

    def _learned(self, id: str, join: LabelJoin | None, now: float, pending: bool) -> bool:
        """The id's sample is learned and still correctable at record time ``now``, or about to be learned."""
        self.expire(now)
        return pending or (join is not None and id in join.in_flight) or self.table.get(id) is not None

    # --- in the learning step ---------------------------------------------------------------------------------------
    def keep(self, id: str, label: int, time: float, feature: torch.Tensor) -> None:
        """A sample was learned: keep what it added, until it is corrected, deleted or past retention."""
        self.table.put(id, Entry(label, time, feature.detach().to("cpu", torch.float32)))

    def apply(self, change: Change, join: LabelJoin | None) -> None:
        """Learn one change in its place in the stream; one whose id left the table since it was read (a deletion
        or retention came first) is counted as refused."""
        entry = self.table.get(change.id)
        kind = "corrections" if isinstance(change, Relabel) else "deletions"
        if entry is None:
            self.counts[f"{kind}_refused"] += 1
            log.info("%s of %s not applied: it is no longer in the sample table", kind[:-1], change.id)
            return
        if isinstance(change, Relabel):
            if change.label != entry.label:
                self.learner.relabel_features(entry.feature[None], torch.tensor([entry.label]),
                                              torch.tensor([change.label]))
            self.table.put(change.id, Entry(change.label, change.time, entry.feature))
        else:
            self.learner.forget_features(entry.feature[None], torch.tensor([entry.label]))
            self.table.delete(change.id)
            if join is not None:
                join.forget(change.id)
        self.counts[f"{kind}_applied"] += 1

    def expire(self, now: float) -> None:
        """Let the ids past retention at record time ``now`` go (they stay learned, no longer correctable)."""
        if n := self.table.expire(now):
            log.info("%d ids past --corrections.retention_s left the sample table", n)

    # --- with the checkpoint ------------------------------------------------------------------------------------
    def checkpoint(self) -> dict:
        """Commit the table's changes as the next generation; what the checkpoint keeps of the corrections."""
        generation = self.table.generation + 1
        self.table.commit(generation)
        return {"generation": generation, **self.counts}

    def settle(self, saved: dict) -> None:
        """The checkpoint holding ``saved`` (``checkpoint``'s) is on disk."""
        self.table.settle(saved["generation"])

    def restore(self, saved: dict | None) -> None:
        """Back to a checkpoint's corrections (None: no checkpoint, or one written without them)."""
        self.table.restore(0 if saved is None else saved["generation"])
        self.counts = {k: int(saved[k]) if saved else 0 for k in self.counts}

    def summary(self) -> dict:
        return {**self.counts, "ids": len(self.table), "bytes_on_disk": self.table.bytes_on_disk(),
                "retention_s": self.table.retention_s}
