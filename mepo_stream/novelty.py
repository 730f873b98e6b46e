""""Not seen yet": how likely an image is of a class the learner has not learned, from the classifier's own sums.

Why: in a Si-Blurry stream new classes keep arriving, and an image of a class not learned yet gets a confident
label of some other class. The streaming LDA (``mepo_stream.heads.StreamingLDA``) already holds what open-set
detection needs: per-class counts and sums, and the total second moment, hence the class means, the shrunk shared
(within-class) covariance and the total mean and covariance of everything learned. Each score here is made of those
sums only, so it is exact under corrections (a sample taken out is as if never learned) and in a group of learners
(summed sums give the same scores as one learner with all samples).

Scores, higher = more likely not learned yet (``NoveltyScore``):

* ``max_softmax``: minus the largest softmax probability of the logits (Hendrycks & Gimpel 2017);
* ``energy``: minus the logsumexp of the logits (Liu et al. 2020);
* ``mahalanobis``: the squared Mahalanobis distance to the nearest class mean under the LDA's shrunk shared
  covariance ``Sigma`` (Lee et al. 2018): ``min_k (x - mu_k)^T Sigma^-1 (x - mu_k)``;
* ``relative_mahalanobis``: that minus the distance to the background Gaussian of everything learned, its total
  mean ``m`` and total covariance ``Sigma_0`` shrunk alike (Ren et al. 2021): ``min_k d_k(x) - d_0(x)``. The
  background term takes out what makes an image far from *every* learned class whether or not it is new (an
  unusual image of a learned class is far from the background too);
* ``stream_mahalanobis`` (for a stream, and the default, ``DEFAULT_SCORE``): the relative form with the background
  weighed ``1 - 1/K``, ``K`` the classes learned, and each class's distance its posterior predictive's (count-aware,
  ``a_k = 1 + 1/n_k``, ``n_k`` the class's samples): ``min_k [d_k(x) / a_k + D log a_k] - (1 - 1/K) d_0(x)``.
  Why: a stream starts with one class, whose Gaussian *is* the background, so the relative form is then noise
  while the plain distance tells well; as classes come the background grows apart from each class and its term
  pays (Ren et al.'s case). And in a Si-Blurry stream a class comes in with a few images, so its mean is a noisy
  estimate and its own next images lie far from it: ``x - mu_k`` then has covariance ``a_k Sigma``, not
  ``Sigma``, and the Gaussian's normaliser adds ``D log a_k`` (no constant tuned: both follow from the counts).
  Measured (``benchmarks/rows/novelty.py``; ``benchmarks/results/novelty.json``, ``streams[*].family``): each
  background term with and without the count-aware distances, on both streams, at every any-time evaluation; the
  default is the member best over both (on Tiny-ImageNet the full background edges it, but with one class learned
  it is noise, which sinks it on CIFAR-10; the count-aware term pays on CIFAR-10, is even on Tiny). Not kept: a
  shrinkage of the novelty covariance of its own (the LDA's prequentially chosen one did as well in an exploration
  on CIFAR-10, and a separate one would be a constant tuned on the test images).

The paper's recipe (prompts and a linear head) and the nearest-class-mean head keep no shared covariance, so they
answer with the logits alone: ``energy`` (``FALLBACK_SCORE``; ``resolve`` says which score a classifier answers).

Cost: the factorisations (one Cholesky and inverse of each shrunk covariance, ``D x D``) are cached with the LDA's
solve until its sums next change, so a prediction pays two more quadratic forms (one ``[B, D] x [D, 2D]``
product) and one ``[B, D] x [D, C]`` product.

Calibration (``NoveltyThreshold``): the learner scores every stream image just before it learns it, so the scores
of images whose class it had already learned are held-out in-distribution samples; the threshold is their upper
``false_alarm`` quantile (scored by a ``FrozenScore``, the model as it stood up to ``CALIBRATE_EVERY`` samples
before), following the stream: a half-life in samples (``clock="samples"``), or a share of the
samples seen (``clock="share"``: the window grows with the stream, so late in a long stream every learned class
still has images in it; both are sums over positions, so a group's states add up). The threshold clocks measured
beside the learner's: ``streams[*].threshold_clocks`` in the results file.

Example:
    >>> from mepo_stream.heads import StreamingLDA
    >>> lda = StreamingLDA(dim=2, n_classes=3, shrinkage=(0.1,))
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.cat([torch.randn(50, 2, generator=g), torch.randn(50, 2, generator=g) + 6])
    >>> lda.update(x, torch.tensor([0] * 50 + [1] * 50))
    >>> near, far = torch.tensor([[0.1, 0.2]]), torch.tensor([[-6.0, 6.0]])
    >>> s = novelty_scores(lda, torch.cat([near, far]), lda(torch.cat([near, far])), "mahalanobis")
    >>> bool(s[1] > s[0])
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from mepo_stream.alignment import cholesky
from mepo_stream.heads import StreamingLDA

Clock = Literal["samples", "share"]
"""How ``NoveltyThreshold``'s half-life is measured: in stream samples, or as a share of the samples seen."""
NoveltyScore = Literal["stream_mahalanobis", "relative_mahalanobis", "mahalanobis", "energy", "max_softmax"]
"""The novelty scores by name (higher = more likely a class not learned yet)."""
NOVELTY_SCORES: tuple[NoveltyScore, ...] = get_args(NoveltyScore)
DEFAULT_SCORE: NoveltyScore = "stream_mahalanobis"
"""The best measured (``benchmarks/results/novelty.json``)."""
FALLBACK_SCORE: NoveltyScore = "energy"
"""What a classifier without class statistics (the paper's linear head, NCM) answers with instead."""
LOGIT_SCORES: tuple[NoveltyScore, ...] = ("energy", "max_softmax")
"""Scores of the logits alone: every classifier has them."""


def check_score(score: str) -> NoveltyScore:
    """``score`` as a ``NoveltyScore``, or a ValueError that names the choices."""
    if score not in NOVELTY_SCORES:
        raise ValueError(f"unknown novelty score {score!r}; choose from {', '.join(NOVELTY_SCORES)}")
    return score


def resolve(classifier: nn.Module | None, score: NoveltyScore = DEFAULT_SCORE) -> NoveltyScore:
    """The score ``classifier`` answers with when ``score`` is asked: a statistics score needs the streaming LDA's
    shared covariance, so any other classifier (the paper's linear head: None; NCM) answers ``FALLBACK_SCORE``."""
    score = check_score(score)
    return score if score in LOGIT_SCORES or isinstance(classifier, StreamingLDA) else FALLBACK_SCORE


def novelty_scores(classifier: nn.Module | None, h: torch.Tensor, logits: torch.Tensor | None,
                   score: NoveltyScore = DEFAULT_SCORE) -> torch.Tensor:
    """Novelty scores [B] (float32, higher = more likely not learned yet) of classifier inputs ``h`` [B, D] whose
    logits are ``logits`` [B, C] (classes not seen yet at -inf, as the learner predicts them; None where ``score``
    is a distance score, which needs none).

    ``score`` is resolved for the classifier (``resolve``). Before any class is learned every image is new: +inf.
    """
    score = resolve(classifier, score)
    if score in LOGIT_SCORES:
        if logits is None:
            raise ValueError(f"the {score} score is made of the logits: pass them")
        if not bool(torch.isfinite(logits).any(1).all()):  # no class learned: nothing to compare with
            return torch.full((h.shape[0],), float("inf"), device=h.device)
        if score == "max_softmax":  # float64: the LDA's logits saturate a float32 softmax
            return -logits.double().softmax(1).amax(1).float()
        return -torch.logsumexp(logits.double(), 1).float()
    assert isinstance(classifier, StreamingLDA), "resolve() answers statistics scores for the streaming LDA only"
    if not classifier.seen:
        return torch.full((h.shape[0],), float("inf"), device=h.device)
    return _distance_score(classifier, h, score).float()


def prepare(classifier: nn.Module | None, score: NoveltyScore = DEFAULT_SCORE) -> None:
    """Compute ``score``'s factorisations now (as ``StreamingLDA.solve_chosen`` does for the weights): a copy for
    serving then carries them, and its first prediction pays no factorisation."""
    if resolve(classifier, score) not in LOGIT_SCORES and isinstance(classifier, StreamingLDA) and classifier.seen:
        _form(classifier, *DISTANCE_FORMS[score], classifier.chosen)


Background = Literal["none", "full", "classes"]
"""The background term of a distance score: none (Lee et al.), the whole background Gaussian (Ren et al.), or it
weighed ``1 - 1/K`` by the ``K`` classes learned (for a stream)."""
DISTANCE_FORMS: dict[str, tuple[Background, bool]] = {
    "mahalanobis": ("none", False), "relative_mahalanobis": ("full", False), "stream_mahalanobis": ("classes", True)}
"""Each statistics score's form: its background term, and whether each class's distance is its posterior
predictive's (count-aware). Others of the family (``distance_score``) are measured beside them in the bench row."""


def distance_score(lda: StreamingLDA, h: torch.Tensor, background: Background = "classes",
                   count_aware: bool = True) -> torch.Tensor:
    """A score of the Mahalanobis family [B] (float64) of classifier inputs ``h`` [B, D]:
    ``min_k [d_k(x) / a_k + D log a_k] - beta d_0(x)``, ``a_k = 1 + 1/n_k`` when ``count_aware`` (else 1),
    ``beta`` by ``background`` (0, 1 or ``1 - 1/K``). From the cached form: two quadratic forms of ``x`` and one
    product with the class rows."""
    return _apply(_form(lda, background, count_aware, lda.chosen), h)


def _apply(form: tuple[torch.Tensor, ...], h: torch.Tensor) -> torch.Tensor:
    quads, centre, cross, const, inflation = form
    x = h.to(centre.device, torch.float64) - centre  # [B, D], centred on the total mean: no cancellation
    near, back = ((x @ quads) * x.repeat(1, 2)).reshape(-1, 2, x.shape[1]).sum(2).unbind(1)  # [B], [B]
    per_class = (near[:, None] + const - 2 * (x @ cross.T)) / inflation  # [B, C]: d_k(x) / a_k (+inf unseen)
    dim = centre.shape[0]
    return (per_class + dim * torch.log(inflation)).amin(1) - back


def _distance_score(lda: StreamingLDA, h: torch.Tensor, score: NoveltyScore) -> torch.Tensor:
    return distance_score(lda, h, *DISTANCE_FORMS[score])


CALIBRATE_EVERY = 256
"""Stream samples a ``FrozenScore`` scores for the threshold's calibration before it is frozen again."""


@dataclass(frozen=True)
class FrozenScore:
    """A distance score as the streaming LDA answered it at one moment (``freeze``): later images are scored as that
    model would have scored them, none of which it had learned. Why: the threshold's calibration scores every
    mini-batch before it is learned; with a score frozen for ``CALIBRATE_EVERY`` samples their scoring waits and
    is done for all of them at once (``OnlineLearner.observe_novelty``), instead of factorisations and a chain of
    small operators per mini-batch, which beside the service's other threads cost a nearly free model more than
    its learning step."""

    form: tuple[torch.Tensor, ...]
    learned: frozenset[int]
    """The head indices of the classes the model had learned (their images are the in-distribution ones)."""

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """Scores [B] (float32) of classifier inputs ``h`` [B, D]."""
        return _apply(self.form, h).float()


def freeze(classifier: nn.Module | None, score: NoveltyScore) -> FrozenScore | None:
    """``score`` frozen at the classifier's present sums, or None where it is not a distance score of a streaming
    LDA that has learned a class (the logit scores cost nothing to compute fresh)."""
    score = resolve(classifier, score)
    if score in LOGIT_SCORES or not isinstance(classifier, StreamingLDA) or not classifier.seen:
        return None
    learned = frozenset((classifier.counts > 0).nonzero().flatten().tolist())
    return FrozenScore(_form(classifier, *DISTANCE_FORMS[score], classifier.chosen), learned)


def _form(lda: StreamingLDA, background: Background, count_aware: bool, k: int) -> tuple[torch.Tensor, ...]:
    """The cached form of a distance score at shrinkage candidate ``k``: its two quadratic matrices side by side,
    ``[Sigma^-1, beta Sigma_0^-1]`` [D, 2D] (the background's weight ``beta`` folded in), the total mean ``m``
    [D], the class rows ``(mu_k - m)^T Sigma^-1`` [C, D], the class constants ``(mu_k - m)^T Sigma^-1 (mu_k - m)``
    [C] (+inf for classes not seen) and the classes' inflations ``a_k`` [C] (``1 + 1/n_k``, or 1)."""
    def make() -> tuple[torch.Tensor, ...]:
        inverse, total = lda.memo(("novelty_inverses", k), lambda: _inverses(lda, k))  # [D, D], [D, D]
        centre = lda.sums.sum(0) / lda.counts.sum().clamp_min(1)  # [D]
        means = lda.means() - centre  # [C, D]
        cross = means @ inverse  # [C, D] (Sigma^-1 is symmetric)
        const = (cross * means).sum(1).masked_fill(lda.counts == 0, float("inf"))  # [C]
        beta = {"none": 0.0, "full": 1.0}.get(background, 1.0 - 1.0 / max(lda.seen, 1))
        counts = lda.counts.double().to(centre.device)
        inflation = 1 + 1 / counts.clamp_min(1) if count_aware else torch.ones_like(counts)  # [C]
        return torch.cat([inverse, beta * total], 1), centre, cross, const, inflation

    return lda.memo(("novelty", background, count_aware, k), make)


def _inverses(lda: StreamingLDA, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``Sigma^-1`` and ``Sigma_0^-1`` [D, D] (float64) at shrinkage candidate ``k``: the LDA's shrunk shared
    covariance, and the total covariance of everything learned shrunk alike (the background Gaussian's)."""
    lam = float(lda.shrinkage[k])
    _, scale = lda.memo("spread", lda._spread)  # the LDA's own shrinkage unit (same cache key)
    n = lda.counts.sum().clamp_min(1)
    centre = lda.sums.sum(0) / n  # [D]
    total = lda.second / n - torch.outer(centre, centre)  # [D, D]
    dim = total.shape[0]
    total_scale = torch.maximum(total.trace() / dim, scale)
    sigma_0 = (1 - lam) * total + (lam + 1e-6) * total_scale * lda.target  # [D, D], shrunk as the LDA's Sigma
    background = cholesky(sigma_0, 1e-12 * float(total_scale), torch.float64)
    return torch.cholesky_inverse(lda.factor(lam)), torch.cholesky_inverse(background)


def auroc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` [N] ranking ``positive`` [N] (bool) above the rest: the chance that a
    random positive outscores a random negative, ties counted half (Mann-Whitney U). NaN without both kinds."""
    scores, positive = scores.double().flatten(), positive.bool().flatten()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts  # [U]: rank - 1 of each distinct value's first occurrence
    ranks = (first + (counts + 1) / 2).double()[inverse]  # [N]: average ranks of ties
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))



class NoveltyThreshold(nn.Module):
    """A threshold on novelty scores, calibrated online to a target false-alarm rate on the learned classes.

    ``observe`` takes each stream image's score, computed just before the image is learned, and whether its class
    had been learned by then: those are held-out scores of learned classes (in-distribution), and the threshold is
    their upper ``false_alarm`` quantile: a new image of a learned class is flagged novel with that probability.
    Scores of images whose class was new are kept too (``detection``: the share of true novelties flagged).

    State: weighted histograms over a fixed grid of ``asinh(score)`` (``bins`` bins over ``[-span, span]``: any
    score's scale, relative resolution ``2 span / bins``), float64 buffers (``state_dict``). Following the stream:
    each score weighs ``2 ** (position / half_life)`` (its stream position), so the newest ``half_life`` samples
    weigh as much as all before them, as an exponentially decaying histogram would, but as a sum: it does not
    depend on the order the scores come in, and the states of a group's learners (each its partitions' images, at
    their stream positions) add up to one learner's (``merged``; weights kept relative to ``anchor``, and rebased
    before they overflow). ``half_life=None``: every score weighs the same.

    Example:
        >>> t = NoveltyThreshold(false_alarm=0.1, half_life=None)
        >>> t.observe(torch.arange(100.0), torch.ones(100, dtype=torch.bool), 0)
        >>> 89 < t.threshold < 90, t.flag(torch.tensor([50.0, 95.0])).tolist()
        (True, [False, True])
        >>> NoveltyThreshold(false_alarm=1.5)
        Traceback (most recent call last):
        ...
        ValueError: the target false-alarm rate must be in (0, 1), got 1.5
    """

    known: torch.Tensor
    novel: torch.Tensor
    anchor: torch.Tensor
    count: torch.Tensor

    def __init__(self, false_alarm: float = 0.05, half_life: float | None = 400.0, bins: int = 8192,
                 span: float = 24.0, min_known: int = 20, clock: Clock = "samples"):
        super().__init__()
        if not 0.0 < false_alarm < 1.0:  # NaN fails too
            raise ValueError(f"the target false-alarm rate must be in (0, 1), got {false_alarm}")
        if clock not in ("samples", "share"):
            raise ValueError(f"the clock is 'samples' or 'share', got {clock!r}")
        if clock == "samples" and half_life is not None and not half_life > 0:
            raise ValueError(f"the half-life must be a positive number of samples (or None), got {half_life}")
        if clock == "share" and half_life is not None and not 0.0 < half_life < 0.5:
            raise ValueError(f"the half-life must be a share of the samples seen in (0, 0.5) (or None), "
                             f"got {half_life}")
        if bins < 2 or not span > 0 or min_known < 1:
            raise ValueError(f"need bins >= 2, span > 0 and min_known >= 1, got {bins}, {span}, {min_known}")
        self.false_alarm, self.half_life, self.span, self.min_known = float(false_alarm), half_life, span, min_known
        self.clock = clock
        self._unit = half_life  # the half-life in clock units: samples, or log2 of the stream position
        if clock == "share" and half_life is not None:  # the newest share f weighs half: (1 - f)^(1 + 1/u) = 1/2
            self._unit = -math.log2(1 - half_life) / (1 + math.log2(1 - half_life))
        self.register_buffer("known", torch.zeros(bins, dtype=torch.float64))  # [bins], weighted counts
        self.register_buffer("novel", torch.zeros(bins, dtype=torch.float64))  # [bins]
        self.register_buffer("anchor", torch.zeros((), dtype=torch.float64))  # the position weighing 1
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))  # in-distribution scores, unweighted
        self._lower = torch.sinh(torch.linspace(-span, span, bins + 1, dtype=torch.float64)[:-1])  # [bins] edges
        self._value: float | None = None  # the threshold, until the histograms next change ...
        self._detection: float | None = None  # ... and its detection rate

    def _bin(self, scores: torch.Tensor) -> torch.Tensor:
        u = torch.asinh(scores.double()).clamp(-self.span, self.span)  # [B]
        return ((u + self.span) / (2 * self.span) * len(self.known)).long().clamp(0, len(self.known) - 1)

    def _rebase(self, anchor: float) -> None:
        """Move the anchor to ``anchor`` (weights stay relative, so the histograms scale by the difference)."""
        if self._unit is not None and anchor != float(self.anchor):
            factor = 2.0 ** ((float(self.anchor) - anchor) / self._unit)
            self.known *= factor
            self.novel *= factor
            self.anchor.fill_(anchor)

    @torch.no_grad()
    def observe(self, scores: torch.Tensor, known: torch.Tensor, positions: torch.Tensor | int) -> None:
        """Take the scores [B] of stream images scored just before they were learned, whether each one's class had
        been learned by then (``known`` [B], bool), and their stream positions (``positions`` [B], or the first
        one's: the learner's ``samples_seen`` for a learner alone, each record's sample index in a group). Scores
        that are not finite (before any class was learned) are skipped."""
        scores, known = scores.detach().flatten().cpu(), known.flatten().cpu().bool()
        pos = (torch.as_tensor(positions, dtype=torch.float64).flatten().cpu() if not isinstance(positions, int)
               else positions + torch.arange(len(scores), dtype=torch.float64))  # [B]
        keep = torch.isfinite(scores)
        scores, known, pos = scores[keep], known[keep], pos[keep]
        if not len(scores):
            return
        self._value = self._detection = None
        weight = torch.ones(len(scores), dtype=torch.float64)
        if self._unit is not None:
            if self.clock == "share":  # the clock: log2 of the position (from 1), so weights grow as a power of it
                pos = torch.log2(pos.clamp_min(0) + 1)
            if float(pos.max() - self.anchor) > 64 * self._unit:  # 2**64: rebase long before float64 overflows
                self._rebase(float(pos.max()))
            weight = torch.exp2((pos - self.anchor) / self._unit)
        where = self._bin(scores)
        self.known.index_add_(0, where[known], weight[known])
        self.novel.index_add_(0, where[~known], weight[~known])
        self.count += known.sum()

    @property
    def threshold(self) -> float:
        """The score above which an image is flagged novel: the in-distribution scores' upper ``false_alarm``
        quantile (interpolated within its bin); +inf until ``min_known`` in-distribution scores came (computed
        once per change: every status read and snapshot asks for it)."""
        if self._value is None:
            self._value = self._quantile()
        return self._value

    def _quantile(self) -> float:
        total = float(self.known.sum())
        if float(self.count) < self.min_known or total <= 0:
            return float("inf")
        tail = self.known.flip(0).cumsum(0).flip(0) / total  # [bins]: share at or above each bin's lower edge
        j = int((tail > self.false_alarm).nonzero().max())  # the bin the quantile falls in
        inside = float(self.known[j]) / total
        above = float(tail[j]) - inside
        fraction = (self.false_alarm - above) / inside if inside > 0 else 0.0  # of bin j, from its top
        width = 2 * self.span / len(self.known)
        return math.sinh(-self.span + (j + 1 - fraction) * width)

    def flag(self, scores: torch.Tensor) -> torch.Tensor:
        """Which scores [B] are flagged novel (bool [B]): above the threshold."""
        return scores > self.threshold

    def detection(self) -> float:
        """The weighted share of stream images of classes new when they came that the current threshold flags
        (NaN before any came; computed once per change, as the threshold)."""
        if self._detection is None:
            threshold, total = self.threshold, float(self.novel.sum())
            self._detection = float(self.novel[self._lower >= threshold].sum()) / total if total > 0 else float("nan")
        return self._detection

    def settle(self) -> NoveltyThreshold:
        """Compute the threshold and its detection rate now, in the thread that changed the scores, so that a reader
        on another thread (a status read, under the learner's lock) only reads them: computed there, they held the
        model thread up."""
        self.detection()  # the threshold first
        return self

    @torch.no_grad()
    def add_(self, other: NoveltyThreshold) -> NoveltyThreshold:
        """Add another learner's state (a group's member, its partitions' scores) into this one: the state of one
        learner that observed both. Both anchors move to the later one first, so the weights agree."""
        if ((other.half_life, other.clock, other.span, len(other.known))
                != (self.half_life, self.clock, self.span, len(self.known))):
            raise ValueError("thresholds with different half-lives, clocks or grids cannot be added")
        self._value = self._detection = None
        later = max(float(self.anchor), float(other.anchor))
        self._rebase(later)
        factor = 1.0 if self._unit is None else 2.0 ** ((float(other.anchor) - later) / self._unit)
        self.known += factor * other.known.to(self.known.device)
        self.novel += factor * other.novel.to(self.novel.device)
        self.count += other.count.to(self.count.device)
        return self

    @classmethod
    def merged(cls, parts: list[NoveltyThreshold]) -> NoveltyThreshold:
        """One threshold holding the sum of ``parts`` (a group's members; the first part's settings)."""
        first = parts[0]
        total = cls(first.false_alarm, first.half_life, len(first.known), first.span, first.min_known, first.clock)
        for part in parts:
            total.add_(part)
        return total

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        self._value = self._detection = None
        super()._load_from_state_dict(*args, **kwargs)
