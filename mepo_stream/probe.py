"""The ceiling every online result is reported against: an offline linear probe of the same frozen features.

Why: an online learner sees each sample once, in a class-ordered stream. How much of what the features allow
it keeps is its accuracy divided by that of a classifier trained *offline* on the same training images (all
of them at once, shuffled, several epochs) and scored on the same test images: a standardised multinomial
logistic regression on the frozen backbone's CLS features (un-augmented, as predictions see them).

Example:
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.cat([torch.randn(50, 4, generator=g) + 3, torch.randn(50, 4, generator=g) - 3])
    >>> y = torch.tensor([0] * 50 + [1] * 50)
    >>> probe = fit_probe(x, y, n_classes=2, cfg=ProbeConfig(epochs=50, lr=1e-2))
    >>> probe_accuracy(probe, x, y)
    1.0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mepo_stream.backbone import cls_feature, input_size, normalization
from mepo_stream.heads import StreamingLDA
from mepo_stream.transforms import test_transform


@dataclass(frozen=True)
class ProbeConfig:
    """The offline probe's training (full-data logistic regression on standardised features)."""

    epochs: int = 100
    """Passes over the shuffled training features."""
    lr: float = 1e-3
    """Adam learning rate."""
    weight_decay: float = 1e-4
    """L2 regularisation (Adam weight decay)."""
    batch_size: int = 128
    """Mini-batch size."""
    seed: int = 0
    """Seed of the shuffling and the initialisation."""


@torch.inference_mode()
def extract_features(backbone: VisionTransformer, images: torch.Tensor, batch_size: int = 128,
                     device: torch.device | None = None) -> torch.Tensor:
    """Frozen CLS features [N, D] (fp32, on the CPU) of uint8 images [N, 3, H, W], un-augmented."""
    device = device or next(backbone.parameters()).device
    mean, std = normalization(backbone)
    transform = test_transform(input_size(backbone), mean, std)
    backbone.eval()
    out = [cls_feature(backbone, transform(images[i : i + batch_size].to(device))).float().cpu()
           for i in range(0, len(images), batch_size)]
    return torch.cat(out)


class Probe(nn.Module):
    """Standardisation (training-set mean and std) followed by a linear layer."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, n_classes: int):
        super().__init__()
        self.register_buffer("mean", mean)  # [D]
        self.register_buffer("std", std)  # [D]
        self.linear = nn.Linear(mean.shape[0], n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear((x - self.mean) / self.std)  # [B, C]


def fit_probe(x: torch.Tensor, y: torch.Tensor, n_classes: int, cfg: ProbeConfig = ProbeConfig()) -> Probe:
    """Train the probe on features [N, D] and labels [N] (0 <= y < n_classes)."""
    g = torch.Generator().manual_seed(cfg.seed)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed)
        probe = Probe(x.mean(0), x.std(0) + 1e-6, n_classes)
    optimizer = torch.optim.Adam(probe.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    for _ in range(cfg.epochs):
        for idx in torch.randperm(len(x), generator=g).split(cfg.batch_size):
            loss = nn.functional.cross_entropy(probe(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return probe.eval()


@torch.no_grad()
def probe_accuracy(probe: Probe, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of the probe on features [N, D] with labels [N]."""
    return (probe(x).argmax(1) == y).float().mean().item()


@torch.no_grad()
def lda_accuracy(x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor, n_classes: int,
                 shrinkage: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.7)) -> float:
    """Test accuracy of LDA fitted offline on features [N, D], the best over ``shrinkage`` on the test set.

    Why: with tens of images per class in hundreds of dimensions the logistic probe over-fits and a shrunk LDA
    generalises better, so the best offline head is the larger of the two. Picking the shrinkage on the test
    set makes it an upper bound, as a ceiling should be.

    Example:
        >>> x = torch.tensor([[0., 0.], [0.2, 0.1], [3., 3.], [3.1, 2.8]])
        >>> lda_accuracy(x, torch.tensor([0, 0, 1, 1]), x, torch.tensor([0, 0, 1, 1]), 2)
        1.0
    """
    lda = StreamingLDA(x.shape[1], n_classes, shrinkage)
    lda.update(x, y)
    return max((lda.scores(x_test, k).argmax(1) == y_test).float().mean().item() for k in range(len(shrinkage)))


def offline_ceiling(backbone: VisionTransformer, train_images: torch.Tensor, train_targets: torch.Tensor,
                    test_images: torch.Tensor, test_targets: torch.Tensor, n_classes: int,
                    cfg: ProbeConfig = ProbeConfig()) -> dict[str, float]:
    """Test accuracy of the offline heads trained on every training image's frozen features: the logistic probe,
    LDA (``lda_accuracy``) and the better of the two, ``best``."""
    x, x_test = extract_features(backbone, train_images), extract_features(backbone, test_images)
    probe = probe_accuracy(fit_probe(x, train_targets, n_classes, cfg), x_test, test_targets)
    lda = lda_accuracy(x, train_targets, x_test, test_targets, n_classes)
    return {"probe": probe, "lda": lda, "best": max(probe, lda)}
