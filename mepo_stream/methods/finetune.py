"""The lower bounds of the paper's Table 1: linear probe, sequential fine-tuning, and Seq FT with a slow learner.

* ``linear_probe``: the backbone stays frozen; only the linear head learns.
* ``seq_ft``: the whole model learns at one learning rate, sequentially, with no protection from forgetting.
* ``seq_ft_sl``: Seq FT with a *slow learner* (SLCA): the backbone's learning rate is ``backbone_lr_scale``
  times the head's (SLCA uses 1e-4 against 1e-2, i.e. 0.01).

The feature is the backbone's CLS token after the final norm, the same place the host methods align.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mepo_stream.backbone import cls_feature
from mepo_stream.methods.base import ContinualMethod, Encoded, Readout


@dataclass(frozen=True)
class FineTuneConfig:
    """Sequential fine-tuning of the whole model."""

    backbone_lr_scale: float = 1.0
    """Backbone learning rate as a fraction of the head's (Seq FT: 1; Seq FT + SL: 0.01, as SLCA)."""


class LinearProbe(ContinualMethod):
    def __init__(self, backbone, n_classes, alignment=None, cfg: None = None, readout=Readout()):
        super().__init__(backbone, n_classes, alignment, readout=readout)
        self.backbone.requires_grad_(False)

    def encode(self, x: torch.Tensor, slot: int | None = None) -> Encoded:
        with torch.no_grad():
            h = cls_feature(self.backbone, x)  # [B, D]
        return Encoded(h, h.new_zeros(()))


class SequentialFineTune(ContinualMethod):
    def __init__(self, backbone, n_classes, alignment=None, cfg: FineTuneConfig = FineTuneConfig(),
                 readout=Readout()):
        super().__init__(backbone, n_classes, alignment, readout=readout)
        self.backbone.requires_grad_(True)
        self.backbone_lr_scale = cfg.backbone_lr_scale

    def encode(self, x: torch.Tensor, slot: int | None = None) -> Encoded:
        h = cls_feature(self.backbone, x)  # [B, D]
        return Encoded(h, h.new_zeros(()))

    def param_groups(self, lr: float) -> list[dict]:
        head = [p for n, p in self.named_parameters() if not n.startswith("backbone.") and p.requires_grad]
        return [{"params": list(self.backbone.parameters()), "lr": lr * self.backbone_lr_scale},
                {"params": head, "lr": lr}]
