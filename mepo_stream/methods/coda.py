"""CODA-Prompt (CVPR'23): prompts composed from a pool of components by query-conditioned attention.

For a frozen query q (CLS after the final norm, no prompts), component m gets the weight
``alpha_m = cos(q * A_m, K_m)`` (attention vector A_m, key K_m); the prompt of every prompted block is
``sum_m alpha_m P_m`` and enters as prefix keys/values (blocks 0-4, as the MePo paper configures every
PTM-based method). Keys, attention vectors and components learn end to end through the classification loss.

CODA-P adds a new group of components per task and freezes the earlier ones. A stream has no task ids, so the
group follows the learner's task-free slot (``samples_seen // samples_per_slot``): at slot s the first s+1
groups are used and only group s learns. Components, keys and attention vectors start orthogonal (QR), as in
CODA-P; its optional orthogonality penalty is not used (CODA-P's default weight is 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mepo_stream.backbone import cls_feature
from mepo_stream.methods.base import ContinualMethod, Encoded, Readout
from mepo_stream.prompts import prefix_forward


@dataclass(frozen=True)
class CodaConfig:
    """CODA-P components (defaults: CODA-P's pool of 100 and prompt length 8, the paper's blocks 0-4)."""

    layers: tuple[int, ...] = (0, 1, 2, 3, 4)
    """Blocks that receive the composed prefix."""
    length: int = 8
    """Prefix length (for keys and for values)."""
    components: int = 100
    """Prompt components in the pool."""
    groups: int = 5
    """Component groups, one per task-free slot (CODA-P: one per task)."""


def _orthogonal(rows: int, dim: int) -> torch.Tensor:
    """Rows with orthonormal directions where possible (QR of a random matrix), [rows, dim]."""
    q, _ = torch.linalg.qr(torch.randn(max(rows, dim), min(rows, dim)))
    return q[:rows] if rows >= dim else q[:, :rows].T.contiguous()


class CodaPrompt(ContinualMethod):

    last_slot: torch.Tensor
    def __init__(self, backbone, n_classes, alignment=None, cfg: CodaConfig = CodaConfig(), readout=Readout()):
        super().__init__(backbone, n_classes, alignment, readout=readout)
        self.backbone.requires_grad_(False)
        if cfg.components % cfg.groups:
            raise ValueError(f"components ({cfg.components}) must be a multiple of groups ({cfg.groups})")
        dim, m = backbone.num_features, cfg.components
        self.layers, self.groups = tuple(cfg.layers), cfg.groups
        flat = _orthogonal(m, len(self.layers) * 2 * cfg.length * dim)
        self.components = nn.Parameter(flat.reshape(m, len(self.layers), 2, cfg.length, dim))
        self.keys = nn.Parameter(_orthogonal(m, dim))
        self.attention = nn.Parameter(_orthogonal(m, dim))
        self.register_buffer("last_slot", torch.zeros((), dtype=torch.long))  # the newest group trained so far

    def active(self, tensor: torch.Tensor, slot: int | None) -> torch.Tensor:
        """Components of the groups in use: in training the current group learns and earlier ones are frozen;
        at inference every group trained so far is used (later ones are still at their initialisation)."""
        size = tensor.shape[0] // self.groups
        if slot is None:
            return tensor[: (int(self.last_slot) + 1) * size]
        current = min(slot, self.groups - 1)
        self.last_slot.fill_(max(int(self.last_slot), current))
        return torch.cat([tensor[: current * size].detach(), tensor[current * size : (current + 1) * size]])

    def encode(self, x: torch.Tensor, slot: int | None = None) -> Encoded:
        with torch.no_grad():
            query = cls_feature(self.backbone, x)  # [B, D]
        keys, attn, comps = (self.active(t, slot) for t in (self.keys, self.attention, self.components))
        weighted = query[:, None, :] * attn[None]  # [B, M', D]
        alpha = nn.functional.cosine_similarity(weighted, keys[None], dim=-1)  # [B, M']
        prompt = torch.einsum("bm,mlktd->blktd", alpha, comps)  # [B, n_layers, 2, L, D]
        prefixes = {layer: (prompt[:, i, 0], prompt[:, i, 1]) for i, layer in enumerate(self.layers)}
        h = prefix_forward(self.backbone, x, prefixes)[:, 0]  # [B, D]
        return Encoded(h, h.new_zeros(()))
