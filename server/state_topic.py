"""Per-partition learner state on the wire: the compacted topic learners in a group write and restore from, as Kafka
Streams keeps a stateful task's state, so it outlives the process and follows its partition to its next learner.

One record (in parts keyed ``<topic>:<partition>/<part>``, as ``server.snapshot_topic`` splits snapshots) holds a
partition's whole ``PartitionState``, so it is never seen half; one of another ``FORMAT`` is refused
(``StateFormatError``). The topic has one partition: every reader sees every state in the order written, and the
newest complete one per partition wins.

Example:
    >>> from mepo_stream.label_statistics import LabelStatistics
    >>> origin = Origin("mepo", "{}", ("cat", "dog"), "ab" * 32, None)
    >>> stats = LabelStatistics.zeros(2, 3, 1)
    >>> state = PartitionState("images:1", stats, 42, {"s": [3, 5]}, origin, "host:8000", 0.0, 1.5, 7)
    >>> back = decode(encode(state))
    >>> back.key, back.offset, back.learned, back.origin == origin, back.stats.shape
    ('images:1', 42, {'s': [3, 5]}, True, (2, 3, 1))
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from mepo_stream.errors import StateRefused
from mepo_stream.kafka import KafkaConfig, ensure_topics
from mepo_stream.label_statistics import LabelStatistics
from server.snapshot_topic import SNAPSHOT_TOPIC_CONFIGS, Origin, Record, blob_metadata, to_records

FORMAT = "mepo-partition-state/1"


class StateFormatError(StateRefused):
    """A state record this learner cannot load: another format, or not a readable state at all."""


@dataclass(frozen=True)
class PartitionState:
    """One partition's learner state, as written to and restored from the state topic."""

    key: str  # "topic:partition" of the image topic
    stats: LabelStatistics
    offset: int  # next offset to read: every record before it is handled
    learned: dict[str, list[int]]  # sample indices learned, per stream id
    origin: Origin  # the model these sums belong to
    learner: str  # who wrote it (host:port)
    written_at: float  # Unix time
    rate: float  # samples per second the writer learned lately (all its partitions)
    lag: int  # records of the partition not learned yet when written
    steps: int | None = None  # samples learned and changes applied ever (None: a state written without it: samples)
    table: dict[str, int] = field(default_factory=dict)  # the sample changelog's committed writes: epoch -> last seq
    changes: dict[str, int] = field(default_factory=dict)  # corrections and deletions applied and refused, by kind
    novelty: dict[str, torch.Tensor] = field(default_factory=dict)  # its novelty threshold's additive state

    @property
    def moves(self) -> int:
        """How often the partition's part of the model changed: a model version is the sum over partitions."""
        return self.stats.samples if self.steps is None else self.steps


def ensure_state_topic(kafka: KafkaConfig) -> None:
    """Create the compacted state topic (one partition: every state in the order it was written)."""
    if kafka.state_topic is None:
        raise ValueError("no state topic is configured (--kafka.state_topic)")
    ensure_topics(kafka, kafka.state_topic, configs=SNAPSHOT_TOPIC_CONFIGS)


def encode(state: PartitionState) -> bytes:
    """The safetensors blob of one partition's state."""
    tensors = {**state.stats.tensors("stats."),
               **{f"learned.{i}": torch.tensor(v, dtype=torch.long) for i, v in enumerate(state.learned.values())},
               **{f"novelty.{k}": v for k, v in state.novelty.items()}}
    meta = {"format": FORMAT, "key": state.key, "offset": str(state.offset), "streams": json.dumps(list(state.learned)),
            "origin": json.dumps(asdict(state.origin)), "learner": state.learner,
            "written_at": repr(state.written_at), "rate": repr(state.rate), "lag": str(state.lag),
            "steps": str(state.moves), "table": json.dumps(state.table), "changes": json.dumps(state.changes)}
    return save_tensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=meta)


def decode(blob: bytes) -> PartitionState:
    """Parse a blob; another format or any defect raises ``StateFormatError`` naming it."""
    try:
        meta = blob_metadata(blob)
    except Exception as e:
        raise StateFormatError(f"not a readable partition state: {type(e).__name__}: {e}") from e
    if meta.get("format") != FORMAT:
        raise StateFormatError(f"a partition state of format {meta.get('format')!r}; this learner reads {FORMAT!r} "
                               f"(written by another version of mepo: run that version, or use a new "
                               f"--kafka.state_topic and --kafka.group_id to start over)")
    try:
        tensors, origin = load_tensors(blob), json.loads(meta["origin"])
        return PartitionState(
            meta["key"], LabelStatistics.from_tensors(tensors, "stats."), int(meta["offset"]),
            {s: tensors[f"learned.{i}"].tolist() for i, s in enumerate(json.loads(meta["streams"]))},
            Origin(**{**origin, "class_names": tuple(origin["class_names"])}), meta["learner"],
            float(meta["written_at"]), float(meta["rate"]), int(meta["lag"]),
            int(meta["steps"]) if "steps" in meta else None, json.loads(meta.get("table", "{}")),
            json.loads(meta.get("changes", "{}")),
            {k.removeprefix("novelty."): v for k, v in tensors.items() if k.startswith("novelty.")})
    except Exception as e:  # missing keys, wrong types: a state we cannot trust
        raise StateFormatError(f"not a readable partition state: {type(e).__name__}: {e}") from e


def state_records(state: PartitionState, chunk_bytes: int) -> list[Record]:
    """The Kafka records of one state: parts keyed ``<key>/<part>``, versioned by the partition's offset."""
    return to_records(encode(state), state.key, state.offset, chunk_bytes, FORMAT)
