"""MISA (ICLR'25) as the MePo reference runs it: DualPrompt-style g/e prompts on a frozen ViT; and DualPrompt.

``dualprompt`` is the same architecture with the paper's prefix tuning (length 5, blocks 0-4); the reference's
plain DualPrompt baseline trains with the seen-class mask (``--learner.train_mask seen``) instead of MISA's
batch mask.

* g-prompts (shared) at layers 0-1, 10 tokens each; e-prompts from a keyed pool of 10 at layers 2-4, 20
  tokens each; prompt *tuning* (see ``mepo_stream.prompts``), not the paper's prefix tuning, because the
  released MISA prompts have prompt-tuning shapes and the published numbers come from that code.
* The e-prompt is chosen by a frozen query forward (no prompts, CLS after the final norm): at evaluation the
  best-matching key over the whole pool; in training the learner's current slot, with the key pulled towards
  the query by ``sim_coef * (1 - cos)``.
* Deliberate fix of the reference's index bug: the reference selects inside the slice ``[task_id,
  task_id+1)`` and then indexes the *full* pool with the slice-local index 0, so it always trains
  ``prompts[0]`` while the similarity loss trains ``keys[task_id]``. Here the slot's own prompt is trained
  with its own key (as FlyGCL does), so what evaluation selects is what training updated.
* Task-free slots: the reference picks the slot by the task id, a boundary signal a stream does not have;
  the learner uses the number of samples seen instead (``LearnerConfig.samples_per_slot``).
* Prompts start uniform(-1, 1), or from ISA-warmed prompts (MISA's initial session adaptation, run offline
  by ``mepo isa`` on the pretraining half and stored in the MePo bundle; see ``load_initial_prompts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mepo_stream.backbone import cls_feature
from mepo_stream.methods.base import ContinualMethod, Encoded, Readout
from mepo_stream.prompts import PromptPool, prefix_forward, prompted_forward


@dataclass(frozen=True)
class MISAConfig:
    """Prompt layout of the MISA/DualPrompt host (defaults = the reference's DualPrompt defaults)."""

    tuning: Literal["prompt", "prefix"] = "prompt"
    """How prompts enter the ViT: prompt tuning (the reference code) or prefix tuning (the paper)."""
    g_layers: tuple[int, ...] = (0, 1)
    """Blocks that receive the shared g-prompt."""
    g_length: int = 10
    """g-prompt tokens per layer (with prefix tuning: prefix length, for keys and for values)."""
    e_layers: tuple[int, ...] = (2, 3, 4)
    """Blocks that receive the selected e-prompt."""
    e_length: int = 20
    """e-prompt tokens per layer."""
    e_pool: int = 10
    """Number of keyed e-prompts in the pool."""
    sim_coef: float = 1.0
    """Weight of the key-query matching loss."""


class MISA(ContinualMethod):
    def __init__(self, backbone, n_classes, alignment=None, cfg: MISAConfig = MISAConfig(), readout=Readout()):
        super().__init__(backbone, n_classes, alignment, readout=readout)
        self.backbone.requires_grad_(False)
        dim, per_token = backbone.num_features, 2 if cfg.tuning == "prefix" else 1  # prefixes: keys + values
        self.g_prompt = PromptPool(cfg.g_layers, per_token * cfg.g_length, dim, pool=1)
        self.e_prompt = PromptPool(cfg.e_layers, per_token * cfg.e_length, dim, pool=cfg.e_pool, keyed=True)
        self.sim_coef, self.tuning = cfg.sim_coef, cfg.tuning

    def initial_prompts(self) -> dict[str, torch.Tensor]:
        """The tensors ``load_initial_prompts`` takes: g-prompt [1, Lg, Tg, D], e-prompts and e-keys."""
        keys = self.e_prompt.keys
        assert keys is not None  # the e-prompt pool is keyed
        return {"g_prompt": self.g_prompt.prompts.detach(), "e_prompt": self.e_prompt.prompts.detach(),
                "e_keys": keys.detach()}

    @torch.no_grad()
    def load_initial_prompts(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start from ISA-warmed prompts (every e-prompt slot and key starts from the warmed ones)."""
        for name, target in self.initial_prompts().items():
            if name not in tensors:
                raise ValueError(f"the prompts are missing {name!r} (have {sorted(tensors)})")
            source = tensors[name].to(target)
            if source.shape[1:] != target.shape[1:] or source.shape[0] not in (1, target.shape[0]):
                raise ValueError(f"prompt {name!r} has shape {tuple(source.shape)}, the host needs "
                                 f"{tuple(target.shape)}: were they made for another layout or backbone?")
            target.copy_(source.expand_as(target))

    @property
    def n_slots(self) -> int:
        return self.e_prompt.prompts.shape[0]

    def encode(self, x: torch.Tensor, slot: int | None = None) -> Encoded:
        with torch.no_grad():
            query = cls_feature(self.backbone, x)  # [B, D], frozen and prompt-free
        sim = self.e_prompt.similarity(query)  # [B, pool]
        if slot is None:
            index = sim.argmax(dim=1)  # [B]
        else:
            index = torch.full((x.shape[0],), min(slot, self.n_slots - 1), device=x.device)
        aux = self.sim_coef * (1 - sim.gather(1, index[:, None])).mean()
        return Encoded(self.prompted_feature(x, index), aux)

    def prompted_feature(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """CLS feature [B, D] with the shared g-prompt and the e-prompts ``index`` [B]."""
        zeros = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        prompts = {**self.g_prompt.layer_prompts(zeros), **self.e_prompt.layer_prompts(index)}  # [B, L', D]
        if self.tuning == "prefix":
            prefixes = {}
            for layer, p in prompts.items():
                keys, values = p.chunk(2, dim=1)  # [B, L, D] each
                prefixes[layer] = (keys, values)
            return prefix_forward(self.backbone, x, prefixes)[:, 0]
        return prompted_forward(self.backbone, x, prompts)[:, 0]  # CLS after the final norm
