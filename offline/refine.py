"""``mepo refine``: Meta Rep (bi-level meta post-refinement of the whole backbone), then Sigma_pre, then MISA's
initial session adaptation of the prompts (``offline/isa.py``; ``--isa.skip true`` leaves it out), as a bundle.

Per meta-epoch and group (``mepo_stream.pseudo_tasks``): remember theta0; inner loop = sequential SGD over the
group's pseudo tasks (``inner_epochs`` passes each, training augmentation), outer loop = one SGD pass over the
group's held-out joint samples (test transform), then the Reptile update theta <- theta0 + eps (theta_hat -
theta0) over backbone *and* meta head. One SGD optimizer (momentum 0.9; backbone and head learning rates) is
created once and, as in the reference, never reset unless ``reset_optimizer``. Logits are restricted to the
group's classes by multiplying the others by 0 (the reference) unless ``mask`` says otherwise.

Where this follows the reference code and where the paper (values in ``RefineConfig``/``PseudoTaskConfig``):
code: Reptile eps 0.1, T' = 50 tasks of 2 classes, 4 inner epochs, multiply-mask over the group, persistent
momentum, first-order Reptile, the joint step as a plain SGD pass, ImageNet normalisation, 5 meta-epochs
(the released Sup-21K checkpoint); paper: the gamma = 0.3 split into sequential and joint samples (the code
draws them independently). Augmentation is the batch-wide crop + flip of ``mepo_stream.transforms`` (the code:
per-image RandomResizedCrop + ColorJitter).

Long runs: a progress bar per meta-epoch with the inner and outer losses, a log line per meta-epoch, an atomic
checkpoint after every meta-epoch (``<out>.checkpoint.pt``: model, optimizer, RNG state, progress) and
``--resume`` to continue exactly. Under ``torchrun --nproc_per_node N`` it runs DistributedDataParallel (gloo
on CPU, nccl on GPU), each rank taking its share of every batch; the result matches a single process with the
same global batch up to float summation order.

Example:
    mepo refine --out runs/refined --backbone.img_size 84 --refine.meta_epochs 5
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from mepo_stream.artifacts import BACKBONE, SIGMA_PRE, library_versions, write_bundle
from mepo_stream.backbone import BackboneConfig, create_backbone, device, normalization, provenance
from mepo_stream.checkpoint import load_checkpoint, save_checkpoint
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.meta import MaskMode, MetaHead, group_mask, reptile_update
from mepo_stream.methods import MethodsConfig
from mepo_stream.pseudo_tasks import GroupPlan, PseudoTaskConfig, meta_epoch_plan, shuffled_batches
from mepo_stream.transforms import Transform, test_transform, train_transform
from offline.covariance import CovarianceConfig, sigma_pre
from offline.isa import ISAConfig, add_prompts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RefineConfig:
    """The bi-level loop (defaults: the reference code's effective settings)."""

    meta_epochs: int = 5
    """Meta-epochs K. Reference: the released Sup-21K backbone is meta-epoch 5; paper: 50/10/150."""
    reptile_eps: float = 0.1
    """Reptile step eps (the paper's eta_meta; the code's -inner_lr = 0.1). 0 keeps theta, 1 takes theta_hat."""
    inner_epochs: int = 4
    """Passes over each pseudo task in the inner loop (reference: 4, hard-coded)."""
    lr_backbone: float = 1e-4
    """SGD learning rate of the backbone, eta_theta (paper and code: 1e-4)."""
    lr_head: float = 1e-2
    """SGD learning rate of the meta head, eta_psi (paper and code: 1e-2)."""
    momentum: float = 0.9
    """SGD momentum (code: 0.9)."""
    batch_size: int = 256
    """Global batch size (paper and code: 256), split across ranks under torchrun."""
    mask: MaskMode = "multiply"
    """Out-of-group logits: multiply by 0 (code), neg_inf, or none."""
    reset_optimizer: bool = False
    """Reset the optimizer state at every Reptile reset (code: never)."""
    seed: int = 1
    """Seed of the plan, the batch order and the augmentation."""


@dataclass(frozen=True)
class ISAStage(ISAConfig):
    """MISA's initial session adaptation as refine's last stage, with the refined backbone and refine's data."""

    skip: bool = False
    """Leave the stage out: the bundle gets no prompts.safetensors."""


class MetaModel(nn.Module):
    """Backbone CLS feature -> meta head."""

    def __init__(self, backbone: nn.Module, n_classes: int):
        super().__init__()
        self.backbone, self.head = backbone, MetaHead(backbone.num_features, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))  # timm's headless forward: CLS after the final norm, [B, D]


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
    seen_images: int = 0

    @classmethod
    def create(cls, backbone: BackboneConfig, images: ImageSet, cfg: RefineConfig, ddp: Distributed) -> Trainer:
        """The backbone with a meta head on this rank's device (DDP-wrapped under torchrun), one SGD optimizer
        with the backbone and head learning rates, and the training and test transforms."""
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else device()
        model = MetaModel(create_backbone(backbone), len(images.classes)).to(dev)
        net = nn.parallel.DistributedDataParallel(model) if ddp.world > 1 else model
        optimizer = torch.optim.SGD([
            {"params": model.backbone.parameters(), "lr": cfg.lr_backbone},
            {"params": model.head.parameters(), "lr": cfg.lr_head},
        ], momentum=cfg.momentum)
        img, (mean, std) = backbone.img_size, normalization(model.backbone)
        return cls(model, net, optimizer, images, cfg, ddp, train_transform(img, mean, std, None),
                   test_transform(img, mean, std))

    def save(self, path: Path, meta_epoch: int, history: list[dict]) -> None:
        """Checkpoint after ``meta_epoch``: model, optimizer, RNG state and progress, enough to resume exactly."""
        save_checkpoint(path, {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                               "rng": torch.get_rng_state(), "meta_epoch": meta_epoch, "history": history,
                               "seen_images": self.seen_images})

    def restore(self, path: Path) -> tuple[int, list[dict]]:
        """Load a ``save``d checkpoint; returns the meta-epoch to continue with and the history so far."""
        state = load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.seen_images = state["seen_images"]
        log.info("resuming after meta-epoch %d from %s", state["meta_epoch"], path)
        return state["meta_epoch"] + 1, state["history"]

    def step(self, batch: list[int], group: torch.Tensor, tf: Transform) -> float:
        share = torch.tensor(batch[self.ddp.rank :: self.ddp.world], dtype=torch.long)
        dev = next(self.model.parameters()).device
        x = tf(self.images.images[share].to(dev))
        logits = group_mask(self.net(x), group.to(dev), self.cfg.mask)  # [b, C]
        # sum over the share / global batch, times world because DDP averages gradients over ranks
        loss = F.cross_entropy(logits, self.images.targets[share].to(dev), reduction="sum")
        loss = loss * self.ddp.world / len(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.seen_images += len(batch)
        return loss.item() * len(batch) / max(len(share), 1) / self.ddp.world

    def group(self, plan: GroupPlan, g: torch.Generator, bar: tqdm) -> tuple[float, float]:
        """Inner loop, joint step and Reptile update for one group; returns the last inner and outer losses."""
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
        self.model.load_state_dict(reptile_update(theta0, self.model.state_dict(), self.cfg.reptile_eps))
        return inner, outer

    def meta_epoch(self, epoch: int, tasks: PseudoTaskConfig) -> tuple[float, float]:
        """Every group of the epoch's plan in turn; returns the last group's inner and outer losses."""
        plans = meta_epoch_plan(self.images.targets, tasks, self.cfg.seed, epoch)
        g = torch.Generator().manual_seed(self.cfg.seed * 7919 + epoch)
        with tqdm(total=epoch_images(plans, self.cfg.inner_epochs), desc=f"meta-epoch {epoch}/{self.cfg.meta_epochs}",
                  unit="img", disable=self.ddp.rank != 0) as bar:
            losses = [self.group(p, g, bar) for p in plans]
        return losses[-1]


def epoch_images(plans: list[GroupPlan], inner_epochs: int) -> int:
    return sum(inner_epochs * sum(len(t) for t in p.tasks) + len(p.joint) for p in plans)


def checkpoint_path(out: Path) -> Path:
    return out.parent / f"{out.name}.checkpoint.pt"


# ``mepo refine`` (pyproject.toml); not named ``refine``, which its --refine.* option group would shadow
def meta_refine(
    out: Path,
    backbone: BackboneConfig = BackboneConfig(),
    data: DataConfig = DataConfig(dataset="tinyimagenet-pretrain"),
    tasks: PseudoTaskConfig = PseudoTaskConfig(),
    refine: RefineConfig = RefineConfig(),
    cov: CovarianceConfig = CovarianceConfig(),
    covariance: bool = True,
    isa: ISAStage = ISAStage(),
    method_config: MethodsConfig = MethodsConfig(),
    resume: bool = False,
) -> Path:
    """Meta-refine a pretrained ViT on pseudo task sequences, compute Sigma_pre, warm the prompts (ISA), and
    write a MePo bundle.

    Args:
        out: Bundle folder to write (backbone.safetensors, sigma_pre.safetensors, prompts.safetensors,
            manifest.json).
        backbone: The pretrained backbone to refine.
        data: Pretraining data the pseudo tasks are drawn from (never a downstream class).
        tasks: Pseudo task construction.
        refine: The bi-level loop.
        cov: Sigma_pre estimation with the refined backbone.
        covariance: Compute Sigma_pre after refining.
        isa: MISA's initial session adaptation with the refined backbone on --data, after Sigma_pre
            (--isa.skip true leaves it out).
        method_config: Prompt layout of the ISA host (--method_config.misa.e_pool, ...; as for mepo evaluate).
        resume: Continue from <out>.checkpoint.pt if it exists.
    """
    ddp = Distributed.init()
    start = time.time()
    torch.manual_seed(refine.seed)
    images = load_split(data, "train")
    trainer = Trainer.create(backbone, images, refine, ddp)
    ckpt = checkpoint_path(out)
    first, history = trainer.restore(ckpt) if resume and ckpt.is_file() else (1, [])
    history = meta_train(trainer, tasks, first, history, ckpt, start)
    wall = time.time() - start
    if ddp.rank == 0:
        write_refined_bundle(out, trainer.model, images, backbone, data, tasks, refine, cov if covariance else None,
                             history, trainer.seen_images, wall)
    ddp.finish()
    if ddp.rank == 0 and not isa.skip:  # one process: the other ranks are done and must not wait on it
        add_prompts(out, out, backbone, data, images, isa, method_config)
    return out


def meta_train(trainer: Trainer, tasks: PseudoTaskConfig, first: int, history: list[dict], ckpt: Path,
               start: float) -> list[dict]:
    """Meta-epochs ``first`` to the last, each logged, added to ``history`` and checkpointed (by rank 0) at
    ``ckpt``; ``start`` is the run's start time, for the history's elapsed seconds."""
    cfg = trainer.cfg
    trainer.model.train()
    for epoch in range(first, cfg.meta_epochs + 1):
        inner, outer = trainer.meta_epoch(epoch, tasks)
        history.append({"meta_epoch": epoch, "inner_loss": inner, "outer_loss": outer,
                        "elapsed_s": round(time.time() - start, 1)})
        log.info("meta-epoch %d/%d: inner loss %.4f, outer loss %.4f", epoch, cfg.meta_epochs, inner, outer)
        if trainer.ddp.rank == 0:
            trainer.save(ckpt, epoch, history)
    return history


def write_refined_bundle(out: Path, model: MetaModel, images: ImageSet, backbone: BackboneConfig,
                         data: DataConfig, tasks: PseudoTaskConfig, refine: RefineConfig,
                         cov: CovarianceConfig | None, history: list[dict], seen_images: int, wall: float) -> None:
    """The bundle: refined backbone (no head), Sigma_pre (unless ``cov`` is None), and the manifest."""
    parts = {BACKBONE: {k: v.detach().cpu() for k, v in model.backbone.state_dict().items()}}
    manifest = {
        "kind": "refined",
        "backbone": {**provenance(backbone), "arch": backbone.name},
        "data": {**asdict(data), "classes": images.classes, "n_images": len(images)},
        "pseudo_tasks": asdict(tasks),
        "refine": asdict(refine),
        "meta_epochs_completed": history[-1]["meta_epoch"] if history else 0,
        "history": history,
        "refine_images_per_s": round(seen_images / wall, 2) if wall else None,
        "wall_time_s": round(wall, 1),
        "versions": library_versions(),
    }
    if cov is not None:
        ref = images if cov.data == data else load_split(cov.data, "train")
        parts[SIGMA_PRE] = {SIGMA_PRE: sigma_pre(model.backbone, ref, cov)}
        manifest["covariance"] = {**asdict(cov), "n_classes": len(ref.classes), "n_images": len(ref)}
    write_bundle(out, parts, manifest)
    log.info("wrote MePo bundle %s (%d meta-epochs, %.0f s)", out, manifest["meta_epochs_completed"], wall)
