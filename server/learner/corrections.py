"""Corrections and deletions of learned samples (``--corrections.enabled``): the model as a table's view.

As Kafka Streams turns a topic into a table, a label for a learned id moves the sample to the new label and a
tombstone takes it out, exactly, since the model is a sum of its samples' features: at every checkpoint it equals a
fresh learner fed the latest label of every id that still exists (docs/corrections.md).
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Protocol

import torch

from mepo_stream.checkpoint import CorrectionsState
from mepo_stream.errors import ConfigError
from mepo_stream.label_join import LabelJoin
from mepo_stream.learner import OnlineLearner
from server.config import CorrectionsConfig
from server.learner.sample_table import Entry, SampleTable

log = logging.getLogger(__name__)
TABLE = "samples"  # the sample table's folder in the checkpoint directory
EXPIRE_EVERY_S = 1.0  # how often (in record time) the tables drop the ids past retention
PARTITION_TABLES = "partition-samples"  # in a group, the owned partitions' tables (rebuilt at each assignment)


@dataclass(frozen=True)
class Relabel:
    """A correction: the learned sample with this id now has label ``label``."""

    id: str
    label: int
    time: float  # the correction's record time: the id stays correctable ``--corrections.retention_s`` from here


@dataclass(frozen=True)
class Forget:
    """A deletion: the sample with this id leaves the model and the table."""

    id: str


Change = Relabel | Forget


class ModelEdits(Protocol):
    """Where a change is learned: the learner's model (alone), or a partition's part of it (in a group)."""

    def forget_features(self, features: torch.Tensor, labels: torch.Tensor) -> None: ...
    def relabel_features(self, features: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None: ...


class Count(StrEnum):
    """What the corrections count, per partition (the keys in checkpoints, partition states and the status)."""

    CORRECTIONS_APPLIED = "corrections_applied"
    CORRECTIONS_REFUSED = "corrections_refused"
    DELETIONS_APPLIED = "deletions_applied"
    DELETIONS_REFUSED = "deletions_refused"


COUNTS = tuple(count.value for count in Count)


class LabelKind(Enum):
    """What a label for an id is, when it is read (``Corrections.kind_of_label``)."""

    CORRECTION = "correction"
    NOT_CORRECTABLE = "not_correctable"
    JOIN = "join"


class TombstoneKind(Enum):
    """What a tombstone for an id is, when it is read (``Corrections.kind_of_tombstone``)."""

    FORGET = "forget"
    WAITING = "waiting"
    NOT_CORRECTABLE = "not_correctable"


class Corrections:
    """The sample table and its change counts: one, or one per owned partition in a group (``by_partition``)."""

    def __init__(self, cfg: CorrectionsConfig, learner: OnlineLearner, checkpoint_dir: Path,
                 by_partition: bool = False):
        if (why := learner.not_correctable) is not None:
            raise ConfigError(f"--corrections.enabled needs a learner that can take a sample out exactly, and {why}")
        self.cfg, self.checkpoint_dir, self.by_partition = cfg, checkpoint_dir, by_partition
        self.tables: dict[str | None, SampleTable] = {}
        self._expired_at = -math.inf  # the record time of the last expiry
        self.counts: dict[str | None, dict[str, int]] = {}
        if by_partition:  # tables of partitions owned before a restart: their owners now rebuild them
            shutil.rmtree(checkpoint_dir / PARTITION_TABLES, ignore_errors=True)
        else:
            self.adopt(None, self.new_table(None), {})

    def table(self, key: str | None) -> SampleTable:
        return self.tables[key if self.by_partition else None]

    def _count(self, key: str | None, what: Count) -> None:
        self.counts[key if self.by_partition else None][what] += 1

    def new_table(self, key: str | None) -> SampleTable:
        """The learner alone's table (``key`` None) as on disk, or partition ``key``'s, empty, for its changelog."""
        if key is None:
            path = self.checkpoint_dir / TABLE
        else:
            path = self.checkpoint_dir / PARTITION_TABLES / key.replace(":", "-")
            shutil.rmtree(path, ignore_errors=True)
        return SampleTable(path, self.cfg.retention_s, self.cfg.compact_every_s)

    def adopt(self, key: str | None, table: SampleTable, counts: dict[str, int]) -> None:
        """Take ``table`` and its change ``counts`` as partition ``key``'s (None: the learner alone's)."""
        self.tables[key] = table
        self.counts[key] = {k: int(counts.get(k, 0)) for k in COUNTS}

    def close(self) -> None:
        """Close every table (one left open would refuse the next one this process opens on its files)."""
        for table in self.tables.values():
            table.close()

    def drop(self, key: str) -> None:
        """A partition let go: its table is the next owner's to rebuild."""
        self.counts.pop(key, None)
        if (table := self.tables.pop(key, None)) is not None:
            table.close()
            shutil.rmtree(table.path, ignore_errors=True)

    def kind_of_label(self, id: str, join: LabelJoin | None, now: float, pending: bool, key: str | None = None
                      ) -> LabelKind:
        """A label for ``id``: a correction of a sample learned or ``pending``, refused for one no longer in the table,
        else the join's. The join is asked first: a step writes the table before it lets go of the join."""
        if self._learned(id, join, now, pending, key):
            return LabelKind.CORRECTION
        if join is None or id in join.joined_ids:
            self._count(key, Count.CORRECTIONS_REFUSED)
            return LabelKind.NOT_CORRECTABLE
        return LabelKind.JOIN

    def kind_of_tombstone(self, id: str, join: LabelJoin | None, now: float, pending: bool, key: str | None = None
                          ) -> TombstoneKind:
        """A tombstone for ``id``: a sample to take out, an image or label let go from the join now, or refused."""
        if self._learned(id, join, now, pending, key):
            return TombstoneKind.FORGET
        if join is not None and join.forget(id):
            self._count(key, Count.DELETIONS_APPLIED)
            return TombstoneKind.WAITING
        self._count(key, Count.DELETIONS_REFUSED)
        return TombstoneKind.NOT_CORRECTABLE

    def _learned(self, id: str, join: LabelJoin | None, now: float, pending: bool, key: str | None) -> bool:
        self.expire(now)
        return pending or (join is not None and id in join.in_flight) or self.table(key).get(id) is not None

    def held(self, id: str) -> Entry | None:
        """What a table holds of ``id``; None: never learned here, deleted, or past retention."""
        return next((entry for table in list(self.tables.values()) if (entry := table.get(id)) is not None), None)

    def keep(self, id: str, label: int, time: float, feature: torch.Tensor, key: str | None = None) -> None:
        """A sample was learned: keep what it added, until it is corrected, deleted or past retention."""
        self.table(key).put(id, Entry(label, time, feature.detach().to("cpu", torch.float32)))

    def apply(self, change: Change, join: LabelJoin | None, model: ModelEdits, key: str | None = None) -> None:
        """Learn one change in ``model``; one whose id left the table since it was read is counted as refused."""
        table, relabel = self.table(key), isinstance(change, Relabel)
        entry = table.get(change.id)
        if entry is None:
            self._count(key, Count.CORRECTIONS_REFUSED if relabel else Count.DELETIONS_REFUSED)
            log.info("%s of %s not applied: it is no longer in the sample table", "correction" if relabel else
                     "deletion", change.id)
            return
        if isinstance(change, Relabel):
            if change.label != entry.label:
                model.relabel_features(entry.feature[None], torch.tensor([entry.label]), torch.tensor([change.label]))
            table.put(change.id, Entry(change.label, change.time, entry.feature))
        else:
            model.forget_features(entry.feature[None], torch.tensor([entry.label]))
            table.delete(change.id)
            if join is not None:
                join.forget(change.id)
        self._count(key, Count.CORRECTIONS_APPLIED if relabel else Count.DELETIONS_APPLIED)

    def expire(self, now: float) -> None:
        """Let the ids past retention go; once per ``EXPIRE_EVERY_S`` of record time, since every label asks."""
        if now < self._expired_at + EXPIRE_EVERY_S:
            return
        self._expired_at = now
        if n := sum(table.expire(now) for table in list(self.tables.values())):
            log.info("%d ids past --corrections.retention_s left the sample table", n)

    def checkpoint(self) -> CorrectionsState:
        """Commit the table's changes as the next generation; returns what the checkpoint keeps."""
        table = self.tables[None]
        generation = table.generation + 1
        table.commit(generation)
        return CorrectionsState(generation, dict(self.counts[None]))

    def settle(self, saved: CorrectionsState) -> None:
        """The checkpoint holding ``saved`` (``checkpoint``'s) is on disk."""
        self.tables[None].settle(saved.generation)

    def restore(self, saved: CorrectionsState | None) -> None:
        """Back to a checkpoint's corrections (None: no checkpoint, or one written without them)."""
        self.tables[None].restore(0 if saved is None else saved.generation)
        self.adopt(None, self.tables[None], {} if saved is None else saved.counts)

    def summary(self) -> dict:
        counts, tables = list(self.counts.values()), list(self.tables.values())  # a rebalance may change them
        return {**{k: sum(c[k] for c in counts) for k in COUNTS}, "ids": sum(len(t) for t in tables),
                "bytes_on_disk": sum(t.bytes_on_disk() for t in tables), "retention_s": self.cfg.retention_s}
