"""``mepo refine``: refine the backbone on the pretraining data, then compute Sigma_pre, then MISA's initial session
adaptation of the prompts (``offline/isa.py``; ``--adapt.skip true`` leaves it out), as a bundle.

Two modes over the same images and steps (``--loop.mode``):

* ``finetune`` (the default, measured best: docs/results.md, "Does the refine lift the ceiling?"): plain supervised
  fine-tuning, the baseline the paper argues against; the epoch's images shuffled jointly over every class.
* ``meta``: the paper's Meta Rep. Per meta-epoch and group (``mepo_stream.pseudo_tasks``): remember theta0; inner
  loop = sequential SGD over the group's pseudo tasks (``inner_epochs`` passes each, training augmentation),
  outer loop = one SGD pass over the group's held-out joint samples (test transform), then the Reptile update
  theta <- theta0 + eps (theta_hat - theta0) over backbone *and* meta head. Logits are restricted to the
  group's classes by multiplying the others by 0 (the reference) unless ``mask`` says otherwise.
  ``--preset paper`` is the reference's recipe as it is (stem trained too).

Both: one SGD optimizer (momentum 0.9; backbone and head learning rates), created once and, as in the reference,
never reset unless ``reset_optimizer``. Deliberate departures from the reference: the stem (``patch_embed``) is
frozen by default (``--loop.freeze``), because its update alone took the downstream probe from 31.9 to 16.9 %
(64 px images upsampled put most of a patch's energy in its flat average, where the pretrained filters hold
almost none); forward passes run in bf16 where the hardware has it (``--loop.precision``); and a guard
(``offline/guard.py``) probes the backbone on held-out pretraining images before and after every meta-epoch.

Where Meta Rep follows the reference code and where the paper (values in ``RefineConfig``/``PseudoTaskConfig``):
code: Reptile eps 0.1, T' = 50 tasks of 2 classes, 4 inner epochs, multiply-mask over the group, persistent
momentum, first-order Reptile, the joint step as a plain SGD pass, ImageNet normalisation, 5 meta-epochs
(the released Sup-21K checkpoint); paper: the gamma = 0.3 split into sequential and joint samples (the code
draws them independently). Augmentation is the batch-wide crop + flip of ``mepo_stream.transforms`` (the code:
per-image RandomResizedCrop + ColorJitter).

Long runs: a progress bar per meta-epoch with the losses, a log line per meta-epoch (losses, held-out probe,
each parameter group's relative change), an atomic checkpoint after every meta-epoch (``<out>.checkpoint.pt``:
model, optimizer, RNG state, progress) and ``--resume`` to continue exactly. SIGINT or SIGTERM lets the current
meta-epoch finish and checkpoint, then exits with 130 or 143 and no bundle (a second signal stops at once, the
previous meta-epoch's checkpoint kept). Under ``torchrun --nproc_per_node
N`` it runs DistributedDataParallel (gloo on CPU, nccl on GPU), each rank taking its share of every batch; the
result matches a single process with the same global batch up to float summation order.

Example:
    mepo refine --out runs/refined --backbone.img_size 84 --loop.meta_epochs 3
    mepo refine --out runs/meta_rep --preset paper
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.layers import Format
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from tqdm import tqdm

from mepo_stream.artifacts import BACKBONE, SIGMA_PRE, library_versions, write_bundle
from mepo_stream.backbone import (
    BackboneConfig,
    cls_feature,
    create_backbone,
    device,
    input_size,
    normalization,
    provenance,
)
from mepo_stream.checkpoint import load_checkpoint, save_checkpoint
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.errors import ConfigError
from mepo_stream.meta import (
    CosineHead,
    MaskMode,
    MetaHead,
    freeze,
    group_changes,
    group_mask,
    relative_change,
    reptile_update,
)
from mepo_stream.methods import MethodsConfig
from mepo_stream.precision import Precision, autocast, resolve_precision
from mepo_stream.pseudo_tasks import GroupPlan, PseudoTaskConfig, meta_epoch_plan, shuffled_batches
from mepo_stream.recipes import build, tracks_given
from mepo_stream.shutdown import StopRequest, deferred_stop
from mepo_stream.transforms import RandomResizedCropFlip, Transform, test_transform, train_transform
from offline.covariance import CovarianceConfig, sigma_pre
from offline.guard import Guard, GuardConfig, HeldOutProbe
from offline.isa import ISAConfig, add_prompts
from offline.optim import Optimizer, Schedule, create_optimizer, lr_factor, param_groups, set_lr
from offline.presets import PresetName, apply_preset, recipe

log = logging.getLogger(__name__)
HeadKind = Literal["mlp", "cosine"]


@tracks_given
@dataclass(frozen=True)
class RefineConfig:
    """The refine loop (defaults: the reference code's settings, except the mode and the frozen stem)."""

    mode: Literal["finetune", "meta"] = "finetune"
    """finetune: supervised training on every pretraining class at once, shuffled (measured best, docs/results.md);
    meta: the paper's Meta Rep, pseudo task sequences and Reptile updates. Both see the same images and steps."""
    freeze: tuple[str, ...] = ("patch_embed",)
    """Parameter groups kept bit-identical (names or dotted prefixes: patch_embed, pos_embed, cls_token,
    blocks.0, ...). Default: the stem, whose update wrecks the features (docs/results.md); [] trains everything, as the
    reference does."""
    lr_patch_embed: float | None = None
    """SGD learning rate of the patch embedding when it is not frozen (null: lr_backbone)."""
    meta_epochs: int = 5
    """Meta-epochs K (in finetune mode: budgets of the same images and steps). Reference: the released Sup-21K
    backbone is meta-epoch 5; paper: 50/10/150. Ignored when --loop.steps or --loop.minutes sets the budget."""
    steps: int | None = None
    """Finetune mode: the run's optimizer steps, over as many meta-epochs as they need, the last cut short (null:
    meta_epochs meta-epochs). The manifest records it whatever set the budget, so a run repeats exactly with it."""
    minutes: float | None = None
    """Finetune mode: a budget of training minutes instead of steps, so a refine takes about the same time on any
    machine. A few throwaway steps, timed before the run, set --loop.steps; data loading, the guard's probes and
    writing the bundle come on top."""
    reptile_eps: float = 0.1
    """Reptile step eps (the paper's eta_meta; the code's -inner_lr = 0.1). 0 keeps theta, 1 takes theta_hat."""
    inner_epochs: int = 4
    """Passes over each pseudo task in the inner loop (reference: 4, hard-coded)."""
    lr_backbone: float = 1e-4
    """SGD learning rate of the backbone, eta_theta (paper and code: 1e-4)."""
    lr_head: float = 1e-2
    """Learning rate of the meta head, eta_psi (paper and code: 1e-2)."""
    optimizer: Optimizer = "sgd"
    """sgd (paper and code) or adamw (the usual ViT fine-tuning recipe; the presets' choice)."""
    momentum: float = 0.9
    """SGD momentum (code: 0.9)."""
    weight_decay: float = 0.0
    """Weight decay of the backbone's matrices (code: 0); AdamW's is decoupled."""
    layer_decay: float = 1.0
    """Layer-wise learning-rate decay: block i of n trains at lr_backbone * layer_decay ** (n - i), the embeddings
    slowest (code: 1, every layer at lr_backbone)."""
    schedule: Schedule = "constant"
    """Learning rate over the run: constant (code) or cosine down to 0 at the last image."""
    warmup: float = 0.0
    """Share of the run's images over which the learning rate rises linearly from 0."""
    label_smoothing: float = 0.0
    """Label smoothing of the cross-entropy (code: 0)."""
    augment: Literal["batch", "image"] = "batch"
    """batch: one crop (pad 4) and flip for the whole batch, as the learner augments; image: a random-resized crop
    and flip of its own for every image (the reference's per-image RandomResizedCrop)."""
    crop_scale: float = 0.35
    """With --loop.augment image: the smallest share of an image's area a crop keeps."""
    low_res: float = 0.0
    """With --loop.augment image: the chance that a batch goes through a random lower resolution (a third of the
    training size and up) and back, as small images look once upsampled (CIFAR's 32 px at 84)."""
    train_img_size: int | None = None
    """Train at this resolution (pixels; a multiple of the patch size) and write the bundle at --backbone.img_size:
    the position table is resampled on the fly, so a lower one trains more images per minute (null: train at
    --backbone.img_size, as the code does)."""
    head: HeadKind = "mlp"
    """The training head on the CLS feature, thrown away after the refine: mlp (Linear-ReLU-Linear, the reference's)
    or cosine (the scaled cosine to each class's weight vector, Baseline++: with --preset best, 1.3 points more on
    Tiny-ImageNet downstream and 1.2 on CIFAR-10 over three refine seeds, docs/refine.md; the presets' head)."""
    head_scale: float = 16.0
    """With --loop.head cosine: the logit scale, the inverse of the softmax's temperature."""
    batch_size: int = 256
    """Global batch size (paper and code: 256), split across ranks under torchrun."""
    mask: MaskMode = "multiply"
    """Out-of-group logits: multiply by 0 (code), neg_inf, or none."""
    reset_optimizer: bool = False
    """Reset the optimizer state at every Reptile reset (code: never)."""
    seed: int = 1
    """Seed of the plan, the batch order and the augmentation."""
    precision: Precision = "auto"
    """Autocast precision of the forward passes (weights and optimizer stay fp32): auto = bf16 where the hardware
    multiplies bf16 natively (2.5-3x faster training on an AVX512-BF16 CPU), fp32 elsewhere. int8 (offered as by
    --learner.precision) is refused: the refine trains the backbone, and quantised layers cannot be trained."""


PAPER_REFINE = build(RefineConfig, recipe("paper")["loop"])
"""The reference's Meta Rep as it runs, every parameter trainable (``--preset paper``)."""


@dataclass(frozen=True)
class CovarianceStage(CovarianceConfig):
    """Sigma_pre of the refined backbone as refine's next stage."""

    skip: bool = False
    """Leave the stage out: the bundle gets no sigma_pre.safetensors."""


@dataclass(frozen=True)
class ISAStage(ISAConfig):
    """MISA's initial session adaptation as refine's last stage, with the refined backbone and refine's data."""

    skip: bool = False
    """Leave the stage out: the bundle gets no prompts.safetensors."""


class MetaModel(nn.Module):
    """Backbone CLS feature -> meta head (the reference's MLP, or a cosine head)."""

    def __init__(self, backbone: VisionTransformer, n_classes: int, head: HeadKind = "mlp", scale: float = 16.0):
        super().__init__()
        dim = backbone.num_features
        self.backbone = backbone
        heads = {"mlp": lambda: MetaHead(dim, n_classes), "cosine": lambda: CosineHead(dim, n_classes, scale)}
        if head not in heads:
            raise ValueError(f"unknown training head {head!r}; choose from {', '.join(heads)}")
        self.head = heads[head]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(cls_feature(self.backbone, x))  # [B, C]


@dataclass
class Distributed:
    """This process's place in a torchrun job (world 1 without torchrun)."""

    rank: int = 0
    world: int = 1

    @classmethod
    def init(cls) -> Distributed:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return cls(dist.get_rank(), dist.get_world_size())

    def finish(self) -> None:
        """Leave the torchrun job: wait for every rank, then tear the process group down (no-op without one)."""
        if self.world > 1:
            dist.barrier()
            dist.destroy_process_group()


@dataclass
class Trainer:
    """The model, its optimizer and the data, with one SGD step on a rank's share of a global batch."""

    model: MetaModel
    net: nn.Module  # the model, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    images: ImageSet
    cfg: RefineConfig
    ddp: Distributed
    train_tf: Transform
    eval_tf: Transform
    base: dict[str, torch.Tensor]  # the untouched backbone, to measure how far each group moved
    total_images: int | None = None  # the run's images, for the learning-rate schedule (``budget``; None: none)
    seen_images: int = 0
    steps_taken: int = 0

    @classmethod
    def create(cls, backbone: BackboneConfig, images: ImageSet, cfg: RefineConfig, ddp: Distributed) -> Trainer:
        """The backbone with a meta head on this rank's device (DDP-wrapped under torchrun), the optimizer over
        the backbone's and head's learning rates, and the training and test transforms at the training size."""
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else device()
        model = MetaModel(create_backbone(backbone), len(images.classes), cfg.head, cfg.head_scale).to(dev)
        frozen = freeze(model.backbone, cfg.freeze)
        log.info("frozen: %d tensors under %s", len(frozen), list(cfg.freeze) or "nothing")
        img, (mean, std) = input_size(model.backbone), normalization(model.backbone)
        if cfg.train_img_size not in (None, img):
            if cfg.train_img_size % (patch := model.backbone.patch_embed.patch_size[0]):
                raise ConfigError(f"--loop.train_img_size {cfg.train_img_size} is not a multiple of the "
                                  f"backbone's {patch}-px patch")
            any_size(model.backbone)
            img = cfg.train_img_size
        net = nn.parallel.DistributedDataParallel(model) if ddp.world > 1 else model
        own_lr = {} if cfg.lr_patch_embed is None else {"patch_embed": cfg.lr_patch_embed}
        groups = param_groups(model.backbone, model.head, cfg.lr_backbone, cfg.lr_head, cfg.layer_decay,
                              cfg.weight_decay, own_lr)
        optimizer = create_optimizer(groups, cfg.optimizer, cfg.momentum)
        base = {k: v.detach().cpu().clone() for k, v in model.backbone.state_dict().items()}
        augment = (RandomResizedCropFlip(img, mean, std, (cfg.crop_scale, 1.0), low_res=cfg.low_res)
                   if cfg.augment == "image" else train_transform(img, mean, std, None))
        return cls(model, net, optimizer, images, cfg, ddp, augment, test_transform(img, mean, std), base)

    def save(self, path: Path, meta_epoch: int, history: list[dict]) -> None:
        """Checkpoint after ``meta_epoch``: model, optimizer, RNG state and progress, enough to resume exactly."""
        save_checkpoint(path, {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                               "rng": torch.get_rng_state(), "meta_epoch": meta_epoch, "history": history,
                               "seen_images": self.seen_images, "steps_taken": self.steps_taken,
                               "steps": self.cfg.steps})

    def restore(self, path: Path) -> tuple[int, list[dict]]:
        """Load a ``save``d checkpoint; returns the meta-epoch to continue with and the history so far."""
        state = load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.seen_images, self.steps_taken = state["seen_images"], state["steps_taken"]
        if self.cfg.minutes is not None:  # the budget the interrupted run measured, not a new measurement
            self.cfg = replace(self.cfg, steps=state["steps"])
        log.info("resuming after meta-epoch %d from %s", state["meta_epoch"], path)
        return state["meta_epoch"] + 1, state["history"]

    def step(self, batch: list[int], group: torch.Tensor | None, tf: Transform) -> float:
        """One SGD step on this rank's share of ``batch``; logits restricted to ``group`` (None: all classes)."""
        share = torch.tensor(batch[self.ddp.rank :: self.ddp.world], dtype=torch.long)
        dev = next(self.model.parameters()).device
        x = tf(self.images.images[share].to(dev))
        with autocast(dev, resolve_precision(self.cfg.precision, dev)):
            logits = self.net(x).float()  # [b, C]
        if group is not None:
            logits = group_mask(logits, group.to(dev), self.cfg.mask)
        # sum over the share / global batch, times world because DDP averages gradients over ranks
        loss = F.cross_entropy(logits, self.images.targets[share].to(dev), reduction="sum",
                               label_smoothing=self.cfg.label_smoothing)
        loss = loss * self.ddp.world / len(batch)
        if self.total_images:
            set_lr(self.optimizer, lr_factor(self.seen_images / self.total_images, self.cfg.schedule, self.cfg.warmup))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.seen_images += len(batch)
        self.steps_taken += 1
        return loss.item() * len(batch) / max(len(share), 1) / self.ddp.world

    @property
    def budget_spent(self) -> bool:
        return self.cfg.steps is not None and self.steps_taken >= self.cfg.steps

    def images_per_second(self, pool: list[int], steps: int = 5) -> float:
        """This machine's training speed, timed on ``steps`` throwaway steps after a warm-up one. The model, the
        optimizer, the RNG and the counters are put back after, so the run that follows is the very run that
        ``--loop.steps`` repeats."""
        model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        optimizer = copy.deepcopy(self.optimizer.state_dict())
        counters = self.seen_images, self.steps_taken
        batches = shuffled_batches(pool, self.cfg.batch_size, torch.Generator().manual_seed(0))[: steps + 1]
        with torch.random.fork_rng(devices=[]):
            self.step(batches[0], None, self.train_tf)
            start = time.perf_counter()
            for batch in batches[1:]:
                self.step(batch, None, self.train_tf)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
        self.seen_images, self.steps_taken = counters
        return sum(len(b) for b in batches[1:]) / elapsed

    def group(self, plan: GroupPlan, g: torch.Generator, bar: tqdm) -> tuple[float, float, float]:
        """Inner loop, joint step and Reptile update for one group; returns the last inner and outer losses and
        how far the inner loop and joint step moved the backbone (relative) before Reptile kept eps of it."""
        theta0 = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.cfg.reset_optimizer:
            self.optimizer.state.clear()
        classes = torch.tensor(plan.classes)
        inner = outer = float("nan")
        for task in plan.tasks:
            for _ in range(self.cfg.inner_epochs):
                for batch in shuffled_batches(task, self.cfg.batch_size, g):
                    inner = self.step(batch, classes, self.train_tf)
                    bar.update(len(batch))
                    bar.set_postfix(inner=f"{inner:.3f}", outer=f"{outer:.3f}")
        for batch in shuffled_batches(plan.joint, self.cfg.batch_size, g):
            outer = self.step(batch, classes, self.eval_tf)
            bar.update(len(batch))
            bar.set_postfix(inner=f"{inner:.3f}", outer=f"{outer:.3f}")
        theta_hat = self.model.state_dict()
        moved = relative_change({k: v for k, v in theta0.items() if k.startswith("backbone.")}, theta_hat)
        self.model.load_state_dict(reptile_update(theta0, theta_hat, self.cfg.reptile_eps))
        return inner, outer, moved

    def run_epoch(self, epoch: int, tasks: PseudoTaskConfig) -> dict[str, float]:
        """One meta-epoch of the configured mode over that epoch's plan; returns its last losses."""
        plans = meta_epoch_plan(self.images.targets, tasks, self.cfg.seed, epoch)
        g = torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch)
        desc = f"{self.cfg.mode} {epoch}/{self.cfg.meta_epochs}"
        images = epoch_images(plans, self.cfg.inner_epochs)
        if self.total_images is not None:  # a step budget cuts the last meta-epoch short
            images = min(images, self.total_images - self.seen_images)
        with tqdm(total=images, desc=desc, unit="img",
                  disable=self.ddp.rank != 0) as bar:
            if self.cfg.mode == "finetune":
                return {"train_loss": self.finetune(plans, g, bar)}
            inner, outer, moved = [self.group(p, g, bar) for p in plans][-1]
        return {"inner_loss": inner, "outer_loss": outer, "inner_move": moved}

    def finetune(self, plans: list[GroupPlan], g: torch.Generator, bar: tqdm) -> float:
        """Plain supervised fine-tuning, the baseline Meta Rep argues against: the images of the epoch's plan,
        shuffled jointly over every class (no pseudo tasks, no mask, no Reptile), training augmentation, as many
        images as Meta Rep's epoch processes; returns the mean loss of the epoch's last pass."""
        pool = finetune_pool(plans)
        left = epoch_images(plans, self.cfg.inner_epochs)
        losses: list[float] = []
        while left > 0 and not self.budget_spent:
            losses = []
            for batch in shuffled_batches(pool, self.cfg.batch_size, g):
                batch = batch[:left]
                if not batch or self.budget_spent:
                    break
                losses.append(self.step(batch, None, self.train_tf))
                left -= len(batch)
                bar.update(len(batch))
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
        return sum(losses) / max(len(losses), 1)


def any_size(backbone: VisionTransformer) -> None:
    """Let a timm ViT take images of any size (a multiple of its patch): its position table, kept at the size it
    was built for, is resampled to each input's grid in the forward pass (timm's ``dynamic_img_size``), so
    training at a lower resolution updates the very table the bundle is written with."""
    backbone.dynamic_img_size = True  # type: ignore[misc]  # Final in timm is for TorchScript; eager code may set it
    backbone.patch_embed.strict_img_size, backbone.patch_embed.flatten = False, False
    backbone.patch_embed.output_fmt = Format.NHWC


def epoch_images(plans: list[GroupPlan], inner_epochs: int) -> int:
    return sum(inner_epochs * sum(len(t) for t in p.tasks) + len(p.joint) for p in plans)


def finetune_pool(plans: list[GroupPlan]) -> list[int]:
    """The images a fine-tuning meta-epoch shuffles together: every image of its plan."""
    return [i for p in plans for i in [*(j for t in p.tasks for j in t), *p.joint]]


def finetune_batches(pool: int, images: int, batch_size: int) -> list[int]:
    """The sizes of a fine-tuning meta-epoch's batches: passes over a pool of ``pool`` images, each ending in a
    partial batch, the last pass cut at the epoch's ``images``."""
    sizes: list[int] = []
    while images > 0:
        take = min(pool, images)
        sizes += [batch_size] * (take // batch_size) + ([take % batch_size] if take % batch_size else [])
        images -= take
    return sizes


def budget(loop: RefineConfig, plans: list[GroupPlan]) -> tuple[RefineConfig, int]:
    """``loop`` with its steps (in finetune mode: those of its meta-epochs when it has none) and as many
    meta-epochs as they need, and the run's images, the learning-rate schedule's length.

    Example (a pool of 100 images, one pass a meta-epoch, batches of 32, 10 steps):
        >>> plan = GroupPlan([0], [list(range(70))], list(range(70, 100)))
        >>> loop, images = budget(RefineConfig(mode="finetune", inner_epochs=1, batch_size=32, steps=10), [plan])
        >>> loop.meta_epochs, images  # two passes of 32+32+32+4, then two steps more
        (3, 264)
    """
    sizes = finetune_batches(len(finetune_pool(plans)), epoch_images(plans, loop.inner_epochs), loop.batch_size)
    if loop.mode != "finetune":
        return loop, loop.meta_epochs * sum(sizes)
    steps = loop.meta_epochs * len(sizes) if loop.steps is None else loop.steps
    epochs = -(-steps // len(sizes))
    return replace(loop, meta_epochs=epochs, steps=steps), sum((sizes * epochs)[:steps])


def budget_steps(trainer: Trainer, plans: list[GroupPlan], minutes: float) -> int:
    """The steps that ``minutes`` of training buy at the speed measured here (rank 0's, under torchrun)."""
    rate = trainer.images_per_second(finetune_pool(plans))
    steps = torch.tensor([max(1, int(minutes * 60 * rate / trainer.cfg.batch_size))])
    if trainer.ddp.world > 1:
        dist.broadcast(steps, src=0)
    log.info("budget: %.1f min at %.1f images/s measured here buys %d steps of %d images",
             minutes, rate, int(steps), trainer.cfg.batch_size)
    return int(steps)


def checkpoint_path(out: Path) -> Path:
    return out.parent / f"{out.name}.checkpoint.pt"


def refine(
    out: Path,
    backbone: BackboneConfig = BackboneConfig(),
    data: DataConfig = DataConfig(dataset="tinyimagenet-pretrain"),
    tasks: PseudoTaskConfig = PseudoTaskConfig(),
    loop: RefineConfig = RefineConfig(),
    cov: CovarianceStage = CovarianceStage(),
    adapt: ISAStage = ISAStage(),
    method: str = "misa",
    method_config: MethodsConfig = MethodsConfig(),
    guard: GuardConfig = GuardConfig(),
    resume: bool = False,
    preset: PresetName | None = None,
) -> Path:
    """Refine a pretrained ViT on the pretraining data (supervised fine-tuning, or the paper's Meta Rep on pseudo
    task sequences), compute Sigma_pre, warm the prompts (ISA), and write a MePo bundle.

    Args:
        out: Bundle folder to write (backbone.safetensors, sigma_pre.safetensors, prompts.safetensors,
            manifest.json).
        backbone: The pretrained backbone to refine.
        data: Pretraining data the pseudo tasks are drawn from (never a downstream class).
        tasks: Pseudo task construction (in finetune mode: which images, and how many per epoch).
        loop: The refine loop (--loop.mode meta: the paper's Meta Rep).
        cov: Sigma_pre estimation with the refined backbone (--cov.skip true leaves it out).
        adapt: MISA's initial session adaptation with the refined backbone on --data, after Sigma_pre
            (--adapt.skip true leaves it out; as for mepo isa).
        method: Prompt-based host whose prompts the ISA stage warms (misa, dualprompt, mvp; as for mepo isa).
        method_config: Prompt layout of the ISA host (--method_config.misa.e_pool, ...; as for mepo isa).
        guard: The held-out probe on the pretraining data's test split, before and after every meta-epoch.
        resume: Continue from <out>.checkpoint.pt if it exists.
        preset: A named recipe for --loop and --tasks (mepo_stream/recipes/refine_<name>.yaml), measured on a
            2-core AMD EPYC with bf16 (docs/refine.md; A_last of the default learner on Tiny-ImageNet downstream
            / CIFAR-10, the mean of three refine seeds): demo (2.5 minutes of training; at 16,000 images, 2.0
            min on 2 cores: 53.9 / 79.6 %), balanced (50,000 images, 5.8 min on 2 cores: 59.4 / 84.7 %), best
            (100,000 images, 10.7 min on 2 cores: 62.5 / 85.8 %), paper (the reference code's Meta Rep).
            The fields given (typed on the command line, set by a --config file, or passed to RefineConfig or
            PseudoTaskConfig from Python) win over it, even at their default value; a budget given
            (--loop.meta_epochs, --loop.steps or --loop.minutes) replaces the preset's.
    """
    if preset is not None:
        loop, tasks = apply_preset(preset, loop, tasks)
        log.info("preset %s: %s; %s", preset, loop, tasks)
    check_budget(loop)
    if loop.precision == "int8":
        raise ConfigError("--loop.precision int8: the refine trains the backbone, and int8 layers cannot be "
                          "trained; use auto, bf16 or fp32 (int8 serves a frozen backbone: --learner.precision)")
    ddp = Distributed.init()
    start = time.time()
    torch.manual_seed(loop.seed)
    images = load_split(data, "train")
    plans = meta_epoch_plan(images.targets, tasks, loop.seed, 1)
    trainer = Trainer.create(backbone, images, loop, ddp)
    ckpt = checkpoint_path(out)
    first, history = trainer.restore(ckpt) if resume and ckpt.is_file() else (1, [])
    if trainer.cfg.minutes is not None and trainer.cfg.steps is None:
        trainer.cfg = replace(trainer.cfg, steps=budget_steps(trainer, plans, trainer.cfg.minutes))
    trainer.cfg, trainer.total_images = budget(trainer.cfg, plans)
    watch = None if guard.skip else Guard(guard, HeldOutProbe.load(data, guard))
    with deferred_stop() as signalled:  # SIGINT/SIGTERM: the meta-epoch finishes and checkpoints, then it stops
        history = meta_train(trainer, tasks, first, history, ckpt, start, watch, signalled)
    wall = time.time() - start
    if ddp.rank == 0:
        run = RefineRun(backbone, data, tasks, trainer.cfg, preset)
        write_refined_bundle(out, trainer, images, run, history, wall, None if cov.skip else cov)
    ddp.finish()
    if ddp.rank == 0 and not adapt.skip:  # one process: the other ranks are done and must not wait on it
        add_prompts(out, out, backbone, data, images, method, adapt, method_config)
    return out


def check_budget(loop: RefineConfig) -> None:
    """A budget the loop can keep: steps and minutes are the fine-tuning loop's, and positive."""
    if loop.steps is None and loop.minutes is None:
        return
    if loop.mode != "finetune":
        raise ConfigError("--loop.steps and --loop.minutes budget the finetune mode; the paper's Meta Rep "
                          "(--loop.mode meta) runs whole meta-epochs: set --loop.meta_epochs")
    if (loop.steps is not None and loop.steps < 1) or (loop.minutes is not None and loop.minutes <= 0):
        raise ConfigError(f"a refine budget must be positive: --loop.steps {loop.steps}, "
                          f"--loop.minutes {loop.minutes}")


def meta_train(trainer: Trainer, tasks: PseudoTaskConfig, first: int, history: list[dict], ckpt: Path,
               start: float, guard: Guard | None = None, signalled: StopRequest | None = None) -> list[dict]:
    """Meta-epochs ``first`` to the last, each logged, added to ``history`` and checkpointed (by rank 0) at
    ``ckpt``; ``start`` is the run's start time, for the history's elapsed seconds. With a ``guard``, the
    held-out probe and each parameter group's relative change join every entry (meta-epoch 0: the untouched
    backbone); when it fires under ``stop``, the loop ends and the best backbone measured is put back. When a stop
    signal is ``signalled``, it raises ``Stopped`` once the meta-epoch is checkpointed."""
    cfg, backbone = trainer.cfg, trainer.model.backbone
    if guard is not None and first == 1:
        history = [{"meta_epoch": 0, "held_out": guard.check(backbone, 0)[0]}]
    elif guard is not None:
        guard.resume(history, backbone)
    trainer.model.train()
    for epoch in range(first, cfg.meta_epochs + 1):
        entry: dict[str, object] = {"meta_epoch": epoch, **trainer.run_epoch(epoch, tasks),
                                    "elapsed_s": round(time.time() - start, 1)}
        entry["change"] = group_changes(trainer.base, backbone.state_dict())
        stop = False
        if guard is not None:
            entry["held_out"], fired = guard.check(backbone, epoch)
            stop = entry["stopped_by_guard"] = fired and guard.cfg.stop
        history.append(entry)
        log.info("meta-epoch %d/%d: %s", epoch, cfg.meta_epochs, entry)
        if trainer.ddp.rank == 0:
            trainer.save(ckpt, epoch, history)
        if signalled is not None and signalled.requested:
            log.warning("stopped after meta-epoch %d/%d: %s holds it; --resume true continues from there",
                        epoch, cfg.meta_epochs, ckpt)
            signalled.raise_if_requested()
        if stop:
            assert guard is not None and guard.best_state is not None  # only a guard stops; it fired, so it kept a best
            backbone.load_state_dict(guard.best_state)
            entry["kept_held_out_probe"] = guard.best
            break
    return history


@dataclass(frozen=True)
class RefineRun:
    """What a refine ran, as its manifest records it: the backbone it started from, its data and pseudo tasks, the
    loop as it ran (its budget resolved to steps), and the preset those came from."""

    backbone: BackboneConfig
    data: DataConfig
    tasks: PseudoTaskConfig
    loop: RefineConfig
    preset: str | None


def write_refined_bundle(out: Path, trainer: Trainer, images: ImageSet, run: RefineRun, history: list[dict],
                         wall: float, cov: CovarianceConfig | None) -> None:
    """The bundle: the trainer's refined backbone (no head), Sigma_pre (unless ``cov`` is None), and the manifest."""
    model, seen_images = trainer.model, trainer.seen_images
    backbone, data, loop = run.backbone, run.data, run.loop
    parts = {BACKBONE: {k: v.detach().cpu() for k, v in model.backbone.state_dict().items()}}
    manifest = {
        "kind": "refined",
        "preset": run.preset,
        "backbone": {**provenance(backbone), "arch": backbone.name},
        "data": {**asdict(data), "classes": images.classes, "n_images": len(images)},
        "pseudo_tasks": asdict(run.tasks),
        "refine": asdict(loop),
        "meta_epochs_completed": history[-1]["meta_epoch"] if history else 0,
        "history": history,
        "refine_images": seen_images,
        "refine_images_per_s": round(seen_images / wall, 2) if wall else None,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": torch.get_num_threads(),
        "wall_time_s": round(wall, 1),
        "versions": library_versions(),
    }
    if cov is not None:
        ref = images if cov.data == data else load_split(cov.data, "train")
        parts[SIGMA_PRE] = {SIGMA_PRE: sigma_pre(model.backbone, ref, cov)}
        settings = {k: v for k, v in asdict(cov).items() if k != "skip"}
        manifest["covariance"] = {**settings, "n_classes": len(ref.classes), "n_images": len(ref)}
    write_bundle(out, parts, manifest)
    log.info("wrote MePo bundle %s: %d images in %d steps (%d meta-epochs) in %.0f s, %.0f images/s%s", out,
             seen_images, loop.steps or 0, manifest["meta_epochs_completed"], wall, seen_images / max(wall, 1e-9),
             "" if loop.minutes is None else f"; a budget of {loop.minutes:g} min bought them on this machine")
