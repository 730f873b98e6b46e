"""Pseudo task sequences for Meta Rep: what one meta-epoch of ``refine`` trains on.

Each meta-epoch (paper Alg. 1, step 1; reference ``meta_post_training.py``):

1. permute the pretraining classes and cut them into groups of ``classes_per_group`` (the reference: 10 groups
   of 100 ImageNet classes, one Reptile update each; the paper: one sampled group C_meta of 100 classes);
2. draw ``samples_per_class`` images of every class of a group and split them by ``val_ratio`` (the paper's
   gamma) into the meta-training part (sequential tasks) and the meta-validation part (the joint step);
3. cut the group's classes into ``n_tasks`` consecutive pseudo tasks (the reference: 50 tasks of 2 classes).

Everything is drawn from a generator seeded by ``(seed, meta_epoch)``, so a resumed run and every
distributed rank rebuild the very same plan.

Example:
    >>> cfg = PseudoTaskConfig(classes_per_group=2, n_tasks=2, samples_per_class=3, val_ratio=1 / 3)
    >>> plan = meta_epoch_plan([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3], cfg, seed=1, meta_epoch=1)
    >>> len(plan), [len(t) for t in plan[0].tasks], len(plan[0].joint)
    (2, [2, 2], 2)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mepo_stream.recipes import tracks_given


@tracks_given
@dataclass(frozen=True)
class PseudoTaskConfig:
    """How pseudo task sequences are drawn from the pretraining data."""

    classes_per_group: int = 100
    """Classes per group (one Reptile update per group). Paper |C_meta| = 100; reference 100."""
    n_tasks: int = 50
    """Sequential pseudo tasks T' per group. Reference 50 (2 classes each); the paper leaves T' open."""
    samples_per_class: int = 200
    """Images drawn per class. Reference 200; paper 400 (Tiny-ImageNet has 250 per class)."""
    val_ratio: float = 0.3
    """Share of each class's images held out for the joint step (the paper's gamma = 0.3). The reference
    instead draws the joint set independently (it may overlap the sequential one)."""


@dataclass(frozen=True)
class GroupPlan:
    """One Reptile update: the group's classes, its sequential tasks and its joint (validation) samples."""

    classes: list[int]
    tasks: list[list[int]]
    joint: list[int]


def _generator(seed: int, meta_epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + meta_epoch)


def meta_epoch_plan(targets: Sequence[int] | torch.Tensor, cfg: PseudoTaskConfig, seed: int, meta_epoch: int
                    ) -> list[GroupPlan]:
    """The groups of one meta-epoch over a dataset with labels ``targets`` (sample indices in the plan)."""
    if not 0.0 < cfg.val_ratio < 1.0:
        raise ValueError(f"val_ratio must be in (0, 1), got {cfg.val_ratio}")
    labels = torch.as_tensor(targets)
    n_classes = int(labels.max()) + 1
    if cfg.classes_per_group > n_classes or cfg.n_tasks > cfg.classes_per_group:
        raise ValueError(f"need n_tasks <= classes_per_group <= #classes, got {cfg.n_tasks}, "
                         f"{cfg.classes_per_group}, {n_classes}")
    g = _generator(seed, meta_epoch)
    order = torch.randperm(n_classes, generator=g).tolist()
    plans = []
    for start in range(0, n_classes - cfg.classes_per_group + 1, cfg.classes_per_group):
        classes = order[start : start + cfg.classes_per_group]
        seq: dict[int, list[int]] = {}
        joint: list[int] = []
        for c in classes:
            pool = (labels == c).nonzero().squeeze(1)
            take = pool[torch.randperm(len(pool), generator=g)[: cfg.samples_per_class]].tolist()
            n_val = max(1, round(len(take) * cfg.val_ratio))
            seq[c], joint = take[n_val:], joint + take[:n_val]
        bounds = [round(i * len(classes) / cfg.n_tasks) for i in range(cfg.n_tasks + 1)]
        tasks = [[i for c in classes[bounds[t] : bounds[t + 1]] for i in seq[c]] for t in range(cfg.n_tasks)]
        plans.append(GroupPlan(classes, tasks, joint))
    return plans


def shuffled_batches(indices: list[int], batch_size: int, g: torch.Generator) -> list[list[int]]:
    """``indices`` in a random order (from ``g``), cut into batches."""
    perm = torch.randperm(len(indices), generator=g).tolist()
    order = [indices[j] for j in perm]
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
