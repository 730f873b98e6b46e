"""Row-wise computations that run in one fixed shape, so that a row's result depends on that row alone.

Why: the math libraries pick kernels by shape. A matrix product of 1 row takes another kernel (a matrix-vector
product) than one of 3 or 24 rows, and other kernels round differently: the same image's logits then differ in the
last bits with the number of images asked with it (fp32 and fp64 alike, on every CPU seen). Run in blocks of exactly
``size`` rows, the last padded with zeros whose outputs are dropped, every row meets the same kernel whatever the
batch around it.

Example (a row alone, or among others: the same bits):
    >>> weight = torch.randn(10, 384)
    >>> rows = torch.randn(5, 384)
    >>> logits = lambda h: h @ weight.T
    >>> torch.equal(in_blocks(logits, 8, rows[:1]), in_blocks(logits, 8, rows)[:1])
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def pad_rows(rows: torch.Tensor, size: int) -> torch.Tensor:
    """Rows [B, ...], B <= size, padded with zeros (black images, zero features) to [size, ...]."""
    missing = size - len(rows)
    return rows if missing == 0 else torch.cat([rows, rows.new_zeros(missing, *rows.shape[1:])])


def in_blocks(fn: Callable[..., torch.Tensor], size: int | None, *rows: torch.Tensor | None) -> torch.Tensor:
    """``fn(*rows)`` [N, ...], computed on blocks of exactly ``size`` rows of each tensor in ``rows`` (all [N, ...],
    or None, passed on as None); ``size`` None: on all N rows at once. ``fn`` must be row-wise: row i of its output
    a function of row i of its inputs."""
    n = len(next(r for r in rows if r is not None))
    if size is None or n == 0:
        return fn(*rows)
    outputs = []
    for start in range(0, n, size):
        block = [None if r is None else pad_rows(r[start:start + size], size) for r in rows]
        outputs.append(fn(*block)[:min(size, n - start)])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
