"""The refine's guard: a probe of the backbone on held-out pretraining images, needing no downstream data.

Why: a refine can wreck the features within its first steps (one fragile tensor, the patch embedding, can move
a little and take much of the downstream probe's accuracy with it; docs/fidelity.md) while its training loss looks
fine.
Before the first meta-epoch and after every one, the guard fits an offline probe (``mepo_stream.probe``: the
logistic probe, and the streaming LDA fitted offline) on half of each class's held-out images and scores it on
the other half. The held-out images are the pretraining data's *test* split, which the refine never trains on.
When the probe falls more than ``tolerance`` below the untouched backbone's, the refine warns; with ``stop``
it ends there and keeps the best backbone measured so far.

Example:
    mepo refine --out runs/refined --guard.per_class 20 --guard.stop true
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from timm.models.vision_transformer import VisionTransformer

from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.probe import extract_features, fit_probe, lda_accuracy, probe_accuracy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardConfig:
    """The held-out probe checked before the refine and after every meta-epoch."""

    per_class: int | None = 50
    """Held-out images per class (from the pretraining data's test split; null: all), half to fit, half to score."""
    tolerance: float = 0.01
    """How far (accuracy, 0-1) the held-out probe may fall below the untouched backbone's before the guard fires."""
    stop: bool = False
    """End the refine when the guard fires, keeping the best backbone measured so far (default: warn only)."""
    skip: bool = False
    """Run no guard (no held-out probe in the log or the manifest)."""


@dataclass
class HeldOutProbe:
    """Held-out images split per class into a fitting half and a scoring half."""

    fit: ImageSet
    score: ImageSet

    @classmethod
    def load(cls, data: DataConfig, cfg: GuardConfig) -> HeldOutProbe:
        """The test split of the refine's data, ``cfg.per_class`` images per class, alternately to fit and score."""
        images = load_split(replace(data, test_per_class=cfg.per_class), "test")
        rank = torch.zeros_like(images.targets)
        for c in images.targets.unique():
            idx = (images.targets == c).nonzero().squeeze(1)
            rank[idx] = torch.arange(len(idx))
        return cls(subset(images, rank % 2 == 0), subset(images, rank % 2 == 1))

    def measure(self, backbone: VisionTransformer) -> dict[str, float]:
        """Held-out accuracy (0-1) of the logistic probe and of LDA on ``backbone``'s frozen features."""
        was_training = backbone.training
        x_fit, x_score = extract_features(backbone, self.fit.images), extract_features(backbone, self.score.images)
        backbone.train(was_training)
        if not (x_fit.isfinite().all() and x_score.isfinite().all()):
            log.warning("the backbone's features are no longer finite")
            return {"probe": 0.0, "lda": 0.0}
        n = len(self.fit.classes)
        probe = fit_probe(x_fit, self.fit.targets, n)
        return {"probe": round(probe_accuracy(probe, x_score, self.score.targets), 4),
                "lda": round(lda_accuracy(x_fit, self.fit.targets, x_score, self.score.targets, n), 4)}


def subset(images: ImageSet, keep: torch.Tensor) -> ImageSet:
    return ImageSet(images.images[keep], images.targets[keep], images.classes, images.class_names)


@dataclass
class Guard:
    """Tracks the held-out probe over a refine: the base value, the best backbone so far, and whether it fired."""

    cfg: GuardConfig
    probe: HeldOutProbe
    base: float = float("nan")
    best: float = float("-inf")
    best_state: dict[str, torch.Tensor] | None = None

    def resume(self, history: list[dict], backbone: VisionTransformer) -> None:
        """Continue a resumed refine: the base from the history's meta-epoch 0, the restored backbone as the best."""
        measured = [h["held_out"]["probe"] for h in history if "held_out" in h]
        if measured:
            self.base, self.best = measured[0], max(measured)
            self.best_state = {k: v.detach().cpu().clone() for k, v in backbone.state_dict().items()}

    def check(self, backbone: VisionTransformer, epoch: int) -> tuple[dict[str, float], bool]:
        """Measure ``backbone`` after ``epoch`` (0: before refining); returns the scores and whether it fired."""
        scores = self.probe.measure(backbone)
        if epoch == 0:
            self.base = scores["probe"]
        if scores["probe"] > self.best:
            self.best = scores["probe"]
            self.best_state = {k: v.detach().cpu().clone() for k, v in backbone.state_dict().items()}
        fired = scores["probe"] < self.base - self.cfg.tolerance
        level = logging.WARNING if fired else logging.INFO
        log.log(level, "guard after meta-epoch %d: held-out probe %.4f (LDA %.4f), untouched backbone %.4f%s",
                epoch, scores["probe"], scores["lda"], self.base,
                " - the refine is degrading the features" + (", stopping" if self.cfg.stop else "") if fired else "")
        return scores, fired
