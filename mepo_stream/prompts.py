"""Prompt pools and the two ways of feeding prompts to a frozen timm ViT.

* Prompt tuning (``prompted_forward``; what the MISA/MePo code runs, confirmed by the released prompt shapes):
  at each prompted block the layer's prompt tokens (plus the CLS position embedding) are appended to the token
  sequence, the block runs, and the sequence is truncated back to its original length, so prompts influence
  the other tokens through attention but do not carry over to the next block.
* Prefix tuning (``prefix_forward``; the paper's choice for all PTM-based methods, Deep L2P as CODA-P
  re-implements it): learned keys and values are prepended to each prompted block's attention keys and values
  after the qkv projection; the token sequence keeps its length.
"""

from __future__ import annotations

import torch
from timm.layers import Attention
from timm.models.vision_transformer import Block, VisionTransformer
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
        assert self.keys is not None, "only a keyed pool matches queries"
        return nn.functional.normalize(query, dim=-1) @ nn.functional.normalize(self.keys, dim=-1).T

    def layer_prompts(self, index: torch.Tensor) -> dict[int, torch.Tensor]:
        """Prompts of the selected pool entries ``index`` [B], per layer: {layer: [B, length, D]}."""
        chosen = self.prompts[index]  # [B, n_layers, length, D]
        return {layer: chosen[:, i] for i, layer in enumerate(self.layers)}


def embed(vit: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """Patch embedding, CLS token and position embedding: the tokens [B, N, D] entering block 0."""
    return vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(x))))


def prompted_forward(vit: VisionTransformer, x: torch.Tensor, prompts: dict[int, torch.Tensor]) -> torch.Tensor:
    """Token features [B, N, D] after the final norm, with prompt tuning at the layers in ``prompts``."""
    tokens = embed(vit, x)  # [B, N, D]
    n_tokens = tokens.shape[1]
    prompt_pos = 0.0 if vit.no_embed_class or vit.pos_embed is None else vit.pos_embed[:, :1]  # CLS position [1, 1, D]
    for i, block in enumerate(vit.blocks):
        if i in prompts:
            tokens = torch.cat([tokens, prompts[i] + prompt_pos], dim=1)  # [B, N + L, D]
        tokens = block(tokens)[:, :n_tokens]
    return vit.norm(tokens)


def prefix_attention(attn: Attention, x: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor
                     ) -> torch.Tensor:
    """timm ``Attention`` with learned keys/values [B, L, D] prepended after the qkv projection (prefix tuning)."""
    if getattr(attn, "gate", None) is not None:  # an older timm's Attention has no gate
        raise NotImplementedError("prefix tuning of gated attention")
    b, n, _ = x.shape
    qkv = attn.qkv(x).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # [B, H, N, hd]

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, L, D] -> [B, H, L, hd]
        return t.reshape(b, -1, attn.num_heads, attn.head_dim).transpose(1, 2)

    k = torch.cat([heads(prefix_k), k], dim=2)  # [B, H, L + N, hd]
    v = torch.cat([heads(prefix_v), v], dim=2)
    q, k = attn.q_norm(q), attn.k_norm(k)
    out = nn.functional.scaled_dot_product_attention(q, k, v)  # [B, H, N, hd]
    out = attn.norm(out.transpose(1, 2).reshape(b, n, attn.attn_dim))
    return attn.proj_drop(attn.proj(out))


def prefix_forward(vit: VisionTransformer, x: torch.Tensor, prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor:
    """Token features [B, N, D] after the final norm, with prefix tuning (keys, values) at the given blocks."""
    tokens = embed(vit, x)  # [B, N, D]
    for i, block in enumerate(vit.blocks):
        if i not in prefixes:
            tokens = block(tokens)
            continue
        if not isinstance(block, Block) or not isinstance(block.attn, Attention):
            raise NotImplementedError(f"prefix tuning of a {type(block).__name__}: timm's pre-norm Block only")
        attn_out = prefix_attention(block.attn, block.norm1(tokens), *prefixes[i])
        tokens = tokens + block.drop_path1(block.ls1(attn_out))
        tokens = tokens + block.drop_path2(block.ls2(block.mlp(block.norm2(tokens))))
    return vit.norm(tokens)
