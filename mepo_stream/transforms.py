"""Batch transforms on uint8 image tensors [B, 3, H, W], as the reference applies them on the GPU.

The train transform draws **one** set of random parameters per call, so every image in a mini-batch gets
the same crop, flip and AutoAugment policy, as in the reference: Resize -> RandomCrop(pad 4) -> HFlip ->
AutoAugment -> scale to [0, 1] and Normalize. The test transform is Resize -> scale to [0, 1] and Normalize.
Normalisation uses the backbone's pretraining statistics (ImageNet for DINOv2).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torchvision.ops import roi_align
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
    rounding), in less time: those two make four passes over a mini-batch and build their constants on every
    call, and the learner normalises every step.

    Example:
        >>> ScaleNormalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))(torch.full((3, 1, 1), 255, dtype=torch.uint8)).flatten()
        tensor([1., 1., 1.])
    """

    scale: torch.Tensor
    shift: torch.Tensor

    def __init__(self, mean, std):
        super().__init__()
        std = torch.tensor(std, dtype=torch.float64).view(3, 1, 1)
        self.register_buffer("scale", (1 / (255 * std)).float(), persistent=False)  # [3, 1, 1]
        self.register_buffer("shift", (-torch.tensor(mean, dtype=torch.float64).view(3, 1, 1) / std).float(),
                             persistent=False)  # [3, 1, 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8:  # also: the multiply is in place, on a copy only a uint8 input guarantees
            raise TypeError(f"ScaleNormalize takes uint8 images, got {x.dtype}")
        # mul_ then add_, not addcmul: its broadcast over [3, 1, 1] is much slower on the CPU
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


class RandomResizedCropFlip(torch.nn.Module):
    """Per-image random-resized crop and horizontal flip of a uint8 batch, normalised, in one ``roi_align``.

    Why: the refine trains the backbone, and every image in a batch seeing its own crop (as the reference's
    per-image RandomResizedCrop does) is far more augmentation per step than one crop for the batch, at the cost
    of one batched op. ``low_res`` is the chance that a batch also goes through a
    random lower resolution and back, as small images (CIFAR's 32 px) look once upsampled to the model's size.

    Example:
        >>> t = RandomResizedCropFlip(8, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
        >>> t(torch.zeros(4, 3, 16, 16, dtype=torch.uint8)).shape
        torch.Size([4, 3, 8, 8])
    """

    def __init__(self, img_size: int, mean, std, scale: tuple[float, float] = (0.35, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), low_res: float = 0.0):
        super().__init__()
        self.img_size, self.scale, self.log_ratio, self.low_res = img_size, scale, torch.tensor(ratio).log(), low_res
        self.normalize = ScaleNormalize(mean, std)

    def boxes(self, n: int, h: int, w: int) -> torch.Tensor:
        """``n`` random crop boxes [n, 5] (image index, x1, y1, x2, y2) of ``scale`` of the area, ``ratio`` wide."""
        area = h * w * torch.empty(n).uniform_(*self.scale)  # [n]
        ratio = torch.empty(n).uniform_(*self.log_ratio.tolist()).exp()  # [n]
        cw, ch = (area * ratio).sqrt().clamp(max=w), (area / ratio).sqrt().clamp(max=h)  # [n], [n]
        x1, y1 = torch.rand(n) * (w - cw), torch.rand(n) * (h - ch)  # [n], [n]
        return torch.stack([torch.arange(n, dtype=torch.float32), x1, y1, x1 + cw, y1 + ch], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        out = roi_align(self.normalize(x), self.boxes(n, h, w).to(x.device), self.img_size, 1.0, 2, True)
        flip = (torch.rand(n) < 0.5).to(x.device).view(n, 1, 1, 1)
        out = torch.where(flip, out.flip(-1), out)  # [n, 3, S, S]
        if self.low_res and torch.rand(()) < self.low_res:
            size = int(torch.randint(self.img_size // 3, self.img_size, ()))
            out = F.interpolate(F.interpolate(out, size, mode="bilinear", antialias=True), self.img_size,
                                mode="bilinear")
        return out
