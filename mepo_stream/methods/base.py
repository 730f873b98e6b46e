"""What every host method provides to the learner: a feature encoder, a linear head, optional Meta Cov."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mepo_stream.alignment import AlignMode, FeatureAlignment


@dataclass
class Encoded:
    """What a method's encoder hands to the head."""

    feature: torch.Tensor
    """[B, D] feature before alignment (CLS after the final norm for every method here)."""
    aux_loss: torch.Tensor
    """Scalar auxiliary training loss (e.g. prompt-key matching); 0 when the method has none."""
    logit_scale: torch.Tensor | None = None
    """Optional [B, C] multiplier of the logits (MVP's instance-wise mask)."""


class ContinualMethod(nn.Module):
    """A host method: ``encode`` gives the pre-head feature, ``logits`` aligns it (Meta Cov) and classifies.

    Subclasses implement ``encode(x, slot)`` returning an ``Encoded``: the feature [B, D], the method's
    auxiliary loss, and optionally a logit multiplier. ``slot`` is the task-free prompt slot the learner picks
    from the number of samples seen; methods without slots ignore it.

    The classifier is the linear ``head`` (trained by gradient; optionally on running-standardised features)
    unless the learner attaches a statistics ``classifier`` (NCM or streaming LDA, ``mepo_stream.heads``);
    the linear head then only carries the gradient that trains the method's prompts.
    """

    classifier: nn.Module | None
    standardize: nn.Module | None

    def __init__(self, backbone: VisionTransformer, n_classes: int, alignment: FeatureAlignment | None = None):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.num_features, n_classes)
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)
        self.alignment = alignment
        self.classifier = None
        self.standardize = None

    def encode(self, x: torch.Tensor, slot: int | None = None) -> Encoded:
        raise NotImplementedError

    def param_groups(self, lr: float) -> list[dict]:
        """Optimizer parameter groups: every trainable parameter at ``lr`` (methods override to differ)."""
        return [{"params": [p for p in self.parameters() if p.requires_grad], "lr": lr}]

    @property
    def trains_backbone(self) -> bool:
        return any(p.requires_grad for p in self.backbone.parameters())

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor that learning changes: the whole state but a frozen backbone's. With the same backbone,
        it is what a checkpoint, a snapshot or a replica needs to restore this method exactly."""
        keep_backbone = self.trains_backbone
        return {k: v for k, v in self.state_dict().items() if keep_backbone or not k.startswith("backbone.")}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load what ``trainable_state_dict`` gave; raise ``ValueError`` for tensors that do not fit this method
        (other names, or other shapes: another configuration)."""
        try:
            missing, unexpected = self.load_state_dict(state, strict=False)
        except RuntimeError as e:  # a shape that differs
            raise ValueError(f"the tensors do not fit this method: {e}") from e
        if unexpected or any(not k.startswith("backbone.") for k in missing):
            raise ValueError(f"the tensors do not fit this method: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def aligned(self, encoded: Encoded, align_mode: AlignMode = "batch") -> torch.Tensor:
        """The classifier's input [B, D]: the feature, aligned first when Meta Cov is on."""
        h = encoded.feature
        return h if self.alignment is None else self.alignment(h, mode=align_mode)

    def linear_logits(self, h: torch.Tensor, encoded: Encoded) -> torch.Tensor:
        """The trained linear head's logits [B, C] for classifier inputs ``h`` [B, D]."""
        if self.standardize is not None:
            h = self.standardize(h)
        logits = self.head(h)  # [B, C]
        return logits if encoded.logit_scale is None else logits * encoded.logit_scale

    def logits(self, encoded: Encoded, align_mode: AlignMode = "batch") -> torch.Tensor:
        """Class logits [B, C]: the statistics classifier's when one is attached, else the linear head's."""
        h = self.aligned(encoded, align_mode)
        if self.classifier is not None and not self.training:
            return self.classifier(h)
        return self.linear_logits(h, encoded)

    def forward(self, x: torch.Tensor, slot: int | None = None, align_mode: AlignMode = "batch"
                ) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.encode(x, slot)
        return self.logits(encoded, align_mode), encoded.aux_loss

    def train(self, mode: bool = True) -> ContinualMethod:
        super().train(mode)
        self.backbone.eval()  # the frozen backbone never runs in training mode (no dropout, drop-path)
        return self
