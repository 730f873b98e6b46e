"""The refine's optimizer: SGD or AdamW over layer-wise learning rates, with a warmup and cosine schedule.

Why: the paper's SGD at a constant 1e-4 barely moves a ViT in a few minutes, so its features stay where they
were. AdamW with layer-wise learning-rate decay (the top block at the full rate, each block below it
``layer_decay`` times slower, the embeddings slowest) and a cosine schedule is the usual recipe for fine-tuning a
ViT: it moves the upper blocks, where the class semantics live, and keeps the lower ones near the pretrained
weights. docs/refine.md has what each part buys per minute.

Example:
    >>> import timm
    >>> vit = timm.create_model("test_vit", pretrained=False, num_classes=0)
    >>> [round(s, 3) for s in layer_scales(vit, 0.5)[:2]], layer_scales(vit, 0.5)[-1]
    ([0.008, 0.008], 1.0)
    >>> [round(lr_factor(p, warmup=0.1), 3) for p in (0.0, 0.05, 0.1, 0.55, 1.0)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from mepo_stream.meta import tensor_group

Optimizer = Literal["sgd", "adamw"]
Schedule = Literal["constant", "cosine"]


def layer_depth(name: str, n_blocks: int) -> int:
    """How high a backbone parameter sits: 0 for the embeddings (patch, position, CLS), ``i + 1`` for block ``i``,
    ``n_blocks + 1`` for the final norm and anything after the blocks."""
    group = tensor_group(name)
    if group.startswith("blocks."):
        return int(group.split(".")[1]) + 1
    return 0 if group in ("patch_embed", "pos_embed", "cls_token", "reg_token") else n_blocks + 1


def layer_scales(backbone: nn.Module, decay: float) -> list[float]:
    """The learning-rate scale of each of ``backbone``'s parameters (``named_parameters`` order): ``decay`` to the
    power of its distance from the top."""
    n_blocks = len(getattr(backbone, "blocks", ()))
    return [decay ** (n_blocks + 1 - layer_depth(n, n_blocks)) for n, _ in backbone.named_parameters()]


def param_groups(backbone: nn.Module, head: nn.Module, lr_backbone: float, lr_head: float, layer_decay: float,
                 weight_decay: float, own_lr: dict[str, float] | None = None) -> list[dict]:
    """Optimizer groups: the trainable backbone parameters by learning rate (``lr_backbone`` times their layer
    scale, or ``own_lr``'s rate for a name given there), then the head. Weight decay applies to matrices only
    (not to biases, norms, LayerScale, embeddings' vectors), as in timm's fine-tuning recipes."""
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for (name, p), scale in zip(backbone.named_parameters(), layer_scales(backbone, layer_decay), strict=True):
        if p.requires_grad:
            lr = (own_lr or {}).get(tensor_group(name), lr_backbone * scale)
            groups.setdefault((lr, weight_decay if p.ndim >= 2 else 0.0), []).append(p)
    out = [{"params": ps, "lr": lr, "base_lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]
    return out + [{"params": list(head.parameters()), "lr": lr_head, "base_lr": lr_head, "weight_decay": 0.0}]


def create_optimizer(groups: list[dict], kind: Optimizer, momentum: float) -> torch.optim.Optimizer:
    """SGD with ``momentum`` (the paper's) or AdamW (betas 0.9, 0.999), fused on the CPU and CUDA: one kernel
    per tensor, not one per operation."""
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=momentum)
    if kind == "adamw":
        return torch.optim.AdamW(groups, fused=groups[0]["params"][0].device.type in ("cpu", "cuda"))
    raise ValueError(f"unknown optimizer {kind!r}; use sgd or adamw")


def lr_factor(progress: float, schedule: Schedule = "cosine", warmup: float = 0.0) -> float:
    """The learning rate's share of its base value at ``progress`` (0 to 1, the run's images seen so far):
    linear warmup over the first ``warmup`` of the run, then constant or a cosine down to 0."""
    if progress < warmup:
        return progress / warmup
    if schedule == "constant":
        return 1.0
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-12, 1 - warmup))))


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Every group's learning rate to ``factor`` times its ``base_lr``."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
