"""Deep L2P: L2P's keyed prompt pool with prefix tuning in the first blocks (CODA-P's re-implementation, as the
MePo paper uses it: prompt length 5 in layers 1-5, i.e. blocks 0-4).

A frozen query forward (CLS after the final norm, no prompts) picks the ``top_k`` pool entries whose keys are
most similar (cosine); their prefixes are concatenated along the length axis and prepended to the attention
keys and values of each prompted block. The selected keys are pulled towards the query by ``sim_coef * (1 -
cos)``. Selection is task-free (no slot), as in L2P; L2P's optional batch-wise prompt frequency penalty is not
used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mepo_stream.backbone import cls_feature
from mepo_stream.methods.base import ContinualMethod, Encoded, Readout
from mepo_stream.prompts import prefix_forward


@dataclass(frozen=True)
class L2PConfig:
    """Deep L2P prompt pool (defaults: the MePo paper's prefix length and layers, L2P's pool and top-k)."""

    layers: tuple[int, ...] = (0, 1, 2, 3, 4)
    """Blocks that receive prefixes (the paper's "layers 1-5")."""
    length: int = 5
    """Prefix length per selected prompt."""
    pool: int = 10
    """Prompts in the pool (L2P: 10)."""
    top_k: int = 5
    """Prompts selected per image (L2P: 5)."""
    sim_coef: float = 0.1
    """Weight of the key-query matching loss (L2P: 0.1)."""


class DeepL2P(ContinualMethod):
    def __init__(self, backbone, n_classes, alignment=None, cfg: L2PConfig = L2PConfig(), readout=Readout()):
        super().__init__(backbone, n_classes, alignment, readout=readout)
        self.backbone.requires_grad_(False)
        if cfg.top_k > cfg.pool:
            raise ValueError(f"top_k ({cfg.top_k}) must not exceed the pool ({cfg.pool})")
        dim = backbone.num_features
        self.layers, self.top_k, self.sim_coef = tuple(cfg.layers), cfg.top_k, cfg.sim_coef
        # [pool, n_layers, 2 (key, value), length, D]
        self.prefixes = nn.Parameter(torch.empty(cfg.pool, len(self.layers), 2, cfg.length, dim).uniform_(-1, 1))
        self.keys = nn.Parameter(torch.empty(cfg.pool, dim).uniform_(-1, 1))

    def encode(self, x: torch.Tensor, slot: int | None = None) -> Encoded:
        with torch.no_grad():
            query = cls_feature(self.backbone, x)  # [B, D]
        sim = nn.functional.normalize(query, dim=1) @ nn.functional.normalize(self.keys, dim=1).T  # [B, pool]
        top_sim, index = sim.topk(self.top_k, dim=1)  # [B, k]
        chosen = self.prefixes[index]  # [B, k, n_layers, 2, L, D]
        b, k, _, _, length, dim = chosen.shape
        prefixes = {}
        for i, layer in enumerate(self.layers):
            kv = chosen[:, :, i].transpose(1, 2).reshape(b, 2, k * length, dim)  # [B, 2, k*L, D]
            prefixes[layer] = (kv[:, 0], kv[:, 1])
        h = prefix_forward(self.backbone, x, prefixes)[:, 0]  # [B, D]
        return Encoded(h, self.sim_coef * (1 - top_sim).mean())
