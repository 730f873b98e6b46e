"""MVP (ICCV'23, the Si-Blurry paper): DualPrompt-style prompts with instance-wise logit masking and
contrastive prompt-key matching.

* Each e-prompt owns a learnable class mask (init -1). The mask of the prompt an image selects scales its
  logits by ``2 * sigmoid(mask)``: classes that prompt has learned to predict are amplified, the others (all
  classes at first, unseen ones for good) stay damped at 2 * sigmoid(-1) ~ 0.54.
* Prompt selection is task-free: the key at the smallest cosine distance, distances scaled by how often each
  key has been used (``1 + count``) so that rarely used prompts get picked; the key loss is contrastive (pull
  the selected key towards the query, push it from the other keys), with the same usage scaling.
* Prompt tuning, g-prompts of 5 tokens at blocks 0-1 and e-prompts of 20 at blocks 2-4 (the Si-Blurry code's
  defaults).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mepo_stream.backbone import cls_feature
from mepo_stream.methods.base import Encoded, Readout
from mepo_stream.methods.misa import MISA, MISAConfig


@dataclass(frozen=True)
class MVPConfig:
    """MVP's prompts, mask and key loss (defaults: the Si-Blurry code with --use_mask --use_contrastiv)."""

    prompts: MISAConfig = MISAConfig(g_length=5, e_length=20)
    """Prompt layout (prompt tuning; g 5 tokens at blocks 0-1, e 20 tokens at blocks 2-4, pool 10)."""
    use_mask: bool = True
    """Instance-wise logit masking with a learnable class mask per prompt."""
    contrastive: bool = True
    """Contrastive, usage-scaled key matching (false: plain 1 - cos to the selected key)."""


class MVP(MISA):

    usage: torch.Tensor
    def __init__(self, backbone, n_classes, alignment=None, cfg: MVPConfig = MVPConfig(), readout=Readout()):
        super().__init__(backbone, n_classes, alignment, cfg.prompts, readout)
        self.use_mask, self.contrastive = cfg.use_mask, cfg.contrastive
        self.class_mask = nn.Parameter(torch.full((self.n_slots, n_classes), -1.0))  # [pool, C]
        self.register_buffer("usage", torch.zeros(self.n_slots))

    def _select(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected prompt per image [B] and the key loss."""
        keys = self.e_prompt.keys
        assert keys is not None  # the e-prompt pool is keyed
        distance = 1 - nn.functional.cosine_similarity(query[:, None], keys[None], dim=-1)  # [B, pool]
        mass = self.usage + 1 if self.contrastive else torch.ones_like(self.usage)
        index = (distance * mass).argmin(dim=1)  # [B]
        chosen = distance.gather(1, index[:, None]).squeeze(1)  # [B]
        if not self.contrastive:
            return index, chosen.mean()
        between = 1 - nn.functional.cosine_similarity(keys[:, None], keys[None], dim=-1)  # [pool, pool]
        push = (between[index] / mass[index, None]).exp().mean()
        pull = (chosen / mass[index]).exp().mean()
        return index, -(push / (pull + push) + 1e-6).log()

    def encode(self, x: torch.Tensor, slot: int | None = None) -> Encoded:
        with torch.no_grad():
            query = cls_feature(self.backbone, x)  # [B, D]
        index, key_loss = self._select(query)
        if self.training:
            self.usage += index.bincount(minlength=self.n_slots).float()
        h = self.prompted_feature(x, index)
        scale = 2 * torch.sigmoid(self.class_mask[index]) if self.use_mask else None  # [B, C]
        return Encoded(h, self.sim_coef * key_loss, scale)
