"""Immutable model snapshots for serving while the learner keeps training.

A snapshot is the model's inference copy (``ContinualMethod.inference_copy``: everything the learner trains,
prompts, keys, head, classifier and alignment statistics; the backbone too for methods that fine-tune it,
otherwise the frozen backbone is shared), plus the label map. The service makes one when a request or a
publication needs the learner's newest version and swaps one reference, so a request always sees one consistent
model, never a half-updated one. Predictions use the ``running`` alignment statistics by default
(non-transductive: an image's prediction does not depend on the other images in its request), through the model's
one prediction path (``predict_proba``), with probabilities over the classes seen so far.

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mepo_stream.alignment import AlignMode
from mepo_stream.learner import OnlineLearner
from mepo_stream.methods.base import ContinualMethod


@dataclass(frozen=True)
class Snapshot:
    model: ContinualMethod | None  # None only before a replica's first snapshot
    exposed: tuple[int, ...]
    version: int
    samples_seen: int
    align_mode: AlignMode = "running"

    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities [B, n_seen] over the seen classes (in ``exposed`` order) for uint8 images."""
        if not self.exposed or self.model is None:
            raise LookupError("the model has not learned any class yet")
        return self.model.predict_proba(images, len(self.exposed), self.align_mode)

    def top_k(self, probs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
        """Top-k (original label, probability) pairs per row of ``probabilities``' output."""
        return top_k(probs, self.exposed, k)


def top_k(probs: torch.Tensor, exposed: Sequence[int], k: int) -> list[list[tuple[int, float]]]:
    """Top-k (original label, probability) pairs per row of probabilities [B, n_seen] in ``exposed`` order."""
    values, index = probs.topk(min(k, probs.shape[1]), dim=1)
    return [[(exposed[i], p) for i, p in zip(row_i.tolist(), row_p.tolist(), strict=True)]
            for row_i, row_p in zip(index, values, strict=True)]


def ranked(pairs: list[list[tuple[int, float]]], names: dict[int, str]) -> list[list[dict]]:
    """``top_k``'s pairs as the answers give them: ``{"label", "name", "probability"}`` per class, most probable
    first (``/v1/predict`` and the predictions topic alike)."""
    return [[{"label": label, "name": names.get(label, str(label)), "probability": round(p, 6)} for label, p in row]
            for row in pairs]


def take_snapshot(learner: OnlineLearner, version: int, align_mode: AlignMode = "running") -> Snapshot:
    """The learner's model as an eval-mode inference copy, with its label map."""
    return Snapshot(learner.method.inference_copy(), tuple(learner.exposed), version, learner.samples_seen,
                    align_mode)
