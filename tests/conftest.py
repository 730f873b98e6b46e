"""Shared fixtures: a tiny timm ViT (random init, CPU) and small slices of the bundled datasets."""

from __future__ import annotations

import pytest
import torch

from mepo_stream.backbone import BackboneConfig, create_backbone
from mepo_stream.data import DataConfig

TINY = BackboneConfig(name="test_vit", weights=None, img_size=32)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(2)


@pytest.fixture
def tiny_backbone():
    return create_backbone(TINY)


@pytest.fixture(scope="session")
def cifar_small() -> DataConfig:
    return DataConfig(dataset="cifar10", train_per_class=30, test_per_class=10)


def color_images(labels: torch.Tensor, size: int = 32, noise: int = 40) -> torch.Tensor:
    """uint8 images [B, 3, size, size] whose colour encodes the label: an easy, learnable stream."""
    g = torch.Generator().manual_seed(int(labels.sum()))
    palette = torch.tensor([[230, 30, 30], [30, 230, 30], [30, 30, 230], [230, 230, 30], [30, 230, 230],
                            [230, 30, 230], [128, 128, 128], [250, 250, 250]])
    base = palette[labels][:, :, None, None].expand(-1, -1, size, size).float()
    return (base + torch.randint(-noise, noise + 1, base.shape, generator=g)).clamp(0, 255).to(torch.uint8)
