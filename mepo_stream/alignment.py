"""MePo's output alignment (Meta Cov): re-colour features towards the meta covariance with Cholesky factors.

The exact reference formula (MePo ``GCL/models/dualprompt.py``), row-vector convention as in the paper::

    hc    = h - mean_B(h)                            # centre by the batch mean, never added back
    C     = hc^T hc / (B - 1)                        # unbiased batch covariance
    A     = chol(C + eps I)^-1 @ chol(Sigma_pre + eps I)    # eps on both diagonals
    f_hat = normalize(hc @ A)                        # row-wise L2
    out   = (1 - alpha) * h + alpha * f_hat          # blend with the *raw* feature

It is kept as published even though ``hc L^-1 Lp`` is not an exact re-colouring (``hc L^-T Lp^T`` would be):
"fixing" it changes results. Gradients flow through ``C``, the factorisation and the solve. It always runs in
fp32 (rank-deficient ``C`` makes ``L^-1`` huge) and is skipped for batches of size <= 1, where ``C`` is NaN.

Two sources for the statistics (``mean_B``, ``C``):

* ``"batch"``: the batch being aligned, as the reference does at training *and* evaluation. At evaluation
  this is transductive: an image's prediction depends on the other images in its batch.
* ``"running"``: an exponential moving average of the first and second moments of the training features,
  updated by every training batch (like BatchNorm's running statistics). A prediction then depends on the
  image alone, which is what a serving API needs.

Training always uses ``"batch"``; the mode only chooses the statistics used at inference.

Example:
    >>> align = FeatureAlignment(torch.eye(4, dtype=torch.float64), alpha=0.5)
    >>> align(torch.randn(8, 4), mode="batch").shape
    torch.Size([8, 4])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

AlignMode = Literal["batch", "running"]


@dataclass(frozen=True)
class AlignmentConfig:
    """Meta Cov feature alignment settings."""

    alpha: float = 0.7
    """Blend weight of the aligned feature (paper: 0.5 for supervised, 0.7 for self-supervised backbones;
    0 = alignment off, 1 = aligned feature only)."""
    eps: float = 1e-4
    """Diagonal regulariser added to both covariances before the Cholesky factorisation."""
    momentum: float = 0.01
    """Update weight of each training batch in the running statistics used by ``inference_mode: running``."""
    inference_mode: AlignMode = "running"
    """Statistics the service predicts with: ``running`` (non-transductive) or ``batch`` (the reference's
    transductive behaviour: a request's images share statistics). ``mepo evaluate`` reports both."""


def cholesky(cov: torch.Tensor, eps: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Lower Cholesky factor of ``cov + eps * I``, returned in ``out_dtype`` (fp32 for the alignment).

    If rounding leaves the regularised matrix indefinite, the jitter grows tenfold until it factorises
    (at most 6 times); the reference would crash instead.
    """
    eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
    for attempt in range(7):
        factor, info = torch.linalg.cholesky_ex(cov + eps * 10**attempt * eye)
        if int(info) == 0:
            return factor.to(out_dtype)
    raise torch.linalg.LinAlgError(f"covariance is not positive definite even with jitter {eps * 1e6:g}")


def batch_moments(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [D] and unbiased covariance [D, D] of a batch of features [B, D] (B >= 2)."""
    mean = h.mean(dim=0)
    hc = h - mean  # [B, D]
    return mean, hc.T @ hc / (h.shape[0] - 1)


def recolouring(l_cur: torch.Tensor, l_pre: torch.Tensor) -> torch.Tensor:
    """The reference's map ``A = L_cur^-1 @ L_pre`` [D, D] from the two Cholesky factors."""
    return torch.linalg.solve_triangular(l_cur, l_pre, upper=False)


def align(h: torch.Tensor, mean: torch.Tensor, transform: torch.Tensor, alpha: float) -> torch.Tensor:
    """Blend ``h`` [B, D] with its re-coloured (``transform``: ``recolouring``), L2-normalised version (the
    reference formula)."""
    f_hat = F.normalize((h - mean) @ transform, dim=1, eps=1e-6)  # [B, D]
    return (1 - alpha) * h + alpha * f_hat


class FeatureAlignment(nn.Module):
    """Holds ``chol(Sigma_pre + eps I)`` and the running statistics, and aligns features in either mode."""

    l_pre: torch.Tensor
    running_mean: torch.Tensor
    running_second: torch.Tensor
    running_batches: torch.Tensor

    def __init__(self, sigma_pre: torch.Tensor, alpha: float = 0.7, eps: float = 1e-4, momentum: float = 0.01):
        super().__init__()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        dim = sigma_pre.shape[0]
        self.alpha, self.eps, self.momentum = alpha, eps, momentum
        self.register_buffer("l_pre", cholesky(sigma_pre.double(), eps))  # [D, D] fp32
        # float64: E[h h^T] - E[h]E[h]^T cancels badly in fp32 for ViT features with norms >> 1
        self.register_buffer("running_mean", torch.zeros(dim, dtype=torch.float64))  # E[h]
        self.register_buffer("running_second", torch.zeros(dim, dim, dtype=torch.float64))  # E[h h^T]
        self.register_buffer("running_batches", torch.zeros((), dtype=torch.long))
        self._running_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_config(cls, sigma_pre: torch.Tensor, cfg: AlignmentConfig) -> FeatureAlignment:
        return cls(sigma_pre, cfg.alpha, cfg.eps, cfg.momentum)

    def sigma_pre(self) -> torch.Tensor:
        """Sigma_pre [D, D] float64 as held here (``L_pre L_pre^T``, i.e. with the eps regulariser)."""
        factor = self.l_pre.double()
        return factor @ factor.T

    @torch.no_grad()
    def update_running(self, h: torch.Tensor) -> None:
        """Fold a training batch [B, D] into the running first and second moments."""
        h = h.detach().double()
        mean, second = h.mean(0), h.T @ h / h.shape[0]
        m = 1.0 if self.running_batches == 0 else self.momentum
        self.running_mean.lerp_(mean, m)
        self.running_second.lerp_(second, m)
        self.running_batches += 1
        self._running_cache = None

    def running_transform(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Running mean [D] and the ``recolouring`` [D, D] of the running covariance, cached until the next
        update: a prediction then costs one matrix product, not a factorisation and a triangular solve."""
        if self._running_cache is None:
            cov = self.running_second - torch.outer(self.running_mean, self.running_mean)
            self._running_cache = (self.running_mean.float(), recolouring(cholesky(cov, self.eps), self.l_pre))
        return self._running_cache

    def _load_from_state_dict(self, *args, **kwargs):
        self._running_cache = None
        super()._load_from_state_dict(*args, **kwargs)

    def forward(self, h: torch.Tensor, mode: AlignMode = "batch") -> torch.Tensor:
        """Align features [B, D]; training batches also update the running statistics."""
        with torch.autocast(device_type=h.device.type, enabled=False):
            h = h.float()
            if self.training:
                self.update_running(h)
            if mode == "batch":
                if h.shape[0] <= 1:  # the batch covariance is undefined; the reference would emit NaN
                    return h
                mean, cov = batch_moments(h)
                transform = recolouring(cholesky(cov, self.eps), self.l_pre)
            elif mode == "running":
                if self.running_batches == 0:  # nothing learned yet: nothing to align to
                    return h
                mean, transform = self.running_transform()
            else:
                raise ValueError(f"unknown alignment mode {mode!r}; use 'batch' or 'running'")
            return align(h, mean, transform, self.alpha)
