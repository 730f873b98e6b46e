"""Batch transforms on uint8 image tensors [B, 3, H, W], as the reference applies them on the GPU.

The train transform draws **one** set of random parameters per call, so every image in a mini-batch gets
the same crop, flip and AutoAugment policy (reference gotcha 13): Resize -> RandomCrop(pad 4) -> HFlip ->
AutoAugment -> scale to [0, 1] and Normalize. The test transform is Resize -> scale to [0, 1] and Normalize.
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


class ScaleNormalize(torch.nn.Module):
    """uint8 images [..., 3, H, W] to float32 ``(x / 255 - mean) / std`` in one multiply and one add.

    The same values as ``v2.ToDtype(torch.float32, scale=True)`` then ``v2.Normalize(mean, std)`` (to float32
    rounding), in a third of the time: those two make four passes over a mini-batch and build their constants
    on every call (2.3 ms against 0.7 ms for 32 images at 84 px on 2 cores, the learner's every step).

    Example:
        >>> ScaleNormalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))(torch.full((3, 1, 1), 255, dtype=torch.uint8)).flatten()
        tensor([1., 1., 1.])
    """

    def __init__(self, mean, std):
        super().__init__()
        std = torch.tensor(std, dtype=torch.float64).view(3, 1, 1)
        self.register_buffer("scale", (1 / (255 * std)).float(), persistent=False)  # [3, 1, 1]
        self.register_buffer("shift", (-torch.tensor(mean, dtype=torch.float64).view(3, 1, 1) / std).float(),
                             persistent=False)  # [3, 1, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8:  # also: the multiply is in place, on a copy only a uint8 input guarantees
            raise TypeError(f"ScaleNormalize takes uint8 images, got {x.dtype}")
        # mul_ then add_, not addcmul: its broadcast over [3, 1, 1] runs 18x slower on the CPU
        return x.to(torch.float32).mul_(self.scale.to(x.device)).add_(self.shift.to(x.device))


def test_transform(img_size: int, mean, std) -> Transform:
    return v2.Compose([v2.Resize((img_size, img_size), antialias=True), ScaleNormalize(mean, std)])


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
    return v2.Compose([*steps, ScaleNormalize(mean, std)])
