"""Our side, built by the project's own code: MISA + Meta Cov through ``create_model`` and ``OnlineLearner``, and
``offline.refine.Trainer`` for the refine's outer step."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from benchmarks.experiments.equivalence.recording import (
    StepCallback,
    Trained,
    adam_settings,
    forward_hook,
    recording,
    step_recorder,
)
from benchmarks.experiments.equivalence.settings import Settings, Tensors
from benchmarks.experiments.equivalence.shared_state import SharedState
from mepo_stream.alignment import AlignmentConfig, batch_moments, cholesky, recolouring
from mepo_stream.artifacts import BACKBONE, PROMPTS, SIGMA_PRE, write_bundle
from mepo_stream.backbone import BackboneConfig
from mepo_stream.learner import PAPER_RECIPE, OnlineLearner
from mepo_stream.model import BundleParts, ModelConfig, create_model
from offline.refine import PAPER_REFINE, Distributed, Trainer

OUR_PARAMS = {"g_prompt.prompts": "g_prompt", "e_prompt.prompts": "e_prompt", "e_prompt.keys": "e_keys",
              "head.weight": "head.weight", "head.bias": "head.bias"}


class OurHost:
    """Our MISA + Meta Cov, built by ``create_model`` from a bundle with the shared backbone, Sigma_pre and
    prompts, stepped by ``OnlineLearner`` with the paper's recipe (fp32, augmentation off)."""

    def __init__(self, state: SharedState, settings: Settings, workdir: Path, alpha: float, lr: float):
        self.state, self.settings = state, settings
        self.learner_cfg = replace(PAPER_RECIPE, precision="fp32", autoaugment=None, lr=lr,
                                   online_iter=settings.online_iter, batch_size=settings.batch_size,
                                   samples_per_slot=settings.batch_size)
        cfg = ModelConfig(method="misa", backbone=BackboneConfig(settings.backbone, None, settings.img_size),
                          mepo=BundleParts.of(self._bundle(workdir)), alignment=AlignmentConfig(alpha=alpha),
                          learner=self.learner_cfg, seed=settings.seed)
        self.model = create_model(cfg, settings.n_classes)
        self.model.head.load_state_dict(state.head)
        self.initial = copy.deepcopy(self.model.trainable_state_dict())

    def _bundle(self, workdir: Path) -> Path:
        s, made = self.state, {"name": self.settings.backbone, "img_size": self.settings.img_size}
        prompts = {"g_prompt": s.g_prompt, "e_prompt": s.e_prompt, "e_keys": s.e_keys}
        manifest = {"kind": "imported", "backbone": made}
        return write_bundle(workdir / "our_bundle", {BACKBONE: s.backbone, SIGMA_PRE: {SIGMA_PRE: s.sigma_pre},
                                                     PROMPTS: prompts}, manifest)

    def reset(self) -> None:
        self.model.load_trainable_state_dict(copy.deepcopy(self.initial))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, train: bool, task: int) -> Tensors:
        """The host's forward (training: slot ``task``; evaluation: selection over every key), batch alignment."""
        self.reset()
        self.model.train(train)
        queries, selections, heads = [], [], []
        with (recording(self.model.e_prompt, "similarity", queries),
              recording(self.model, "prompted_feature", selections), forward_hook(self.model.head, heads)):
            logits, aux = self.model(x, slot=task if train else None, align_mode="batch")
        (index_args, cls), ((aligned,), _) = selections[0], heads[0]
        return {"query": queries[0][0][0], "index": index_args[1], "cls": cls, "aligned": aligned,
                "logits": logits, "key_loss": aux}

    def recoloured(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The centred batch re-coloured by ``L_B^-1 L_pre`` (before normalisation), in ``dtype``."""
        eps, h = self.model.alignment.eps, h.to(dtype)
        l_pre = self.model.alignment.l_pre if dtype == torch.float32 else cholesky(self.state.sigma_pre, eps, dtype)
        mean, cov = batch_moments(h)
        return (h - mean) @ recolouring(cholesky(cov, eps, dtype), l_pre)

    @torch.no_grad()
    def aligned(self, h: torch.Tensor) -> torch.Tensor:
        """The Meta Cov alignment of a batch of CLS features ``h`` [B, D]."""
        return self.model.alignment.eval()(h, mode="batch")

    def train_step(self, online_iter: int) -> Trained:
        """``online_iter`` Adam steps of the learner on the mini-batch, from the initial state."""
        self.reset()
        learner = OnlineLearner(self.model, replace(self.learner_cfg, online_iter=online_iter))
        learner.train_tf = self.state.transform  # augmentation off
        names = {id(p): OUR_PARAMS[n] for n, p in self.model.named_parameters() if p.requires_grad}
        grads: list[Tensors] = []
        start = self._params()
        with step_recorder(learner.optimizer, names, grads, lambda n, t: t):
            loss = learner.observe(self.state.images, self.state.labels)
        return Trained(loss, start, grads, self._params(), adam_settings(learner.optimizer))

    def _params(self) -> Tensors:
        return {OUR_PARAMS[n]: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}


class OurRefine:
    """``offline.refine.Trainer`` with the reference's recipe (``PAPER_REFINE``: every parameter trains, multiply
    mask, SGD momentum 0.9, lr 1e-4 / 1e-2, one optimizer), fp32, augmentation off, a 1000-output meta head."""

    def __init__(self, state: SharedState, settings: Settings, workdir: Path, eps: float):
        workdir.mkdir(parents=True, exist_ok=True)
        weights = workdir / "backbone.safetensors"
        save_file({k: v.contiguous() for k, v in state.backbone.items()}, str(weights))
        cfg = replace(PAPER_REFINE, precision="fp32", reptile_eps=eps, batch_size=256, seed=settings.seed)
        torch.manual_seed(settings.seed)
        self.trainer = Trainer.create(BackboneConfig(settings.backbone, str(weights), settings.img_size),
                                      state.refine, cfg, Distributed())
        self.trainer.train_tf = self.trainer.eval_tf  # augmentation off
        self.plan, self.seed = state.plan, settings.seed

    def initial_state(self) -> Tensors:
        return {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}

    def outer_step(self, on_step: StepCallback) -> Tensors:
        """One Meta Rep outer step (``Trainer.group``); ``on_step`` sees the state after every SGD step."""
        model = self.trainer.model
        handle = self.trainer.optimizer.register_step_post_hook(lambda *_: on_step(model.state_dict()))
        try:
            model.train()
            with tqdm(disable=True) as bar:
                self.trainer.group(self.plan, torch.Generator().manual_seed(self.seed), bar)
        finally:
            handle.remove()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
