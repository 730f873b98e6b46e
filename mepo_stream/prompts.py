"""Prompt pools and the prompt-tuning forward pass through a frozen timm ViT.

Prompt tuning (what the MISA/MePo code runs, confirmed by the released prompt shapes) rather than the paper's
prefix tuning: at each prompted block the layer's prompt tokens (plus the CLS position embedding) are appended
to the token sequence, the block runs, and the sequence is truncated back to its original length, so prompts
influence the other tokens through attention but do not carry over to the next block.
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn


class PromptPool(nn.Module):
    """``pool`` prompt sets, each with ``length`` tokens for every layer in ``layers``, optionally keyed.

    ``prompts``: [pool, n_layers, length, D], initialised uniform(-1, 1) as in DualPrompt;
    ``keys``: [pool, D] (when ``keyed``), matched against a query feature by cosine similarity.
    """

    def __init__(self, layers: tuple[int, ...], length: int, dim: int, pool: int = 1, keyed: bool = False):
        super().__init__()
        self.layers = tuple(layers)
        self.prompts = nn.Parameter(torch.empty(pool, len(self.layers), length, dim).uniform_(-1, 1))
        self.keys = nn.Parameter(torch.empty(pool, dim).uniform_(-1, 1)) if keyed else None

    def similarity(self, query: torch.Tensor) -> torch.Tensor:
        """Cosine similarity of queries [B, D] to every key: [B, pool]."""
        return nn.functional.normalize(query, dim=-1) @ nn.functional.normalize(self.keys, dim=-1).T

    def layer_prompts(self, index: torch.Tensor) -> dict[int, torch.Tensor]:
        """Prompts of the selected pool entries ``index`` [B], per layer: {layer: [B, length, D]}."""
        chosen = self.prompts[index]  # [B, n_layers, length, D]
        return {layer: chosen[:, i] for i, layer in enumerate(self.layers)}


def prompted_forward(vit: VisionTransformer, x: torch.Tensor, prompts: dict[int, torch.Tensor]) -> torch.Tensor:
    """Token features [B, N, D] after the final norm, with prompt tuning at the layers in ``prompts``."""
    tokens = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))  # [B, N, D]
    n_tokens = tokens.shape[1]
    prompt_pos = 0.0 if vit.no_embed_class else vit.pos_embed[:, :1]  # the CLS position, [1, 1, D]
    for i, block in enumerate(vit.blocks):
        if i in prompts:
            tokens = torch.cat([tokens, prompts[i] + prompt_pos], dim=1)  # [B, N + L, D]
        tokens = block(tokens)[:, :n_tokens]
    return vit.norm(tokens)
