"""Refine building blocks: the throw-away meta head (or a cosine one), the group logit mask, the Reptile update,
freezing parameter groups and measuring how far each group moved.

The refine loop itself (``offline/refine.py``) strings these together; they are kept here, pure, so that the
arithmetic is testable on its own.

Example:
    >>> theta0, theta_hat = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    >>> reptile_update(theta0, theta_hat, 0.1)["w"]
    tensor([0.1000, 0.1000])
    >>> tensor_group("blocks.3.attn.qkv.weight"), tensor_group("patch_embed.proj.bias"), tensor_group("norm.weight")
    ('blocks.3', 'patch_embed', 'norm')
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


class CosineHead(nn.Module):
    """``scale`` times the cosine between the feature and each class's weight vector (Baseline++, Chen et al.,
    2019); discarded after refinement.

    Why: it scores only a feature's direction, so the refine gathers each class's features around a direction of
    their own, as a head on new classes can use; a linear head can also separate classes by the norm.

    Example:
        >>> head = CosineHead(4, 3, scale=10.0)
        >>> logits = head(torch.randn(2, 4))  # [2, 3]
        >>> bool((logits.abs() <= 10.0 + 1e-5).all())
        True
    """

    def __init__(self, dim: int, n_classes: int, scale: float = 16.0):
        super().__init__()
        self.scale = scale
        self.weight = nn.Parameter(torch.randn(n_classes, dim) * 0.01)  # [C, D]; AdamW's steps turn it fast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * nn.functional.linear(nn.functional.normalize(x, dim=1),
                                                 nn.functional.normalize(self.weight, dim=1))  # [B, C]


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


def tensor_group(name: str) -> str:
    """The parameter group a state-dict entry belongs to: ``blocks.<i>`` for a transformer block, else the first
    component of its name (``patch_embed``, ``pos_embed``, ``cls_token``, ``norm``, ...)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 1 else parts[0]


def matches(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether parameter ``name`` lies under one of ``prefixes`` (a whole name or a dotted prefix of it)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def freeze(model: nn.Module, prefixes: tuple[str, ...]) -> list[str]:
    """Stop gradients to every parameter under ``prefixes``; returns the frozen names.

    A prefix that names no parameter is an error: a typo must not silently leave the stem trainable.

    Example:
        >>> freeze(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)), ("0",))
        ['0.weight', '0.bias']
    """
    names = [n for n, _ in model.named_parameters()]
    unknown = [p for p in prefixes if not any(matches(n, (p,)) for n in names)]
    if unknown:
        groups = sorted({tensor_group(n) for n in names})
        raise ValueError(f"no parameter under {unknown}; the model's groups are {groups}")
    frozen = [n for n, p in model.named_parameters() if matches(n, prefixes)]
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    return frozen


@torch.no_grad()
def relative_change(base: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> float:
    """||theta - theta_base|| / ||theta_base|| over the floating entries of ``base``, all of them together.

    Example:
        >>> relative_change({"w": torch.ones(4)}, {"w": torch.full((4,), 1.5)})
        0.5
    """
    diff = norm = 0.0
    for k, v in base.items():
        if v.is_floating_point():
            diff += (current[k].detach().cpu().double() - v.detach().cpu().double()).pow(2).sum().item()
            norm += v.detach().cpu().double().pow(2).sum().item()
    return (diff / norm) ** 0.5 if norm > 0 else 0.0


@torch.no_grad()
def group_changes(base: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative change ||theta - theta_base|| / ||theta_base|| of each parameter group (floating entries only).

    Why: one fragile group (the patch embedding) can wreck the features while the blocks barely move; a single
    global number would hide it.
    """
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in base.items():
        groups.setdefault(tensor_group(k), {})[k] = v
    return {g: relative_change(entries, current) for g, entries in groups.items()}
