"""The state both sides start from: a random ViT, prompts, keys, head, Sigma_pre, one mini-batch, the refine's group."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.experiments.equivalence.settings import META_CLASSES, Settings, Tensors
from mepo_stream.backbone import build_vit
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.methods import MISAConfig
from mepo_stream.pseudo_tasks import GroupPlan
from mepo_stream.transforms import Transform, test_transform


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
