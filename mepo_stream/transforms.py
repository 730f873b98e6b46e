"""Batch transforms on uint8 image tensors [B, 3, H, W], as the reference applies them on the GPU.

The train transform draws **one** set of random parameters per call, so every image in a mini-batch gets
the same crop, flip and AutoAugment policy (reference gotcha 13): Resize -> RandomCrop(pad 4) -> HFlip ->
AutoAugment -> scale to [0, 1] -> Normalize. The test transform is Resize -> scale -> Normalize.
Normalisation uses the backbone's pretraining statistics (ImageNet for DINOv2).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchvision.transforms import v2

Transform = Callable[[torch.Tensor], torch.Tensor]
AUTOAUGMENT_POLICIES = {
    "imagenet": v2.AutoAugmentPolicy.IMAGENET,
    "cifar10": v2.AutoAugmentPolicy.CIFAR10,
    "svhn": v2.AutoAugmentPolicy.SVHN,
}


def test_transform(img_size: int, mean, std) -> Transform:
    return v2.Compose([
        v2.Resize((img_size, img_size), antialias=True),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean, std),
    ])


def train_transform(img_size: int, mean, std, autoaugment: str | None = "imagenet") -> Transform:
    """Batch-wide augmentation; ``autoaugment`` is a policy name or None (the reference: none for CUB/Cars)."""
    steps = [
        v2.Resize((img_size, img_size), antialias=True),
        v2.RandomCrop(img_size, padding=4),
        v2.RandomHorizontalFlip(),
    ]
    if autoaugment:
        if autoaugment not in AUTOAUGMENT_POLICIES:
            raise ValueError(f"unknown AutoAugment policy {autoaugment!r}; use {sorted(AUTOAUGMENT_POLICIES)}")
        steps.append(v2.AutoAugment(AUTOAUGMENT_POLICIES[autoaugment]))
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)]
    return v2.Compose(steps)
