"""Sigma_pre, the meta covariance: the between-class covariance of class-mean features.

``Sigma_pre = 1/(|C|-1) * sum_c (mu_c - mu_bar)(mu_c - mu_bar)^T`` over the per-class mean CLS features of a
reference set (paper Eq. def_cov_pre; the reference's ``np.cov(means, rowvar=False)``, ddof=1), in float64.
It is a covariance of class *prototypes*, not of individual features.

Example:
    >>> feats = torch.tensor([[0., 0.], [2., 0.], [0., 2.], [2., 2.]])
    >>> class_mean_covariance(feats, torch.tensor([0, 0, 1, 1]))
    tensor([[0., 0.],
            [0., 2.]], dtype=torch.float64)
"""

from __future__ import annotations

import torch
from torch import nn


class ClassMeans(nn.Module):
    """Per-class counts and feature sums in float64, kept as buffers on their device: one pass, any order, and the
    features never held in memory all at once. Sigma_pre is the covariance of their means; the statistics
    classifiers (``mepo_stream.heads``) build on the same sums."""

    counts: torch.Tensor
    sums: torch.Tensor

    def __init__(self, n_classes: int, dim: int):
        super().__init__()
        self.register_buffer("counts", torch.zeros(n_classes, dtype=torch.float64))  # [C]
        self.register_buffer("sums", torch.zeros(n_classes, dim, dtype=torch.float64))  # [C, D]

    @property
    def seen(self) -> int:
        """Classes with at least one sample."""
        return int((self.counts > 0).sum())

    @torch.no_grad()
    def update(self, features: torch.Tensor, labels: torch.Tensor, sign: float = 1.0) -> None:
        """Add features [B, D] with labels [B] (class indices); ``sign`` -1 takes them out again, exactly as they
        went in (a sum forgets a sample by subtracting it: no retraining)."""
        h, y = features.detach().to(self.sums.device, torch.float64), labels.to(self.counts.device)
        self.counts.index_add_(0, y, torch.full_like(y, sign, dtype=torch.float64))
        self.sums.index_add_(0, y, sign * h)

    def means(self) -> torch.Tensor:
        """Class means [C, D] (zero rows for unseen classes)."""
        return self.sums / self.counts.clamp_min(1)[:, None]

    def covariance(self) -> torch.Tensor:
        """ddof=1 covariance [D, D] of the means of the classes that have samples."""
        present = self.counts > 0
        if int(present.sum()) < 2:
            raise ValueError("Sigma_pre needs at least two classes with samples")
        means = self.means()[present]  # [C, D]
        centred = means - means.mean(0)
        return centred.T @ centred / (len(means) - 1)


def class_mean_covariance(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sigma_pre of features [N, D] with labels [N] (float64 [D, D])."""
    acc = ClassMeans(int(labels.max()) + 1, features.shape[1])
    acc.update(features, labels)
    return acc.covariance()
