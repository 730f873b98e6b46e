"""Reference equivalence: the paper's recipe, step by step, against the public reference code (issue 32).

Both sides start from identical state (a random timm ViT state dict, the same prompts, keys, head and Sigma_pre,
the same mini-batch with augmentation off, the same optimizer settings) and every compared tensor is reported with
its maximum absolute and relative difference. Steps:

1. the host's forward at training and at evaluation: query feature, prompt selection, CLS feature, aligned
   feature, logits, key loss;
2. the Meta Cov alignment of a batch (the re-coloured batch in fp32 and fp64, the blended feature);
3. the masked loss of one step;
4. the gradient of every trainable tensor;
5. every trainable tensor after ``online_iter`` Adam steps on one mini-batch;
6. one Meta Rep outer step of the refine: each inner SGD step on the pseudo tasks, the joint SGD step, and the
   Reptile interpolation with eps.

Our side is built by the project's own code: ``mepo_stream.model.create_model`` (MISA with Meta Cov from a bundle
holding the backbone, Sigma_pre and the prompts), ``mepo_stream.learner.OnlineLearner`` for the step, and
``offline.refine.Trainer.group`` for the outer step. The reference side is read at run time from ``--reference``,
a checkout of SunGL001/MePo (``GCL/`` holds MISA + MePo's model and trainer; ``meta_post_training.py`` the
refine); nothing of it is copied here. What had to change for it to run on a CPU without its data is patched at
run time and listed in the result (``reference_patches``).

The relative difference of a tensor is ``max|ours - theirs| / max|theirs|`` (its scale, not element-wise, so
near-zero entries do not blow it up). Tolerance: 1e-4, and 1e-3 for an update (parameters after minus before).
Each row also has a noise floor: the same comparison of our side with itself built with timm's attention unfused
(the same arithmetic in another fp32 order, the reference ViT's). Why: with B < D the alignment's ``L_B^-1``
stretches rounding by up to ``1/sqrt(eps)``, and Adam moves a coordinate by ``lr * sign(g)`` however small ``g`` is,
so two exact fp32 implementations differ by far more than 1e-4 downstream of either. A row over tolerance within 10x
of its floor is "fp32 noise"; an update within 2 ulp of its parameter is "fp32 resolution".

Without ``--reference`` the harness compares our side with a second copy of itself, optionally perturbed
(``--perturb.alpha``, ``--perturb.lr``, ``--perturb.reptile_eps``): what CI runs, on a tiny ViT, to show that the
comparison machinery reports a difference where there is one.

Usage:
    python -m benchmarks.reference_equivalence --reference /tmp/ref/MePo
    python -m benchmarks.reference_equivalence --settings.backbone test_vit --settings.img_size 32 \\
        --perturb.lr 1e-4 --out /tmp/stand_in.json
Writes ``benchmarks/results/reference_equivalence.json``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import subprocess
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import timm
import torch
from safetensors.torch import save_file
from torch.optim.optimizer import register_optimizer_step_post_hook
from tqdm import tqdm

from mepo_stream.alignment import AlignmentConfig, batch_moments, cholesky, recolouring
from mepo_stream.artifacts import BACKBONE, PROMPTS, SIGMA_PRE, write_bundle
from mepo_stream.backbone import BackboneConfig, build_vit
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.learner import PAPER_RECIPE, OnlineLearner
from mepo_stream.methods import MISAConfig
from mepo_stream.model import BundleParts, ModelConfig, create_model
from mepo_stream.pseudo_tasks import GroupPlan
from mepo_stream.transforms import Transform, test_transform
from offline.refine import PAPER_REFINE, Distributed, Trainer

Tensors = dict[str, torch.Tensor]
META_CLASSES = 1000
"""The reference's meta head has 1000 outputs (ImageNet-1k ids), hard-coded; ours gets as many for the comparison."""
NOISE_FACTOR = 10.0
"""A difference over tolerance within this many times our own fp32 noise floor is rounding, not a different step."""
FP32_NOISE = ("fp32 noise: within 10x of our side against itself with timm's attention unfused (docs/fidelity.md, "
              "'Equivalence to the reference code', the alignment's conditioning)")
FP32_RESOLUTION = ("fp32 resolution: every tensor's update over tolerance differs by at most 2 units in the last "
                   "place of the parameter (an update below a parameter's fp32 spacing rounds either way)")
DOCUMENTED = {
    "index_bug": "docs/fidelity.md, Host method: MISA, 'Index bug fixed' (the reference trains prompts[0] "
                 "whatever the slot; we train the slot's own prompt, as FlyGCL)",
}


@dataclass(frozen=True)
class Settings:
    """The shared state both sides start from."""

    backbone: str = "vit_base_patch16_224"
    """timm ViT (the reference's host is hard-wired to ViT-B/16 at 224 px; another one only without --reference)."""
    img_size: int = 224
    """Input resolution."""
    batch_size: int = 32
    """Stream mini-batch (the reference's 64 // 2)."""
    n_classes: int = 10
    """Head outputs (CIFAR-10)."""
    batch_classes: int = 6
    """Classes present in the mini-batch (fewer than n_classes, so the batch mask matters)."""
    online_iter: int = 3
    """Adam steps on the mini-batch."""
    lr: float = 5e-3
    """Adam learning rate."""
    alpha: float = 0.5
    """Meta Cov blend weight (the paper's Sup-21K value)."""
    later_task: int = 1
    """The task (our slot) of the extra training forward that shows the documented index-bug difference."""
    refine_classes: int = 4
    """Classes of the refine's one group."""
    refine_tasks: int = 2
    """Sequential pseudo tasks of the group."""
    refine_train_per_class: int = 2
    """Images per class in the pseudo tasks."""
    refine_query_per_class: int = 2
    """Images per class in the joint (query) step."""
    reptile_eps: float = 0.1
    """Reptile step eps (the reference's -inner_lr as its README runs it)."""
    data: str = "cifar10"
    """Images: cifar10 (the bundled archive) or synthetic (uniform noise)."""
    seed: int = 0
    """Seed of every random tensor."""


@dataclass(frozen=True)
class Perturbation:
    """Deliberate changes of the stand-in side (no --reference), to show that a difference is reported."""

    alpha: float = 0.0
    """Added to the stand-in's Meta Cov alpha."""
    lr: float = 0.0
    """Added to the stand-in's Adam learning rate."""
    reptile_eps: float = 0.0
    """Added to the stand-in's Reptile eps."""


# --- the comparison machinery ------------------------------------------------------------------------------------
@dataclass
class Row:
    """One compared tensor."""

    step: str
    tensor: str
    max_abs: float
    max_rel: float
    tol: float
    passed: bool | None
    """None: a difference that is explained (``verdict`` says how, ``note`` names the doc line)."""
    note: str = ""
    noise_rel: float | None = None
    """The same comparison between our side and itself evaluated in another fp32 order (the noise floor)."""

    @property
    def verdict(self) -> str:
        if self.passed is not None:
            return "yes" if self.passed else "no"
        if self.note.startswith(FP32_RESOLUTION):
            return "fp32 resolution"
        return "fp32 noise" if self.note.startswith(FP32_NOISE) else "documented"


def difference(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """Max absolute difference and that relative to the reference tensor's largest magnitude."""
    if ours.shape != theirs.shape:
        raise ValueError(f"shapes differ: ours {tuple(ours.shape)}, theirs {tuple(theirs.shape)}")
    a, b = ours.detach().double().cpu(), theirs.detach().double().cpu()
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return max_abs, max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))


def compare(step: str, tensor: str, ours: torch.Tensor, theirs: torch.Tensor, tol: float,
            documented: str | None = None) -> Row:
    """A row for two tensors; passes when the relative difference is within ``tol`` (``documented``: expected)."""
    max_abs, max_rel = difference(ours, theirs)
    passed = None if documented else max_rel <= tol
    return Row(step, tensor, max_abs, max_rel, tol, passed, documented or "")


def with_noise_floor(rows: list[Row], floor: list[Row]) -> None:
    """Give each row its noise floor (the same comparison of our side with itself in another fp32 order), and call
    a row over tolerance fp32 noise when it stays within ``NOISE_FACTOR`` times that floor."""
    by_key = {(r.step, r.tensor): r for r in floor}
    for row in rows:
        row.noise_rel = by_key[(row.step, row.tensor)].max_rel
        if row.passed is False and row.max_rel <= NOISE_FACTOR * row.noise_rel:
            row.passed, row.note = None, f"{FP32_NOISE} ({row.max_rel / row.noise_rel:.1f}x the floor)"


def compare_index(step: str, tensor: str, ours: torch.Tensor, theirs: torch.Tensor,
                  documented: str | None = None) -> Row:
    """A row for two integer selections: the share of entries that differ (must be 0)."""
    wrong = (ours.cpu() != theirs.cpu()).float().mean().item()
    note = f"ours {ours.tolist()[:8]}, theirs {theirs.tolist()[:8]}"
    return Row(step, tensor, wrong, wrong, 0.0, None if documented else wrong == 0,
               f"{documented}; {note}" if documented else note)


def compare_states(step: str, ours: Tensors, theirs: Tensors, tol: float) -> Row:
    """A row for two whole states: the worst tensor's differences (named in the note)."""
    if set(ours) != set(theirs):
        raise ValueError(f"the states hold other tensors: {sorted(set(ours) ^ set(theirs))[:6]}")
    diffs = {k: difference(ours[k], theirs[k]) for k in ours}
    worst_abs = max(diffs, key=lambda k: diffs[k][0])
    worst_rel = max(diffs, key=lambda k: diffs[k][1])
    return Row(step, f"all {len(diffs)} tensors", diffs[worst_abs][0], diffs[worst_rel][1], tol,
               diffs[worst_rel][1] <= tol, f"worst: {worst_rel} (rel), {worst_abs} (abs)")


def compare_updates(step: str, ours: Tensors, theirs: Tensors, start: Tensors, tol: float) -> Row:
    """A row for two updates from the same ``start``: ``ours - start`` against ``theirs - start`` (in fp64), the
    worst tensor's. Why: a small learning rate moves a parameter by far less than its size, so the parameters can
    agree to 1e-6 while their updates disagree; only the update shows a wrong step."""
    diffs = {k: difference(ours[k].double() - start[k].double(), theirs[k].double() - start[k].double())
             for k in ours if ours[k].is_floating_point()}
    worst = max(diffs, key=lambda k: diffs[k][1])
    row = Row(step, f"update of all {len(diffs)} tensors", max(d[0] for d in diffs.values()), diffs[worst][1], tol,
              diffs[worst][1] <= tol, f"worst: {worst}")
    if not row.passed and all(d[1] <= tol or d[0] <= last_bits(theirs[k]) for k, d in diffs.items()):
        row.passed, row.note = None, f"{FP32_RESOLUTION}; worst: {worst}"
    return row


def last_bits(t: torch.Tensor) -> float:
    """Two units in the last place of a tensor's largest fp32 entry: what rounding alone can change it by."""
    return 2 * torch.finfo(torch.float32).eps * t.detach().abs().max().item()


def markdown_table(rows: list[Row]) -> str:
    """The result table as docs/fidelity.md shows it."""
    lines = ["| step | tensor | max abs diff | max rel diff | noise floor (rel) | pass |", "|---|---|---|---|---|---|"]
    for r in rows:
        floor = "" if r.noise_rel is None else f"{r.noise_rel:.2e}"
        verdict = "**no**" if r.verdict == "no" else r.verdict
        lines.append(f"| {r.step} | {r.tensor} | {r.max_abs:.2e} | {r.max_rel:.2e} | {floor} | {verdict} |")
    return "\n".join(lines)


# --- the shared state ----------------------------------------------------------------------------------------------
@dataclass
class SharedState:
    """Everything both sides start from; prompts in our layout ([pool, layers, tokens, D])."""

    backbone: Tensors
    g_prompt: torch.Tensor  # [1, Lg, Tg, D]
    e_prompt: torch.Tensor  # [pool, Le, Te, D]
    e_keys: torch.Tensor  # [pool, D]
    head: Tensors  # weight [C, D], bias [C]
    sigma_pre: torch.Tensor  # [D, D] float64
    images: torch.Tensor  # uint8 [B, 3, H, W]
    labels: torch.Tensor  # [B] original labels
    transform: Transform  # uint8 -> the normalised input, the same on both sides (augmentation off)
    refine: ImageSet  # the refine's images, targets = original class ids
    plan: GroupPlan  # the refine's one group: classes, pseudo tasks and joint samples (indices into refine)

    @property
    def dim(self) -> int:
        return self.e_keys.shape[1]


def uniform(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """uniform(-1, 1), as DualPrompt initialises prompts and keys."""
    return torch.rand(shape, generator=g) * 2 - 1


def random_sigma_pre(dim: int, g: torch.Generator) -> torch.Tensor:
    """A full-rank Sigma_pre [D, D] float64: the ddof-1 covariance of 1000 random class means, as MetaCov."""
    means = torch.randn(1000, dim, generator=g, dtype=torch.float64)
    return torch.from_numpy(np.cov(means.numpy(), rowvar=False))


def load_images(settings: Settings, classes: int, per_class: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``per_class`` images of each of the first ``classes`` classes (uint8 [N, 3, H, W], labels [N]), class-major."""
    if settings.data == "synthetic":
        images = torch.randint(0, 256, (classes * per_class, 3, 32, 32), generator=g, dtype=torch.uint8)
        return images, torch.arange(classes).repeat_interleave(per_class)
    split = load_split(DataConfig(dataset=settings.data, num_classes=classes, train_per_class=per_class), "train")
    return split.images, split.targets


def stream_batch(settings: Settings, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The mini-batch: ``batch_size`` images of ``batch_classes`` classes, in a shuffled order."""
    per_class = -(-settings.batch_size // settings.batch_classes)
    images, labels = load_images(settings, settings.batch_classes, per_class, g)
    order = torch.randperm(len(labels), generator=g)[: settings.batch_size]
    return images[order], labels[order]


def refine_data(settings: Settings, g: torch.Generator) -> tuple[ImageSet, GroupPlan]:
    """The refine's images and its one group: classes 0..K-1 (the reference's class order, identity here), cut
    into ``refine_tasks`` consecutive pseudo tasks; each class's first images train, the rest form the joint set."""
    n_train, n_query = settings.refine_train_per_class, settings.refine_query_per_class
    images, targets = load_images(settings, settings.refine_classes, n_train + n_query, g)
    classes = list(range(settings.refine_classes))
    per_task = settings.refine_classes // settings.refine_tasks
    members = {c: (targets == c).nonzero().flatten().tolist() for c in classes}
    tasks = [[i for c in classes[t * per_task:(t + 1) * per_task] for i in members[c][:n_train]]
             for t in range(settings.refine_tasks)]
    joint = [i for c in classes for i in members[c][n_train:]]
    names = [str(c) for c in range(META_CLASSES)]
    return ImageSet(images, targets, names, names), GroupPlan(classes, tasks, joint)


def shared_state(settings: Settings) -> SharedState:
    """Random backbone (timm init), prompts, keys, head and Sigma_pre; the mini-batch and the refine's data."""
    torch.manual_seed(settings.seed)
    vit = build_vit(settings.backbone, settings.img_size)
    g = torch.Generator().manual_seed(settings.seed)
    cfg, dim = MISAConfig(), vit.num_features
    head = {"weight": torch.randn(settings.n_classes, dim, generator=g) * 0.02,
            "bias": torch.randn(settings.n_classes, generator=g) * 0.01}
    images, labels = stream_batch(settings, g)
    refine, plan = refine_data(settings, g)
    return SharedState(
        backbone={k: v.detach().clone() for k, v in vit.state_dict().items()},
        g_prompt=uniform((1, len(cfg.g_layers), cfg.g_length, dim), g),
        e_prompt=uniform((cfg.e_pool, len(cfg.e_layers), cfg.e_length, dim), g),
        e_keys=uniform((cfg.e_pool, dim), g), head=head, sigma_pre=random_sigma_pre(dim, g),
        images=images, labels=labels, transform=test_transform(settings.img_size, (0.5,) * 3, (0.5,) * 3),
        refine=refine, plan=plan)


# --- the host: what each side offers --------------------------------------------------------------------------------
@dataclass
class Trained:
    """The outcome of a side's step on the mini-batch."""

    loss: float
    """The mean loss over the Adam steps, as the side's step returns it."""
    start: Tensors
    """Every trainable tensor before the steps (our names and layout)."""
    grads: list[Tensors]
    """Gradient of every trainable tensor at each Adam step (our names and layout)."""
    params: Tensors
    """Every trainable tensor afterwards (our names and layout)."""
    settings: Tensors
    """The optimizer's settings for the trainable tensors (lr, betas, eps, weight decay, amsgrad, maximize)."""


@contextlib.contextmanager
def step_recorder(optimizer: torch.optim.Optimizer, names: dict[int, str], into: list[Tensors],
                  layout: Callable[[str, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Record every trainable tensor's gradient (in our layout) just before each of ``optimizer``'s steps."""
    def hook(opt, args, kwargs):
        into.append({names[id(p)]: layout(names[id(p)], p.grad.clone()) for group in opt.param_groups
                     for p in group["params"] if p.grad is not None})

    handle = optimizer.register_step_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def adam_settings(optimizer: torch.optim.Optimizer) -> Tensors:
    """The settings of the groups that hold a trainable tensor, as tensors (one row each: [groups, ...])."""
    groups = [g for g in optimizer.param_groups if any(p.requires_grad for p in g["params"])]
    keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
    return {k: torch.tensor([g[k] for g in groups], dtype=torch.float64) for k in keys} | {
        "type": torch.tensor([type(optimizer).__name__ == "Adam"], dtype=torch.float64)}


@contextlib.contextmanager
def recording(obj: object, attr: str, into: list) -> Iterator[None]:
    """Within: ``obj.attr(...)`` also appends its (args, result) to ``into`` (an instance-level wrapper)."""
    original = getattr(obj, attr)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        into.append((args, out))
        return out

    setattr(obj, attr, wrapper)
    try:
        yield
    finally:
        delattr(obj, attr)


@contextlib.contextmanager
def forward_hook(module: torch.nn.Module, into: list) -> Iterator[None]:
    """Within: every call of ``module`` appends its (inputs, output) to ``into``."""
    handle = module.register_forward_hook(lambda m, args, out: into.append((args, out)))
    try:
        yield
    finally:
        handle.remove()


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


# --- the reference's host, read from --reference -------------------------------------------------------------------
class _NoMemory:
    """The trainer's episodic memory at memory_size 0 (the paper's rehearsal-free setting): always empty."""

    def __len__(self) -> int:
        return 0

    def add_new_class(self, cls_list) -> None:
        pass


class _NoWriter:
    """tensorboard's SummaryWriter, which the reference creates at import and never needs here."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


HOST_STUBS = {
    "torch.utils.tensorboard": "tensorboard is not installed; SummaryWriter (created at import, unused) is a no-op",
    "methods._trainer": "MePo ships methods/_trainer.py only as a .pyc: _Trainer is an empty base class (its "
                        "__init__ builds data loaders and is never called here; the step methods used are MePo's own)",
    "sklearn.manifold": "scikit-learn is not installed; TSNE (imported for plots, unused) is a placeholder",
    "pandas": "pandas is not installed; imported, unused",
}


@contextlib.contextmanager
def timm_registry_kept() -> Iterator[None]:
    """Within, the reference may (re)register timm models (its ``vit_base_patch16_224`` is its own ViT); after,
    timm's registry is what it was, so that our side keeps building timm's own ViT."""
    registry = importlib.import_module("timm.models._registry")
    saved = {k: copy.copy(v) for k, v in vars(registry).items() if k.startswith("_") and isinstance(v, (dict, set))}
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(registry, k, v)


@contextlib.contextmanager
def no_download() -> Iterator[None]:
    """Within: ``timm.create_model(..., pretrained=True)`` builds the architecture without fetching weights."""
    real = timm.create_model

    def create(name, pretrained=False, **kwargs):
        return real(name, pretrained=False, **kwargs)

    timm.create_model = create
    try:
        yield
    finally:
        timm.create_model = real


def import_reference_gcl(gcl: Path) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """MePo's ``models.dualprompt``, ``utils.train_utils`` and ``methods.dualprompt``, imported from ``gcl`` with
    the ``HOST_STUBS`` in place."""
    if str(gcl) not in sys.path:
        sys.path.insert(0, str(gcl))
    sys.modules.setdefault("torch.utils.tensorboard", _stub("torch.utils.tensorboard", SummaryWriter=_NoWriter))
    sys.modules.setdefault("methods._trainer", _stub("methods._trainer", _Trainer=type("_Trainer", (), {})))
    sys.modules.setdefault("sklearn", _stub("sklearn"))
    sys.modules.setdefault("sklearn.manifold", _stub("sklearn.manifold", TSNE=object))
    sys.modules.setdefault("pandas", _stub("pandas"))
    names = ("models.dualprompt", "utils.train_utils", "methods.dualprompt")
    return tuple(importlib.import_module(n) for n in names)


def to_reference_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """Our prompt layout [pool, layers, tokens, D] as the reference stores it, [pool, layers * tokens, D]."""
    return t.flatten(1, 2) if name in ("g_prompt", "e_prompt") else t


REF_PARAMS = {"g_prompt.prompts": "g_prompt", "e_prompt.prompts": "e_prompt", "e_prompt.key": "e_keys",
              "backbone.fc.weight": "head.weight", "backbone.fc.bias": "head.bias"}


class ReferenceHost:
    """MePo's MISA + Meta Cov (``GCL/models/dualprompt.py``) and its trainer step (``GCL/methods/dualprompt.py``:
    ``online_step`` -> ``online_train`` -> ``model_forward``), built by its own ``select_model``."""

    def __init__(self, reference: Path, state: SharedState, settings: Settings):
        self.state, self.settings = state, settings
        with timm_registry_kept():
            self.models, self.train_utils, self.methods = import_reference_gcl(reference / "GCL")
            with no_download():
                kwargs = {"memory_size": 0, "cor_coef": settings.alpha}
                self.model = self.train_utils.select_model("DualPrompt", "cifar10", settings.n_classes, None, kwargs)
        self._set_meta_cov(state.sigma_pre, settings.alpha)
        self.initial = self._initial_state()
        self.reset()

    def _set_meta_cov(self, sigma_pre: torch.Tensor, alpha: float) -> None:
        """What the constructor does with ``--cor_path --pretrain_cor`` (np.load, float32), minus its move to
        'cuda' (patch: set after construction, on the CPU)."""
        self.model.cor_path, self.model.cor_coef = "<harness Sigma_pre>", alpha
        self.model.cov_matrix_tensor = torch.from_numpy(sigma_pre.numpy()).to(torch.float32)

    def _initial_state(self) -> Tensors:
        s = self.state
        state = {f"backbone.{k}": v for k, v in s.backbone.items()}
        state |= {"backbone.fc.weight": s.head["weight"], "backbone.fc.bias": s.head["bias"],
                  "g_prompt.prompts": to_reference_layout("g_prompt", s.g_prompt),
                  "e_prompt.prompts": to_reference_layout("e_prompt", s.e_prompt), "e_prompt.key": s.e_keys}
        return state

    def reset(self) -> None:
        missing, unexpected = self.model.load_state_dict(self.initial, strict=False)
        buffers = {"pos_g_prompt", "pos_e_prompt", "similarity", "g_prompt.frequency", "g_prompt.counter",
                   "e_prompt.frequency", "e_prompt.counter"}
        if unexpected or set(missing) - buffers:
            raise ValueError(f"the reference model does not take the shared state: {missing[:6]} {unexpected[:6]}")
        self.model.task_id = 0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, train: bool, task: int) -> Tensors:
        """Its forward (``model.task_id = task`` in training), with hooks reading the query, the selected prompts,
        the prompted CLS and the aligned CLS."""
        self.reset()
        self.model.train(train)
        self.model.task_id = task
        prompts, norms = [], []
        with forward_hook(self.model.e_prompt, prompts), forward_hook(self.model.backbone.norm, norms):
            logits, aligned = self.model(x, return_feat=True)
        (query, *_), (_, selection) = prompts[0]
        return {"query": query, "index": self._selected(selection), "cls": norms[1][1][:, 0], "aligned": aligned,
                "logits": logits, "key_loss": self.model.lambd * self.model.similarity}

    def _selected(self, selection: torch.Tensor) -> torch.Tensor:
        """The pool entry each sample's selected prompts [B, 1, L, D] are, read back from the prompts."""
        pool = self.model.e_prompt.prompts  # [pool, L, D]
        gap = (selection[:, 0, None] - pool[None]).abs().flatten(2).amax(2)  # [B, pool]
        if not bool((gap.amin(1) == 0).all()):
            raise AssertionError("a selected prompt is no entry of the pool")
        return gap.argmin(1)

    def recoloured(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Its ``transform_to_target_covariance`` (centre, L_B^-1 L_pre) in ``dtype``."""
        sigma = self.model.cov_matrix_tensor if dtype == torch.float32 else self.state.sigma_pre.to(dtype)
        return self.models.transform_to_target_covariance(h.to(dtype), sigma)

    @torch.no_grad()
    def aligned(self, h: torch.Tensor) -> torch.Tensor:
        """Its forward's alignment of ``h`` [B, D]: ``h`` replaces the prompted CLS (a hook on the final norm's
        second call), so the aligned feature comes out of the reference's own lines."""
        self.reset()
        self.model.eval()
        calls = []

        def inject(module, args, out):
            calls.append(None)
            if len(calls) == 2:  # the prompted pass; the first is the query's
                out = out.clone()
                out[:, 0] = h
            return out

        handle = self.model.backbone.norm.register_forward_hook(inject)
        try:
            _, aligned = self.model(self.state.transform(self.state.images[: len(h)]), return_feat=True)
        finally:
            handle.remove()
        return aligned

    def train_step(self, online_iter: int) -> Trained:
        """Its ``online_step`` on the mini-batch: ``online_iter`` x (remap labels, batch mask, forward, loss,
        backward, Adam step, scheduler step), from the initial state."""
        self.reset()
        trainer = self._trainer(online_iter)
        names = {id(p): REF_PARAMS[n] for n, p in self.model.named_parameters() if p.requires_grad}
        grads: list[Tensors] = []
        layout = lambda n, t: t.view_as(self.state.g_prompt if n == "g_prompt" else self.state.e_prompt) \
            if n in ("g_prompt", "e_prompt") else t  # noqa: E731
        params = lambda: {REF_PARAMS[n]: layout(REF_PARAMS[n], p.detach().clone())  # noqa: E731
                          for n, p in self.model.named_parameters() if p.requires_grad}
        start = params()
        with step_recorder(trainer.optimizer, names, grads, layout):
            loss, _ = trainer.online_step(self.state.images.clone(), self.state.labels.clone(), None)
        return Trained(loss, start, grads, params(), adam_settings(trainer.optimizer))

    def _trainer(self, online_iter: int):
        """MePo's DualPrompt trainer without its ``_Trainer.__init__`` (which loads datasets): the attributes its
        step reads, set as that constructor and the scripts would (Adam, default scheduler, no AMP, no memory)."""
        trainer = object.__new__(self.methods.DualPrompt)
        n = self.settings.n_classes
        trainer.__dict__.update(
            model=self.model, memory=_NoMemory(), exposed_classes=[], mask=torch.zeros(n) - torch.inf,
            distributed=False, sessionmask=False, nobatchmask=False, sched_name="default", memory_batchsize=0,
            memory_size=0, online_iter=online_iter, temp_batchsize=self.settings.batch_size, world_size=1,
            device=torch.device("cpu"), train_transform=self.state.transform, topk=1, use_amp=False,
            scaler=torch.amp.GradScaler("cpu", enabled=False), criterion=self.model.loss_fn)
        trainer.optimizer = self.train_utils.select_optimizer("adam", self.settings.lr, self.model)
        trainer.scheduler = self.train_utils.select_scheduler("default", trainer.optimizer)
        return trainer


# --- the host comparison ---------------------------------------------------------------------------------------------
Collected = dict[tuple[str, str], torch.Tensor]
"""(step, tensor) -> what a side computed for it."""
FORWARD_TENSORS = (("index", "prompt selection [B]"), ("query", "query [B, D]"), ("cls", "CLS [B, D]"),
                   ("aligned", "aligned CLS [B, D]"), ("logits", "logits [B, C]"), ("key_loss", "key loss"))


def forward_step(train: bool, task: int) -> str:
    return f"1 forward ({'train, task ' + str(task) if train else 'eval'})"


def collect_host(side, state: SharedState, h: torch.Tensor, settings: Settings) -> Collected:
    """Everything steps 1-5 compare, computed once by ``side``; ``h`` [B, D] is the batch step 2 aligns."""
    out: Collected = {}
    x = state.transform(state.images)
    for train, task in ((True, 0), (False, 0), (True, settings.later_task)):
        tensors = side.forward(x, train, task)
        out |= {(forward_step(train, task), label): tensors[key] for key, label in FORWARD_TENSORS}
    step = "2 Meta Cov alignment"
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        out[(step, f"re-coloured batch, {name} [B, D]")] = side.recoloured(h, dtype)
    out[(step, "aligned feature, fp32 [B, D]")] = side.aligned(h)
    return out | collect_steps(side, settings)


def collect_steps(side, settings: Settings) -> Collected:
    """Steps 3-5: one Adam step's loss and gradients, then every trainable tensor and its update after
    ``online_iter`` steps."""
    one, n = side.train_step(1), settings.online_iter
    out: Collected = {("3 masked loss", "CE + key loss (step 1)"): torch.tensor(one.loss)}
    out |= {("4 gradients (step 1)", name): g for name, g in one.grads[0].items()}
    many, step = side.train_step(n), f"5 after {n} Adam steps"
    out[(step, "mean loss")] = torch.tensor(many.loss)
    out |= {(step, f"Adam setting: {k}"): v for k, v in many.settings.items()}
    for name, p in many.params.items():
        out[(step, name)] = p
        out[(step, f"update of {name}")] = p.double() - many.start[name].double()
    return out


def compare_collected(ours: Collected, theirs: Collected, tol: float, update_tol: float,
                      documented: dict[str, str]) -> list[Row]:
    """A row for every (step, tensor) both sides computed; steps in ``documented`` are expected to differ."""
    rows = []
    for (step, tensor), a in ours.items():
        why = documented.get(step)
        if tensor.startswith("prompt selection"):
            rows.append(compare_index(step, tensor, a, theirs[(step, tensor)], why))
        else:
            limit = update_tol if tensor.startswith("update of") else tol
            rows.append(compare(step, tensor, a, theirs[(step, tensor)], limit, why))
    return rows


def host_rows(ours, theirs, noise, state: SharedState, settings: Settings, tol: float, update_tol: float
              ) -> list[Row]:
    """Steps 1-5 of ours against theirs and, when ``noise`` is given, against our own fp32 noise floor."""
    h = ours.forward(state.transform(state.images), True, 0)["cls"]
    documented = {forward_step(True, settings.later_task): DOCUMENTED["index_bug"]}
    mine = collect_host(ours, state, h, settings)
    rows = compare_collected(mine, collect_host(theirs, state, h, settings), tol, update_tol, documented)
    if noise is not None:
        floor = compare_collected(mine, collect_host(noise, state, h, settings), tol, update_tol, documented)
        with_noise_floor(rows, floor)
    return rows


# --- the refine's outer step -------------------------------------------------------------------------------------
StepCallback = Callable[[Tensors], None]


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


def our_name(reference_name: str) -> str:
    """``module.vit.X`` / ``module.head.X`` (the reference's DataParallel-wrapped metaViT) -> ``backbone.X`` /
    ``head.X``."""
    name = reference_name.removeprefix("module.")
    return "backbone." + name.removeprefix("vit.") if name.startswith("vit.") else name


class _StubDataManager:
    """The reference's ``utils.data_manager.DataManager`` over the harness's images: ``_class_order`` and
    ``get_dataset(indices, source, mode)`` with its semantics (``indices`` are positions in the class order; the
    labels it returns are positions too), 'train' mode from the pseudo-task images, 'test' mode from the joint
    ones, both already through the shared (augmentation-free) transform. It records what it served."""

    def __init__(self, state: SharedState, served: list):
        self._class_order = list(state.plan.classes)
        task_samples = {i for task in state.plan.tasks for i in task}
        x = state.transform(state.refine.images)  # [N, 3, S, S]
        self._pools = {mode: [(i, x[i], self._class_order.index(int(state.refine.targets[i])))
                              for i in range(len(x)) if (i in task_samples) == (mode == "train")]
                       for mode in ("train", "test")}
        self._served = served

    def get_dataset(self, indices, source, mode):
        items = [item for item in self._pools[mode] if item[2] in set(int(i) for i in indices)]
        self._served.append((mode, sorted(i for i, _, _ in items)))
        return items


REFINE_PATCHES = [
    ("from utils.data_manager import DataManager", "",
     "DataManager is the harness's stub (_StubDataManager): the shared images, no ImageNet, no augmentation"),
    ("import wandb", "", "wandb is a no-op stub (the script logs to it unconditionally)"),
    ("if torch.cuda.device_count() > 1:", "if True:",
     "the model is always wrapped in nn.DataParallel (a pass-through on the CPU): the script reads model.module, "
     "which exists only under DataParallel (it crashes on one GPU as shipped)"),
    ('save_path=f"/data/meta_vit2"', "save_path=HARNESS_TMP",
     "checkpoints go to a temporary folder (and torch.save is a no-op during the run)"),
]
REFINE_RUNTIME_PATCHES = [
    "sys.argv: -inner_lr EPS -num_tasks T -num_inner_steps 1 -batch_size 256 -samples N -epochs 1 -model sup",
    "timm.create_model('vit_base_patch16_224_in21k', checkpoint_path=ViT-B_16.npz) builds the architecture "
    "(timm's vit_base_patch16_224) without the npz; nn.DataParallel loads the shared initial state (backbone and "
    "meta head) into the wrapped model",
    "the run ends at the second group (the stub has one group's classes: class_mask[1] raises IndexError), "
    "after the first Reptile update",
]


def patched_refine_source(script: Path, tmp: Path) -> str:
    """The script's text with ``REFINE_PATCHES`` applied, each exactly once."""
    text = script.read_text()
    for old, new, _ in REFINE_PATCHES:
        if text.count(old) != 1:
            raise ValueError(f"{script}: expected one {old!r}, found {text.count(old)}: another reference version?")
        text = text.replace(old, new.replace("HARNESS_TMP", repr(str(tmp))))
    return text


class ReferenceRefine:
    """SunGL001/MePo's ``meta_post_training.py`` run (patched at run time) for its first group: one outer step."""

    def __init__(self, reference: Path, state: SharedState, settings: Settings, initial: Tensors):
        self.script, self.state, self.settings = reference / "meta_post_training.py", state, settings
        self.initial = initial
        self.served: list = []

    def _argv(self) -> list[str]:
        s = self.settings
        return [str(self.script), "-inner_lr", str(s.reptile_eps), "-num_tasks", str(s.refine_tasks),
                "-num_inner_steps", "1", "-batch_size", "256", "-samples", str(s.refine_train_per_class),
                "-epochs", "1", "-model", "sup"]

    def outer_step(self, on_step: StepCallback) -> Tensors:
        wrapped: list[torch.nn.Module] = []
        hook = register_optimizer_step_post_hook(
            lambda *_: on_step({our_name(k): v for k, v in wrapped[0].state_dict().items()}))
        try:
            with tempfile.TemporaryDirectory() as tmp, self._patched(wrapped):
                self._run(patched_refine_source(self.script, Path(tmp)))
        finally:
            hook.remove()
        self._check_served()
        return {our_name(k): v.detach().clone() for k, v in wrapped[0].state_dict().items()}

    def _run(self, source: str) -> None:
        scope = {"__name__": "__main__", "__file__": str(self.script), "wandb": _wandb_stub(),
                 "DataManager": lambda *a, **k: _StubDataManager(self.state, self.served)}
        try:
            exec(compile(source, str(self.script), "exec"), scope)
        except IndexError:
            frame = traceback.extract_tb(sys.exc_info()[2])[-1]
            if "class_mask[task_id]" not in (frame.line or ""):
                raise
            return
        raise AssertionError("the reference refine ran past its first group")

    @contextlib.contextmanager
    def _patched(self, wrapped: list) -> Iterator[None]:
        """timm.create_model, nn.DataParallel, torch.save and sys.argv for the run (``REFINE_RUNTIME_PATCHES``)."""
        initial, backbone = self.initial, self.settings.backbone
        real_create = timm.create_model

        class SharedStateDataParallel(torch.nn.DataParallel):
            def __init__(self, module, *args, **kwargs):
                state = {k.replace("backbone.", "vit.", 1): v for k, v in initial.items()}
                module.load_state_dict(state, strict=True)
                super().__init__(module, *args, **kwargs)
                wrapped.append(self)

        saved = (torch.nn.DataParallel, torch.save, sys.argv)
        timm.create_model = lambda name, **kwargs: real_create(backbone, pretrained=False)
        torch.nn.DataParallel, torch.save, sys.argv = SharedStateDataParallel, lambda *a, **k: None, self._argv()
        try:
            yield
        finally:
            timm.create_model = real_create
            torch.nn.DataParallel, torch.save, sys.argv = saved

    def _check_served(self) -> None:
        """What the stub served must be our plan: the joint set, then each pseudo task's samples."""
        plan = self.state.plan
        expected = [("test", sorted(plan.joint))] + [("train", sorted(t)) for t in plan.tasks]
        if self.served != expected:
            raise AssertionError(f"the reference trained on other samples than our plan: {self.served} != {expected}")


def _wandb_stub() -> types.ModuleType:
    run = types.SimpleNamespace(get_url=lambda: "(no wandb)")
    return _stub("wandb", init=lambda *a, **k: run, log=lambda *a, **k: None, finish=lambda: None, run=run)


Trace = tuple[Tensors, list[Tensors], Tensors]
"""A side's outer step: the initial state, the state after every SGD step, and the state after Reptile."""


def our_trace(ours: OurRefine) -> Trace:
    initial, trace = ours.initial_state(), []
    final = ours.outer_step(lambda s: trace.append({k: v.detach().clone() for k, v in s.items()}))
    return initial, trace, final


def trace_rows(mine: Trace, other: Callable[[Tensors], object], settings: Settings, tol: float, update_tol: float
               ) -> list[Row]:
    """Step 6: ``other`` (built from our initial state) step by step against our trace, compared as it runs (a
    ViT-B state is 350 MB: the other side's states are never kept)."""
    initial, trace, final = mine
    labels, rows = refine_step_labels(settings), []

    def check(state: Tensors) -> None:
        k = len(rows) // 2
        if k >= len(trace):
            raise AssertionError(f"the other side took more SGD steps than ours ({len(trace)})")
        step = f"6 refine: {labels[k]}"
        rows.extend([compare_states(step, trace[k], state, tol),
                     compare_updates(step, trace[k], state, initial, update_tol)])

    theirs = other(initial).outer_step(check)
    if len(rows) != 2 * len(trace):
        raise AssertionError(f"the other side took {len(rows) // 2} SGD steps, ours {len(trace)}")
    step = f"6 refine: after the Reptile update (eps {settings.reptile_eps})"
    return rows + [compare_states(step, final, theirs, tol), compare_updates(step, final, theirs, initial, update_tol)]


def refine_rows(ours: OurRefine, theirs: Callable[[Tensors], object], noise: Callable[[Tensors], object] | None,
                settings: Settings, tol: float, update_tol: float) -> list[Row]:
    """Step 6 of ours against theirs and, when ``noise`` is given, against our own fp32 noise floor."""
    mine = our_trace(ours)
    rows = trace_rows(mine, theirs, settings, tol, update_tol)
    if noise is not None:
        with_noise_floor(rows, trace_rows(mine, noise, settings, tol, update_tol))
    return rows


def refine_step_labels(settings: Settings) -> list[str]:
    """What each SGD step of the outer step is (one batch per pass here: batch 256 holds every set)."""
    inner = [f"inner SGD step (task {t + 1}, epoch {e + 1})" for t in range(settings.refine_tasks) for e in range(4)]
    return inner + ["joint SGD step (theta-hat)"]


# --- running it --------------------------------------------------------------------------------------------------
def reference_commit(reference: Path) -> str | None:
    """The checkout's commit, when ``reference`` is a git work tree."""
    done = subprocess.run(["git", "-C", str(reference), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


@contextlib.contextmanager
def fused_attention(enabled: bool) -> Iterator[None]:
    """Within, timm builds its attention fused (``scaled_dot_product_attention``, its default) or as matmul and
    softmax: the same arithmetic in another fp32 order, which gives our side's noise floor."""
    config = importlib.import_module("timm.layers.config")
    saved = config._USE_FUSED_ATTN
    timm.layers.set_fused_attn(enabled)
    try:
        yield
    finally:
        config._USE_FUSED_ATTN = saved


def host_sides(reference: Path | None, state: SharedState, settings: Settings, perturb: Perturbation, workdir: Path,
               noise_floor: bool) -> tuple:
    """Ours; the reference (or the perturbed stand-in); ours with unfused attention (the noise floor) or None."""
    ours = OurHost(state, settings, workdir / "ours", settings.alpha, settings.lr)
    noise = None
    if noise_floor:
        with fused_attention(False):
            noise = OurHost(state, settings, workdir / "unfused", settings.alpha, settings.lr)
    if reference is not None:
        return ours, ReferenceHost(reference, state, settings), noise
    return ours, OurHost(state, settings, workdir / "stand_in", settings.alpha + perturb.alpha,
                         settings.lr + perturb.lr), noise


def refine_sides(reference: Path | None, state: SharedState, settings: Settings, perturb: Perturbation,
                 workdir: Path, noise_floor: bool) -> tuple:
    """Ours; a factory of the reference (or the perturbed stand-in) from an initial state; one of ours unfused."""
    ours = OurRefine(state, settings, workdir / "ours", settings.reptile_eps)

    def unfused(initial: Tensors) -> OurRefine:
        with fused_attention(False):
            return OurRefine(state, settings, workdir / "unfused", settings.reptile_eps)

    noise = unfused if noise_floor else None
    if reference is not None:
        return ours, lambda initial: ReferenceRefine(reference, state, settings, initial), noise
    eps = settings.reptile_eps + perturb.reptile_eps
    return ours, lambda initial: OurRefine(state, settings, workdir / "stand_in", eps), noise


def run(reference: Path | None, settings: Settings, perturb: Perturbation, tol: float, update_tol: float,
        host: bool, refine: bool, noise_floor: bool = False) -> list[Row]:
    """Every comparison's rows."""
    state, rows = shared_state(settings), []
    with tempfile.TemporaryDirectory() as tmp:
        if host:
            sides = host_sides(reference, state, settings, perturb, Path(tmp), noise_floor)
            rows += host_rows(*sides, state, settings, tol, update_tol)
        if refine:
            sides = refine_sides(reference, state, settings, perturb, Path(tmp), noise_floor)
            rows += refine_rows(*sides, settings, tol, update_tol)
    return rows


def check_settings(reference: Path | None, settings: Settings) -> None:
    if reference is not None and (settings.backbone, settings.img_size) != ("vit_base_patch16_224", 224):
        raise ValueError("the reference's host is ViT-B/16 at 224 px: keep --settings.backbone and img_size")
    if settings.refine_classes % settings.refine_tasks:
        raise ValueError("refine_classes must be a multiple of refine_tasks (the reference cuts equal tasks)")


def main(reference: Path | None = None, settings: Settings = Settings(), perturb: Perturbation = Perturbation(),
         tolerance: float = 1e-4, update_tolerance: float = 1e-3, host: bool = True, refine: bool = True,
         noise_floor: bool = True,
         out: Path = Path("benchmarks/results/reference_equivalence.json")) -> dict:
    """Compare the paper's recipe as built here with the reference code, step by step; write the JSON result.

    Args:
        reference: A checkout of SunGL001/MePo (GCL/ and meta_post_training.py). Without it our side is compared
            with a copy of itself, changed by ``perturb`` (what CI runs).
        settings: The shared state: backbone, mini-batch, recipe and the refine's group.
        perturb: Deliberate changes of the stand-in side (only without a reference).
        tolerance: Largest relative difference of a tensor that passes (fp32: 1e-4).
        update_tolerance: Largest relative difference of an update (parameters after minus before) that passes:
            looser, because fp32 parameters carry an update much smaller than themselves to only a few digits.
        host: Compare the host's forward, alignment, loss, gradients and Adam steps (steps 1-5).
        refine: Compare one Meta Rep outer step (step 6).
        noise_floor: Also compare our side with itself built with timm's attention unfused (the same arithmetic in
            another fp32 order): each row's noise floor; a row over tolerance within 10x of it is fp32 noise.
        out: JSON result path.
    """
    check_settings(reference, settings)
    start = time.time()
    rows = run(reference, settings, perturb, tolerance, update_tolerance, host, refine, noise_floor)
    result = {
        "reference": str(reference) if reference else None,
        "reference_commit": reference_commit(reference) if reference else None,
        "settings": asdict(settings), "perturb": asdict(perturb), "tolerance": tolerance,
        "update_tolerance": update_tolerance,
        "all_passed": all(r.passed is not False for r in rows),
        "rows": [asdict(r) | {"verdict": r.verdict} for r in rows],
        "reference_patches": reference_patches() if reference else [],
        "table": markdown_table(rows), "wall_s": round(time.time() - start, 1),
        "versions": {"torch": torch.__version__, "timm": timm.__version__},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(result["table"])
    return result


def reference_patches() -> list[str]:
    """Every run-time patch of the reference, in words."""
    host = [f"{name}: {why}" for name, why in HOST_STUBS.items()]
    host += ["models.dualprompt.DualPrompt: built by utils.train_utils.select_model with timm.create_model(..., "
             "pretrained=False) (no download); the shared state loaded into it afterwards",
             "Sigma_pre: set on the CPU after construction (cov_matrix_tensor = float32 of the shared Sigma_pre, "
             "cor_coef = alpha), as --cor_path/--pretrain_cor would, without the constructor's .to('cuda')",
             "trainer: methods.dualprompt.DualPrompt without _Trainer.__init__; its step's attributes set as "
             "the scripts run it (Adam via select_optimizer, 'default' scheduler via select_scheduler, AMP off, "
             "memory_size 0, batch mask on, the shared transform as train_transform)"]
    refine = [f"meta_post_training.py: {old!r} -> {new!r}: {why}" for old, new, why in REFINE_PATCHES]
    return host + refine + [f"meta_post_training.py: {p}" for p in REFINE_RUNTIME_PATCHES]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
