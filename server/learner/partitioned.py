"""A learner in a group (``--kafka.state_topic``): state per partition, kept in Kafka, one merged model.

As in Kafka Streams, state is kept per partition and moves with it: the label-indexed sums learned from it, its next
offset and learned ids, written together to the state topic (``server.state_topic``) before the offsets are committed.
Sums of disjoint parts of a stream add up, so every learner serves exactly the model one learner would have built; a
follower thread merges the other partitions' newer states, and each sample table moves through a changelog
(``server.learner.table_changelog``). A model whose state depends on the stream's order is refused at start.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from kafka.errors import KafkaError

from mepo_stream.checkpoint import LearnerCheckpoint
from mepo_stream.errors import ConfigError, StateRefused
from mepo_stream.label_statistics import LabelStatistics
from mepo_stream.learner import OnlineLearner
from mepo_stream.methods.base import Encoded
from mepo_stream.novelty import NoveltyThreshold
from server.config import ServeConfig
from server.learner.book import Pending, StreamBook
from server.learner.changelog import Changelog, ChangelogFollower
from server.learner.corrections import Corrections
from server.learner.state import CHECKPOINT, Adopted, Capture, Incoming, LearnerState, Restored, open_learner
from server.learner.table_changelog import PartitionTables, Write
from server.learner.view import GroupView
from server.metrics import ServerMetrics
from server.model_thread import ModelThread
from server.snapshot_topic import Origin
from server.state_topic import PartitionState

log = logging.getLogger(__name__)
MIGRATED = ".migrated"


def migrated_state(path: Path, origin: Origin, learner_id: str, shape: tuple[int, int, int]) -> PartitionState | None:
    """A single learner's checkpoint as its one partition's state (None: none); refused where it cannot be split."""
    if not path.is_file():
        return None
    saved = LearnerCheckpoint.load(path)
    if saved.corrections is not None:
        raise StateRefused(f"{path} is the checkpoint of one learner with --corrections.enabled: its sample table "
                           f"cannot move into a group's changelog. Keep learning alone, or move the checkpoint "
                           f"and its samples/ folder away to learn the stream again in a group")
    keys = sorted(saved.position.offsets)
    if len(keys) > 1:
        raise StateRefused(f"{path} is the checkpoint of one learner over {len(keys)} partitions ({keys}): its "
                           f"sums cannot be split between them. Keep learning without --kafka.state_topic, or "
                           f"move the checkpoint away to learn the stream again in a group")
    stats = OnlineLearner.statistics_in(saved.learner)
    if stats.shape != shape:
        raise StateRefused(f"{path} holds a model of shape {stats.shape}, this learner's is {shape}")
    learned = {s: v.tolist() for s, v in saved.position.learned.items()}
    key = keys[0] if keys else ""
    return PartitionState(key, stats, int(saved.position.offsets.get(key, 0)), learned, origin, learner_id,
                          time.time(), 0.0, 0)


@dataclass(frozen=True)
class GroupCapture(Capture):
    """A learner in a group's: the states of the partitions that moved, and the table changes they include."""

    states: list[PartitionState]
    tables: list[Write]


@dataclass(frozen=True)
class PartitionEdits:
    """A change is learned in its partition's part of the model: the sums the partition's state carries."""

    part: LabelStatistics
    learner: OnlineLearner
    moved: Callable[[int], None]  # told how many samples a change moved (the group then loads the new total)
    lock: threading.Lock  # the group's: its view reads the sums from other threads

    def forget_features(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        with self.lock:
            self.part.remove(self.learner.classifier_inputs(features), labels)
        self.moved(len(labels))

    def relabel_features(self, features: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
        with self.lock:
            self.part.move(self.learner.classifier_inputs(features), old, new)
        self.moved(len(old))


class InGroup:
    """Sums per owned partition in ``own``, the others' newest states in ``remote``; the learner holds their total.
    Its fields are the model thread's; ``lock`` guards what the HTTP threads read (``group_view``)."""

    def __init__(self, cfg: ServeConfig, metrics: ServerMetrics, changelog: Changelog, learner_id: str,
                 tables: PartitionTables | None = None):
        self.cfg, self.metrics, self.changelog, self.learner_id = cfg, metrics, changelog, learner_id
        self.checkpoint_path = cfg.checkpoint_dir / CHECKPOINT
        self.tables = tables  # the owned partitions' sample tables on Kafka (None: corrections off)
        self.lock = threading.Lock()
        self.own: dict[str, LabelStatistics] = {}
        self.steps: dict[str, int] = {}  # per owned partition: samples learned and changes applied, ever
        self.remote: dict[str, PartitionState] = {}
        self.written: dict[str, PartitionState] = {}  # the last state this learner wrote, per partition
        self.lag: dict[str, int] = {}  # the loop's, per partition (``start_following`` shares it)
        self.follower: ChangelogFollower | None = None
        self._remote_total: LabelStatistics | None = None
        self._remote_novelty: NoveltyThreshold | None = None  # the remote partitions' thresholds, summed
        self._replaced = 0  # remote states folded into ``_remote_total`` by replacement since it was summed afresh
        self._migration: PartitionState | None = None
        self.novelty: dict[str, NoveltyThreshold] = {}  # per owned partition: the scores of its images
        self.rate_mark = (time.monotonic(), 0)  # (when, learned_here) at the last persist
        self.learned_here = 0  # samples this learner learned (not merged from others)

    def restore(self, learner: OnlineLearner, origin: Origin) -> Restored | None:
        """Refuse what cannot be merged, prepare a migration, and load every partition's newest state."""
        if (why := learner.not_mergeable) is not None:
            raise ConfigError(f"--kafka.state_topic: learners in a group add their partitions' sums into one model, "
                              f"but --method {self.cfg.method} with --learner.classifier "
                              f"{self.cfg.learner.classifier} cannot be merged: {why}")
        self.origin, self._empty = origin, learner.statistics()  # zeros of this model's shape
        self._migration = migrated_state(self.checkpoint_path, origin, self.learner_id, self._empty.shape)
        try:
            states = self.changelog.read_all()
        except KafkaError as e:  # the follower and the assignment read the topic once the broker is back
            log.warning("could not read the state topic at start (%s); the partitions' states come later", e)
            return None
        for state in states.values():
            self._check(state)
            self.remote[state.key] = state
        self._remote_total = self._remote_novelty = None
        self._load_total(learner)
        return Restored(self.next_version(0))

    def _check(self, state: PartitionState) -> None:
        """Refuse a partition state of another model than this learner's: its sums mean something else."""
        if state.origin == self.origin:
            return
        what = [name for name in ("model", "model_config", "class_names", "backbone_sha256", "bundle_sha256")
                if getattr(state.origin, name) != getattr(self.origin, name)]
        raise StateRefused(f"the state topic {self.cfg.kafka.state_topic} holds {state.key}'s state written by "
                           f"{state.learner} for another model (its {', '.join(what)} differ from this learner's): "
                           f"every learner of a group needs the same options, backbone and bundle. Start this one "
                           f"with the group's options, or use another --kafka.state_topic and --kafka.group_id")

    def read(self, keys: list[str], corrections: Corrections | None) -> Incoming:
        """Every partition's newest state (or a migrated checkpoint's), and the assigned ones' rebuilt tables."""
        states = self.changelog.read_all()
        for state in states.values():
            self._check(state)
        if self._migration is not None and self._migration.key in keys and self._migration.key not in states:
            migrated = self._migration
            self.changelog.write([migrated])
            self.checkpoint_path.rename(self.checkpoint_path.with_name(self.checkpoint_path.name + MIGRATED))
            log.info("migrated %s into %s's state on %s", self.checkpoint_path, migrated.key,
                     self.cfg.kafka.state_topic)
            states[migrated.key], self._migration = migrated, None
        tables = {} if self.tables is None or corrections is None else self.tables.restore(keys, states, corrections)
        return Incoming(states, tables)

    def adopt(self, learner: OnlineLearner, keys: list[str], incoming: Incoming) -> list[Adopted]:
        """Own each assigned partition from its newest state (or nothing), keep the others' newer states."""
        adopted = []
        with self.lock:
            for key, state in incoming.states.items():
                if key not in keys:
                    self._newer_remote(state)
            for key in keys:
                found = incoming.states.get(key)
                self.own[key] = self._empty.clone() if found is None else found.stats.clone()
                self.remote.pop(key, None)
                self.steps[key] = 0 if found is None else found.moves
                self.novelty[key] = self._threshold({} if found is None else found.novelty)
                if self.tables is not None:
                    self.tables.adopt(key, found)
                if found is not None:
                    self.written[key] = found
                table, stale = incoming.tables.get(key, (None, False))
                adopted.append(Adopted(key, 0 if found is None else found.offset,
                                       {} if found is None else found.learned, table,
                                       {} if found is None else found.changes, stale))
            self._remote_total = self._remote_novelty = None
        self._load_total(learner)
        self.metrics.partitions_owned.set(len(self.own))
        return adopted

    def revoke(self, learner: OnlineLearner, keys: list[str]) -> list[str]:
        """Let revoked partitions go (persisted just before): their sums stay in the model as their last state."""
        with self.lock:
            for key in keys:
                self.own.pop(key, None)
                self.steps.pop(key, None)
                self.novelty.pop(key, None)
                if self.tables is not None:
                    self.tables.drop(key)
                if key in self.written:
                    self.remote[key] = self.written[key]
            self._remote_total = self._remote_novelty = None
        self._load_total(learner)
        self.metrics.partitions_owned.set(len(self.own))
        return keys

    def merge(self, learner: OnlineLearner, state: PartitionState) -> bool:
        """Another learner's newer state of a partition replaces its sums (False: not newer)."""
        self._check(state)
        with self.lock:
            if not self._newer_remote(state):
                return False
        self._load_total(learner)
        return True

    def start_following(self, lag: dict[str, int], on_state: Callable[[PartitionState], None],
                        on_error: Callable[[StateRefused], None]) -> None:
        """Tail the state topic for the other learners' states; ``lag`` is what this learner's states report."""
        self.lag = lag
        self.follower = ChangelogFollower(self.cfg.kafka, on_state, on_error)
        self.follower.start()

    def stop_following(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        self.changelog.close()

    def _newer_remote(self, state: PartitionState) -> bool:
        """Keep ``state`` as a partition's remote sums if not owned here and newer than the kept one."""
        kept = self.remote.get(state.key)
        if state.key in self.own or (kept is not None and (kept.offset, kept.written_at) >= (state.offset,
                                                                                              state.written_at)):
            return False  # owned here, older, or the very state already kept (the follower re-reads the topic)
        self.remote[state.key] = state
        if self._remote_total is not None and self._replaced < len(self.remote):
            self._remote_total = self._remote_total.replace_part(None if kept is None else kept.stats, state.stats)
            self._replaced += 1
        else:  # summed afresh at the next load: the rounding of the replacements never accumulates
            self._remote_total, self._replaced = None, 0
        self._remote_novelty = None  # summed again at the next load
        return True

    def _load_total(self, learner: OnlineLearner) -> None:
        """Load the sum of every partition's sums; the remote total is kept and patched per merge (O(1) parts)."""
        start = time.perf_counter()
        if self._remote_total is None:
            self._remote_total = LabelStatistics.total([s.stats for s in self.remote.values()], like=self._empty)
            self._replaced = 0
        learner.load_statistics(LabelStatistics.total([self._remote_total, *self.own.values()]))
        learner.flush_novelty()  # its partitions' thresholds whole before they are summed: the learners agree
        if self._remote_novelty is None:  # the other partitions' thresholds change only when their states do
            self._remote_novelty = NoveltyThreshold.merged([self._threshold(s.novelty) for s in self.remote.values()]
                                                           or [self._threshold({})])
        learner.novelty_threshold = NoveltyThreshold.merged([self._remote_novelty, *self.novelty.values()]).settle()
        self.metrics.merge_seconds.observe(time.perf_counter() - start)

    def _threshold(self, state: dict[str, torch.Tensor]) -> NoveltyThreshold:
        """A partition's novelty threshold from its state (empty: new); summed over partitions, every learner agrees."""
        threshold = NoveltyThreshold(self.cfg.novelty.false_alarm, self.cfg.novelty.half_life)
        if state:
            threshold.load_state_dict(state)
        return threshold

    def new_book(self, learn_replays: bool) -> StreamBook:
        """A book that keeps the ids learned from each partition: a partition's state carries them."""
        return StreamBook(learn_replays=learn_replays, by_partition=True)

    def groups(self, pending: list[Pending]) -> list[tuple[str | None, list[Pending]]]:
        """One partition's records a mini-batch (partitions in the order they first appear): each adds to its sums."""
        groups: dict[str | None, list[Pending]] = {}
        for p in pending:
            groups.setdefault(p.key, []).append(p)
        return list(groups.items())

    def check_assignment(self, images: set[int], everything: set[int] | None) -> StateRefused | None:
        """Any share of the partitions: the group's states add up to the model."""
        return None

    def update(self, learner: OnlineLearner, images: torch.Tensor, labels: torch.Tensor, encoded: Encoded | None,
               key: str | None, positions: torch.Tensor) -> torch.Tensor | None:
        """Score novelty into ``key``'s threshold, predict with the merged model, add the batch to ``key``'s sums."""
        assert key is not None
        encoded = learner.encode(images) if encoded is None else encoded
        learner.observe_novelty(encoded, labels, positions, self.novelty[key])  # its partition's, before learning
        pred, h, hits = learner.statistics_step(images, labels, encoded)
        with self.lock:
            self.own[key].add(h, labels, hits)
        self._moved(learner, key, len(labels))
        self.learned_here += len(labels)
        return pred

    def edits(self, learner: OnlineLearner, key: str | None) -> PartitionEdits:
        """A change is learned in its partition's sums."""
        assert key is not None
        return PartitionEdits(self.own[key], learner, partial(self._moved, learner, key), self.lock)

    def _moved(self, learner: OnlineLearner, key: str, n: int) -> None:
        """``n`` samples or changes moved partition ``key``'s sums: the classifier loads the new total."""
        self.steps[key] += n
        self._load_total(learner)

    def next_version(self, version: int) -> int:
        """Moves of the merged model over all partitions (deletions too): the same on learners with the same states."""
        return sum(self.steps.values()) + sum(state.moves for state in self.remote.values())

    def capture(self, checkpoint: Callable[[], LearnerCheckpoint], moved: list[tuple[str, int | None, dict]],
                corrections: Corrections | None) -> GroupCapture:
        """The state of every partition that ``moved`` (key, offset, learned ids), with its sample-table changes."""
        now = time.time()
        (then, learned), rate_mark = self.rate_mark, (time.monotonic(), self.learned_here)
        rate, self.rate_mark = (self.learned_here - learned) / max(rate_mark[0] - then, 1e-3), rate_mark
        tables = [] if self.tables is None or corrections is None else [
            write for key, _, _ in moved if (write := self.tables.capture(key, corrections.tables[key])) is not None]
        states = [PartitionState(key, self.own[key].clone(), offset, learned, self.origin, self.learner_id,
                                 now, rate, int(self.lag.get(key, 0)), self.steps[key],
                                 {} if self.tables is None else self.tables.included(key),
                                 {} if corrections is None else dict(corrections.counts[key]),
                                 {k: v.clone() for k, v in self.novelty[key].state_dict().items()})
                  for key, offset, learned in moved if offset is not None]  # moved: handled records
        return GroupCapture({s.key: s.offset for s in states}, now, states, tables)

    def write(self, captured: Capture, corrections: Corrections | None) -> None:
        """Write the table changes, then the partition states that include them, each acknowledged."""
        assert isinstance(captured, GroupCapture)  # what this membership's capture took
        written = self.tables.changelog.write(captured.tables) if self.tables and captured.tables else 0
        written += self.changelog.write(captured.states) if captured.states else 0
        with self.lock:
            self.written.update({s.key: s for s in captured.states})
        self.metrics.state_writes.inc(len(captured.states))
        self.metrics.state_bytes.inc(written)

    def group_view(self) -> GroupView:
        """Each learner's partitions, rate and lag, and what the model holds of each partition."""
        with self.lock:
            samples = {k: st.stats.samples for k, st in self.remote.items()} | {
                k: st.samples for k, st in self.own.items()}
            then, learned = self.rate_mark
            rate = round((self.learned_here - learned) / max(time.monotonic() - then, 1e-3), 1)  # since the persist
            mine = {"partitions": sorted(self.own), "samples_per_second": rate,
                    "lag": {k: int(self.lag.get(k, 0)) for k in sorted(self.own)}}
            learners: dict[str, dict[str, Any]] = {self.learner_id: mine}
            for key, state in sorted(self.remote.items()):
                entry = learners.setdefault(state.learner, {"partitions": [], "samples_per_second": state.rate,
                                                            "lag": {}})
                entry["partitions"].append(key)
                entry["lag"][key] = state.lag
        return GroupView(self.learner_id, learners, samples)


def open_group_learner(cfg: ServeConfig, metrics: ServerMetrics, model_thread: ModelThread | None = None
                       ) -> LearnerState:
    """The factory of a learner in a group: ``open_learner`` with an ``InGroup`` membership."""
    if cfg.kafka.labels_topic is not None:
        raise ConfigError("--kafka.labels_topic with --kafka.state_topic: a label must reach the learner that "
                          "holds its image, which a group's partitioning does not promise yet; learn labels "
                          "that come later with one learner")
    tables = PartitionTables(cfg.kafka) if cfg.corrections.enabled else None
    membership = InGroup(cfg, metrics, Changelog(cfg.kafka), f"{socket.gethostname()}:{cfg.port}", tables)
    return open_learner(cfg, metrics, model_thread, membership)
