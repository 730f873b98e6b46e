"""Order-invariant classifiers for one-pass, rehearsal-free learning, and running feature standardisation.

Why: a linear head trained by SGD on a non-i.i.d. stream writes the stream's class order into its weights
(docs/results.md, "Why the online learners collapsed"): the newest or last-majority class wins on every image.
Heads built from *statistics* of the features do not depend on the order the samples came in:

* ``NearestClassMean`` (NCM, as SimpleCIL): cosine similarity to each class mean, features centred by the
  mean of everything seen.
* ``StreamingLDA``: class means plus one shared (pooled within-class) covariance, accumulated in one pass;
  ``w_k = Sigma^-1 mu_k``, ``b_k = -mu_k^T Sigma^-1 mu_k / 2``. The covariance is shrunk towards a target,
  ``(1 - lam) S + lam * T * tr(S) / tr(T)``, with ``T`` the identity or MePo's Sigma_pre (a prior on the
  feature geometry from pretraining data). ``lam`` is chosen on the stream itself, without test labels: every
  candidate predicts each mini-batch before learning it (test-then-train), and the best so far is used.

Statistics are float64 sums, so after the same samples in any order the model is the same (up to rounding)
for a given ``lam``; which ``lam`` the prequential choice picks can depend on the order.

Example:
    >>> lda = StreamingLDA(dim=2, n_classes=3, shrinkage=(0.1,))
    >>> lda.update(torch.tensor([[0., 0.], [0.1, 0.], [3., 3.], [3.1, 3.]]), torch.tensor([0, 0, 1, 1]))
    >>> lda(torch.tensor([[2.9, 3.1]])).argmax(1).item(), lda.seen
    (1, 2)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mepo_stream.alignment import cholesky
from mepo_stream.class_means import ClassMeans
from mepo_stream.fixed_shape import in_blocks


class RunningStandardize(nn.Module):
    """Standardises features with the cumulative mean and std of every training feature seen (float64 sums).

    Why: frozen ViT features share one large mean direction (it carries most of ``E||x||^2``), so a linear
    head's logits are dominated by ``W_k . mu``, which SGD on a class-ordered stream turns into recency.
    Cumulative (not EMA) moments are order-invariant once the stream is over.
    """

    count: torch.Tensor
    total: torch.Tensor
    total_sq: torch.Tensor

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("total", torch.zeros(dim, dtype=torch.float64))  # sum of x
        self.register_buffer("total_sq", torch.zeros(dim, dtype=torch.float64))  # sum of x^2

    @torch.no_grad()
    def update(self, h: torch.Tensor) -> None:
        h = h.detach().double()
        self.count += h.shape[0]
        self.total += h.sum(0)
        self.total_sq += (h * h).sum(0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.update(h)
        if self.count < 2:
            return h
        mean = self.total / self.count  # [D]
        var = (self.total_sq / self.count - mean * mean).clamp_min(0)
        return (h - mean.to(h.dtype)) / (var.sqrt() + self.eps).to(h.dtype)


class ClassStatistics(ClassMeans):
    """The class sums (``ClassMeans``) plus the total second moment, in float64: one pass, any order."""

    second: torch.Tensor

    def __init__(self, dim: int, n_classes: int):
        super().__init__(n_classes, dim)
        self.register_buffer("second", torch.zeros(dim, dim, dtype=torch.float64))  # sum of x x^T, [D, D]
        self._cache: dict = {}

    @torch.no_grad()
    def update(self, h: torch.Tensor, y: torch.Tensor, sign: float = 1.0) -> None:
        """Add features [B, D] with head-order labels [B] (``sign`` -1 takes them out unchecked, as ``ClassMeans``
        does; ``remove`` refuses samples that were never learned)."""
        self._add(h, y, sign)

    @torch.no_grad()
    def remove(self, h: torch.Tensor, y: torch.Tensor) -> None:
        """Take out features [B, D] learned with head-order labels [B]: the statistics of a learner that never saw
        them (to float64 rounding). The prequential hits they scored stay: they are the stream's history."""
        taken = torch.bincount(y.to(self.counts.device), minlength=len(self.counts))  # [C]
        if bool((taken > self.counts).any()):
            raise ValueError("removing more samples of a class than it has: these were never learned")
        self._add(h, y, -1.0)

    @torch.no_grad()
    def move(self, h: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
        """Features [B, D] learned with head-order labels ``old`` [B] now belong to ``new`` [B] (a correction): out
        of one class, into the other, unscored (they were scored when they came)."""
        self.remove(h, old)
        self._add(h, new, 1.0)

    def _add(self, h: torch.Tensor, y: torch.Tensor, sign: float) -> None:
        h = h.detach().to(self.second.device, torch.float64)  # once, for the class sums and the second moment
        super().update(h, y, sign)
        self.second += sign * (h.T @ h)
        self._cache.clear()

    def memo(self, key: object, make):
        """``make()``, computed once until the sums next change (cleared with the solve's cache on every update,
        assignment and load). Why: what a caller derives from the statistics, such as the novelty scores'
        factorisations (``mepo_stream.novelty``), then costs one computation per update, not one per batch."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def unseen_mask(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(self.counts.to(logits.device)[None, :] == 0, float("-inf"))

    @torch.no_grad()
    def prequential_hits(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Correct predictions [K] of each shrinkage candidate on a batch not learned yet (none here: K = 0)."""
        return torch.zeros(0, dtype=torch.float64)

    @torch.no_grad()
    def assign(self, counts: torch.Tensor, sums: torch.Tensor, second: torch.Tensor, hits: torch.Tensor) -> None:
        """Replace the statistics by sums learned elsewhere, in head order (``mepo_stream.label_statistics``); the
        prequential ``hits`` are empty here (``prequential_hits``)."""
        self.counts.copy_(counts)
        self.sums.copy_(sums)
        self.second.copy_(second)
        self._cache.clear()

    def _load_from_state_dict(self, *args, **kwargs):
        self._cache.clear()
        super()._load_from_state_dict(*args, **kwargs)


class NearestClassMean(ClassStatistics):
    """Cosine similarity to each seen class's mean, features centred by the mean of all samples (SimpleCIL)."""

    def __init__(self, dim: int, n_classes: int, scale: float = 16.0):
        super().__init__(dim, n_classes)
        self.scale = scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.seen == 0:
            return h.new_zeros(h.shape[0], self.counts.shape[0])
        centre = self.sums.sum(0) / self.counts.sum()  # [D]
        protos = F.normalize(self.means() - centre, dim=1).to(h.dtype)  # [C, D]
        logits = self.scale * F.normalize(h - centre.to(h.dtype), dim=1) @ protos.T  # [B, C]
        return self.unseen_mask(logits)


class StreamingLDA(ClassStatistics):
    """Streaming LDA with a shrunk shared covariance; shrinkage chosen prequentially among ``shrinkage``."""

    target: torch.Tensor
    shrinkage: torch.Tensor
    hits: torch.Tensor

    def __init__(self, dim: int, n_classes: int, shrinkage: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4),
                 prior: torch.Tensor | None = None, block_rows: int | None = None):
        super().__init__(dim, n_classes)
        self.block_rows = block_rows
        """The prequential scores run on blocks of exactly this many rows (``mepo_stream.fixed_shape``), so a
        sample's hits do not depend on the size of the mini-batch it came in (None: the batch as it is)."""
        if not shrinkage or not all(0.0 <= lam <= 1.0 for lam in shrinkage):
            raise ValueError(f"shrinkage candidates must be in [0, 1], got {shrinkage}")
        target = torch.eye(dim, dtype=torch.float64) if prior is None else prior.double()
        if target.shape != (dim, dim):
            raise ValueError(f"the covariance prior is {tuple(target.shape)}, the features have {dim} dimensions")
        self.register_buffer("target", target / target.trace() * dim)  # [D, D], trace D
        self.register_buffer("shrinkage", torch.tensor(shrinkage, dtype=torch.float64))  # [K]
        self.register_buffer("hits", torch.zeros(len(shrinkage), dtype=torch.float64))  # prequential correct, [K]

    @property
    def chosen(self) -> int:
        """Index of the shrinkage with the most prequential hits (ties: the first listed)."""
        return int(self.hits.argmax())

    def within_covariance(self) -> torch.Tensor:
        """Pooled within-class covariance [D, D]: (sum x x^T - sum_k n_k mu_k mu_k^T) / N."""
        means = self.means()
        between = (means * self.counts[:, None]).T @ means  # [D, D]
        return (self.second - between) / self.counts.sum().clamp_min(1)

    def solve_chosen(self) -> None:
        """Solve the chosen shrinkage now (a copy for serving then carries the solution)."""
        if self.seen:
            self.solve(self.chosen)

    def solve(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights [C, D] and biases [C] for shrinkage candidate ``k`` (cached until the next update)."""
        if k not in self._cache:
            self._cache[k] = self._solve(float(self.shrinkage[k]))
        return self._cache[k]

    def _solve(self, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights ``mu Sigma^-1`` [C, D] and biases [C] for ``Sigma = (1 - lam) S + lam * s * T``.

        Why one Cholesky per candidate and not one ``eigh`` for all of them (the candidates share the
        eigenvectors): off the main thread LAPACK's ``eigh`` costs more than a Cholesky factorisation and solve per
        candidate, and the service learns in its loop's thread; on the main thread the two cost about the same
        (docs/performance.md).
        """
        means = self.means()  # [C, D]
        weights = torch.cholesky_solve(means.T, self.factor(lam)).T  # [C, D]
        return weights, -0.5 * (weights * means).sum(-1)

    def factor(self, lam: float) -> torch.Tensor:
        """The lower Cholesky factor [D, D] (float64) of the shrunk shared covariance
        ``Sigma = (1 - lam) S + lam * s * T`` (cached until the next update: the novelty scores use it too)."""
        def make() -> torch.Tensor:
            cov, scale = self.memo("spread", self._spread)  # [D, D], []
            sigma = (1 - lam) * cov + (lam + 1e-6) * scale * self.target  # jitter 1e-6 * scale
            return cholesky(sigma, 1e-12 * float(scale), torch.float64)

        return self.memo(("factor", lam), make)

    def _spread(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled within-class covariance [D, D] and its scale (mean variance), the shrinkage's unit."""
        cov = self.within_covariance()
        dim = cov.shape[0]
        # The spread's scale, floored relative to the features' energy: with (near-)identical samples per class
        # the within-class covariance is ~0 and its rounding errors (relative 1e-16 of E[x x^T]) must not decide.
        energy = self.second.trace() / self.counts.sum().clamp_min(1) / dim
        return cov, torch.maximum(cov.trace() / dim, 1e-6 * energy).clamp_min(1e-12)

    def scores(self, h: torch.Tensor, k: int) -> torch.Tensor:
        weights, bias = self.solve(k)
        return self.unseen_mask(h.double() @ weights.T + bias).to(h.dtype)  # [B, C]

    @torch.no_grad()
    def update(self, h: torch.Tensor, y: torch.Tensor, sign: float = 1.0) -> None:
        """Test-then-train: score each shrinkage on the batch before learning it, then add the batch (a batch taken
        out, ``sign`` -1, is not scored)."""
        if sign > 0:
            self.hits += self.prequential_hits(h, y)
        super().update(h, y, sign)

    @torch.no_grad()
    def assign(self, counts: torch.Tensor, sums: torch.Tensor, second: torch.Tensor, hits: torch.Tensor) -> None:
        """The statistics of ``ClassStatistics.assign``, and the prequential hits when given (empty: kept)."""
        super().assign(counts, sums, second, hits)
        if hits.numel():
            self.hits.copy_(hits)

    @torch.no_grad()
    def prequential_hits(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Correct predictions [K] of each shrinkage candidate on features [B, D] with head-order labels [B]."""
        hits = torch.zeros(len(self.shrinkage), dtype=torch.float64, device=self.hits.device)
        if self.seen > 0:
            for k in range(len(self.shrinkage)):
                predicted = in_blocks(lambda rows, k=k: self.scores(rows, k).argmax(1), self.block_rows, h)  # [B]
                hits[k] = (predicted == y.to(h.device)).sum()
        return hits

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.seen == 0:
            return h.new_zeros(h.shape[0], self.counts.shape[0])
        return self.scores(h, self.chosen)
