"""Checkpoints: one atomically written file of tensors and plain values, read back without unpickling objects; and
the learner's checkpoint, typed (``LearnerCheckpoint``), which the service writes and the export reads.

``torch.save`` of nested dicts/lists of tensors, numbers and strings is readable by ``torch.load(...,
weights_only=True)``, which refuses arbitrary objects; so a tampered checkpoint can fail to load but cannot
run code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from mepo_stream.errors import StateRefused
from mepo_stream.files import atomic_path


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return path


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint written by ``save_checkpoint`` (``weights_only=True``)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path} is not a readable mepo checkpoint: {e}") from e


FORMAT = "mepo-checkpoint/2"
"""What a learner checkpoint holds: version 2 is version 1 with the ``format`` key (a file without it is version 1)."""
READABLE_FORMATS = ("mepo-checkpoint/1", FORMAT)


@dataclass(frozen=True)
class StreamPosition:
    """Where a learner stands in its stream: what its model has learned, so model and offsets roll back together."""

    offsets: dict[str, int]
    """Next offset to read per ``topic:partition``, every record before it handled."""
    learned: dict[str, torch.Tensor]
    """Learned sample ids per stream (index tensors), so a replayed record is not learned twice."""
    dead_lettered: int = 0
    replays_skipped: int = 0
    join: dict | None = None
    """The label join's state (labels that come later; None: off)."""
    stream_time: float = 0.0
    """The join's clock: the newest record time seen."""


@dataclass(frozen=True)
class CorrectionsState:
    """What a checkpoint keeps of the corrections: the sample table's generation it names, so the table rolls back
    with the model, and the change counts."""

    generation: int
    counts: dict[str, int]

    def to_dict(self) -> dict[str, int]:
        return {"generation": self.generation, **self.counts}

    @classmethod
    def from_dict(cls, saved: dict[str, int]) -> CorrectionsState:
        return cls(int(saved["generation"]), {k: int(v) for k, v in saved.items() if k != "generation"})


@dataclass(frozen=True)
class LearnerCheckpoint:
    """A learner alone's checkpoint. The file is one flat dict of tensors and plain values (``save``; the position's
    fields beside the others), which ``load`` types again."""

    learner: dict
    """``OnlineLearner.state_dict()``: trainable tensors, optimizer, seen classes, samples seen."""
    version: int
    """The model version it holds (what predictions report)."""
    time: float
    """Wall time it was taken."""
    position: StreamPosition
    monitor: dict
    """The drift monitor's state."""
    anytime: dict | None
    """The any-time evaluation's curve and schedule (None: no evaluation)."""
    rng: torch.Tensor
    """The CPU RNG: the augmentation draws go on as if nothing had happened."""
    corrections: CorrectionsState | None = None
    """None: corrections off."""

    @property
    def samples_seen(self) -> int:
        return int(self.learner["samples_seen"])

    def save(self, path: str | Path) -> Path:
        """Write atomically, as one flat dict."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "position"}
        position = {f.name: getattr(self.position, f.name) for f in fields(self.position)}
        corrections = None if self.corrections is None else self.corrections.to_dict()
        return save_checkpoint(path, {"format": FORMAT, **flat, **position, "corrections": corrections})

    @classmethod
    def load(cls, path: str | Path) -> LearnerCheckpoint:
        """Read a checkpoint this version reads; another format, or a file that is no learner checkpoint, is refused
        whole, with what to do."""
        state = load_checkpoint(path)
        fmt = state.pop("format", "mepo-checkpoint/1")
        if fmt not in READABLE_FORMATS:
            raise StateRefused(f"{path} is a checkpoint of format {fmt!r}; this version of mepo reads "
                               f"{READABLE_FORMATS}. Run the version that wrote it, or move it away to start "
                               f"learning from scratch")
        try:
            position = StreamPosition(**{f.name: state.pop(f.name) for f in fields(StreamPosition) if f.name in state})
            if (corrections := state.pop("corrections", None)) is not None:
                state["corrections"] = CorrectionsState.from_dict(corrections)
            return cls(position=position, **{f.name: state[f.name] for f in fields(cls) if f.name in state})
        except (TypeError, KeyError) as e:
            raise StateRefused(f"{path} is no learner checkpoint ({e}); move it away to learn from scratch") from e
