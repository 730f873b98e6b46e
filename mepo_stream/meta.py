"""Meta Rep building blocks: the throw-away meta head, the group logit mask and the Reptile update.

The refine loop itself (``offline/refine.py``) strings these together; they are kept here, pure, so that the
arithmetic is testable on its own.

Example:
    >>> theta0, theta_hat = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    >>> reptile_update(theta0, theta_hat, 0.1)["w"]
    tensor([0.1000, 0.1000])
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

MaskMode = Literal["multiply", "neg_inf", "none"]


class MetaHead(nn.Sequential):
    """Linear(D, D) -> ReLU -> Linear(D, C), as the reference; discarded after refinement."""

    def __init__(self, dim: int, n_classes: int):
        super().__init__(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, n_classes))


def group_mask(logits: torch.Tensor, group: torch.Tensor, mode: MaskMode) -> torch.Tensor:
    """Restrict logits [B, C] to the group's classes.

    ``multiply`` is the reference: out-of-group logits become 0 (not -inf) and stay in the softmax denominator;
    ``neg_inf`` removes them; ``none`` leaves the logits alone.
    """
    if mode == "none":
        return logits
    keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
    keep[group] = True
    if mode == "multiply":
        return logits * keep
    if mode == "neg_inf":
        return logits.masked_fill(~keep, float("-inf"))
    raise ValueError(f"unknown mask mode {mode!r}")


@torch.no_grad()
def reptile_update(theta0: dict[str, torch.Tensor], theta_hat: dict[str, torch.Tensor], eps: float
                   ) -> dict[str, torch.Tensor]:
    """theta0 + eps * (theta_hat - theta0) for every floating-point entry (integer buffers take theta_hat).

    ``torch.lerp`` is exact at both ends: eps = 0 returns theta0 and eps = 1 returns theta_hat bit for bit.
    """
    return {k: torch.lerp(theta0[k], v, eps) if v.is_floating_point() else v.clone() for k, v in theta_hat.items()}
