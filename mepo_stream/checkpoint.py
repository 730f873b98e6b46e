"""Checkpoints: one atomically written file of tensors and plain values, read back without unpickling objects.

``torch.save`` of nested dicts/lists of tensors, numbers and strings is readable by ``torch.load(...,
weights_only=True)``, which refuses arbitrary objects; so a tampered checkpoint can fail to load but cannot
run code.
"""

from __future__ import annotations

from pathlib import Path

import torch

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
