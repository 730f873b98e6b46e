"""Si-Blurry stream construction (MISA/MePo's `OnlineSampler` with `rnd_NM=True`).

A Si-Blurry stream has blurry task boundaries: N% of the classes are *disjoint* (each belongs to exactly one
task), the rest are *blurry*, and M% of the blurry classes' samples are shuffled across tasks, so that a
class can show up before "its" task, including in an earlier one. Split points are random, so tasks have
uneven (possibly zero) numbers of classes and samples.

Every random draw comes from one ``torch.Generator`` seeded with ``seed``, in the reference's order, so for
the same dataset order, ``n_tasks``, ``n``, ``m`` and ``seed`` the sample order is the reference's, draw for
draw.

Notation: as in the reference CLI, ``n`` is the *disjoint-class* percentage and ``m`` the *blurry-sample*
percentage (the paper's prose swaps the letters). The paper's setting is ``n=50, m=10, n_tasks=5``.

Example:
    >>> stream = si_blurry_stream([0, 0, 1, 1, 2, 2, 3, 3], n_tasks=2, n=50, m=10, seed=1)
    >>> sorted(i for task in stream.tasks for i in task)
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SiBlurryShape:
    """How a dataset becomes Si-Blurry streams, whatever the seed (``mepo evaluate`` takes its seeds apart)."""

    n_tasks: int = 5
    """Number of (hidden) tasks the stream is cut into."""
    n: int = 50
    """Disjoint-class ratio in percent (the reference's ``--n``)."""
    m: int = 10
    """Blurry-sample ratio in percent (the reference's ``--m``)."""


@dataclass(frozen=True)
class SiBlurryConfig(SiBlurryShape):
    """How a dataset becomes one Si-Blurry stream."""

    seed: int = 1
    """Seed of the one ``torch.Generator`` every draw comes from."""


@dataclass(frozen=True)
class SiBlurryStream:
    """The stream as per-task lists of dataset indices (the learner sees ``order``, never ``tasks``)."""

    tasks: list[list[int]]
    disjoint_classes: list[list[int]]
    blurry_classes: list[list[int]]

    @property
    def order(self) -> list[int]:
        """All sample indices in stream order."""
        return [i for task in self.tasks for i in task]

    @property
    def task_ends(self) -> list[int]:
        """Stream position after the last sample of each task (for end-of-task evaluation)."""
        ends, total = [], 0
        for task in self.tasks:
            total += len(task)
            ends.append(total)
        return ends


def _random_cuts(pool: list[int], n_tasks: int, g: torch.Generator) -> list[list[int]]:
    """Cut ``pool`` into ``n_tasks`` consecutive chunks at ``n_tasks-1`` sorted random points."""
    if not pool:
        return [[] for _ in range(n_tasks)]
    cuts = torch.randint(0, len(pool), (n_tasks - 1,), generator=g).sort().values.tolist()
    bounds = [0, *cuts, len(pool)]
    return [pool[bounds[i] : bounds[i + 1]] for i in range(n_tasks)]


def _quota_bounds(total: int, n_tasks: int, g: torch.Generator) -> list[int]:
    """Uneven per-task quotas summing to ``total``, as cumulative bounds ``[0, ..., total]``."""
    cuts = torch.randint(0, total, (n_tasks - 1,), generator=g).sort().values.tolist()
    return [0, *cuts, total]


def si_blurry_stream(targets: Sequence[int], n_tasks: int = 5, n: int = 50, m: int = 10, seed: int = 1
                     ) -> SiBlurryStream:
    """Build the Si-Blurry stream for a dataset whose labels (in dataset order) are ``targets``.

    Labels must be ``0..C-1`` (ImageFolder indices). The number of classes is ``max(targets) + 1``.
    """
    if n_tasks < 1:
        raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
    if not (0 <= n <= 100 and 0 <= m <= 100):
        raise ValueError(f"n and m are percentages in [0, 100], got n={n}, m={m}")
    targets = [int(t) for t in targets]
    n_classes = max(targets) + 1
    g = torch.Generator().manual_seed(seed)

    n_disjoint = (n_classes * n // 100) // n_tasks * n_tasks  # floored to a multiple of n_tasks
    class_order = torch.randperm(n_classes, generator=g).tolist()
    disjoint = _random_cuts(class_order[:n_disjoint], n_tasks, g)
    blurry = _random_cuts(class_order[n_disjoint:], n_tasks, g)

    owner: dict[int, tuple[int, bool]] = {}  # class -> (task, is_blurry)
    for t in range(n_tasks):
        owner.update({c: (t, False) for c in disjoint[t]})
        owner.update({c: (t, True) for c in blurry[t]})
    disjoint_idx: list[list[int]] = [[] for _ in range(n_tasks)]
    blurry_idx: list[list[int]] = [[] for _ in range(n_tasks)]
    for i, y in enumerate(targets):  # dataset order matters: the first k_t blurry samples get moved
        t, is_blurry = owner[y]
        (blurry_idx if is_blurry else disjoint_idx)[t].append(i)

    n_blurred = sum(len(b) for b in blurry_idx) * m // 100
    if n_blurred > 0:
        bounds = _quota_bounds(n_blurred, n_tasks, g)
        quota = [bounds[t + 1] - bounds[t] for t in range(n_tasks)]
        pool: list[int] = []
        for t in range(n_tasks):
            pool += blurry_idx[t][: quota[t]]
            blurry_idx[t] = blurry_idx[t][quota[t] :]
        pool = [pool[j] for j in torch.randperm(len(pool), generator=g).tolist()]
        for t in range(n_tasks):
            blurry_idx[t] += pool[: quota[t]]
            pool = pool[quota[t] :]

    tasks = []
    for t in range(n_tasks):
        merged = disjoint_idx[t] + blurry_idx[t]
        tasks.append([merged[j] for j in torch.randperm(len(merged), generator=g).tolist()])
    return SiBlurryStream(tasks=tasks, disjoint_classes=disjoint, blurry_classes=blurry)
