"""Immutable model snapshots for serving while the learner keeps training.

A snapshot is the model's inference copy (a frozen backbone is shared) and its label map: swapping one reference
makes a request see one consistent model. Predictions use the ``running`` alignment statistics by default (an
image's answer does not depend on the other images of its request).

Example:
    >>> from mepo_stream.model import ModelConfig, create_model
    >>> from mepo_stream.backbone import BackboneConfig
    >>> from mepo_stream.learner import LearnerConfig, OnlineLearner
    >>> cfg = LearnerConfig(autoaugment=None)
    >>> model = create_model(ModelConfig(backbone=BackboneConfig(name="test_vit", weights=None, img_size=32),
    ...                                  learner=cfg), 3)
    >>> learner = OnlineLearner(model, cfg)
    >>> _ = learner.observe(torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8), torch.tensor([2, 0, 2, 0]))
    >>> snap = take_snapshot(learner, version=1)
    >>> sorted(label for label, _ in snap.top_k(snap.probabilities(torch.zeros(1, 3, 32, 32, dtype=torch.uint8)), 3)[0])
    [0, 2]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mepo_stream.alignment import AlignMode
from mepo_stream.learner import OnlineLearner
from mepo_stream.methods.base import ContinualMethod
from mepo_stream.novelty import NoveltyScore


@dataclass(frozen=True)
class Snapshot:
    model: ContinualMethod | None  # None only before a replica's first snapshot
    exposed: tuple[int, ...]
    version: int
    samples_seen: int
    align_mode: AlignMode = "running"
    novelty_score: NoveltyScore | None = None
    """The novelty score its answers carry (``mepo_stream.novelty``; None: none)."""
    novelty_threshold: float = math.inf
    """Above it an image is answered as novel: the learner's calibrated threshold at this version (inf: not
    calibrated yet, nothing is flagged)."""

    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities [B, n_seen] over the seen classes (in ``exposed`` order) for uint8 images."""
        return self.answer(images).probs

    def answer(self, images: torch.Tensor) -> Answers:
        """The probabilities and novelty scores of uint8 images [B, 3, S, S], from one forward."""
        if not self.exposed or self.model is None:
            raise LookupError("the model has not learned any class yet")
        probs, novelty = self.model.answer(images, len(self.exposed), self.align_mode, self.novelty_score)
        return Answers(self, probs, novelty)

    def top_k(self, probs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
        """Top-k (original label, probability) pairs per row of ``probabilities``' output."""
        return top_k(probs, self.exposed, k)


@dataclass(frozen=True)
class Answers:
    """One snapshot's answers to images: probabilities [B, n_seen] (``exposed`` order), novelty scores [B] or None."""

    snapshot: Snapshot
    probs: torch.Tensor
    novelty: torch.Tensor | None

    @property
    def novel(self) -> torch.Tensor | None:
        """Whether each image is answered as of a class not learned yet [B] (its score above the threshold)."""
        return None if self.novelty is None else self.novelty > self.snapshot.novelty_threshold

    def split(self, sizes: list[int]) -> list[Answers]:
        """The answers of consecutive requests of ``sizes`` images."""
        novelty = [None] * len(sizes) if self.novelty is None else self.novelty.split(sizes)
        return [Answers(self.snapshot, p, n) for p, n in zip(self.probs.split(sizes), novelty, strict=True)]

    def rows(self, k: int, names: dict[int, str]) -> list[dict]:
        """Each image's answer as the routes give it: its top-``k`` classes (``ranked``), novelty score and flag."""
        top = ranked(self.snapshot.top_k(self.probs, k), names)
        novel = self.novel
        return [{"top_k": labels,
                 "novelty": None if self.novelty is None else round(float(self.novelty[i]), 6),
                 "novel": None if novel is None else bool(novel[i])} for i, labels in enumerate(top)]


def top_k(probs: torch.Tensor, exposed: Sequence[int], k: int) -> list[list[tuple[int, float]]]:
    """Top-k (original label, probability) pairs per row of probabilities [B, n_seen] in ``exposed`` order."""
    values, index = probs.topk(min(k, probs.shape[1]), dim=1)
    return [[(exposed[i], p) for i, p in zip(row_i.tolist(), row_p.tolist(), strict=True)]
            for row_i, row_p in zip(index, values, strict=True)]


def ranked(pairs: list[list[tuple[int, float]]], names: dict[int, str]) -> list[list[dict]]:
    """``top_k``'s pairs as ``/v1/predict`` and the predictions topic give them, most probable first."""
    return [[{"label": label, "name": names.get(label, str(label)), "probability": round(p, 6)} for label, p in row]
            for row in pairs]


def take_snapshot(learner: OnlineLearner, version: int, align_mode: AlignMode = "running",
                  novelty: NoveltyScore | None = None) -> Snapshot:
    """The learner's model as an inference copy with its label map, its ``novelty`` score and threshold."""
    threshold = learner.novelty_threshold
    return Snapshot(learner.method.inference_copy(), tuple(learner.exposed), version, learner.samples_seen,
                    align_mode, novelty, math.inf if threshold is None else threshold.threshold)
