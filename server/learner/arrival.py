"""Images predicted as they arrive, for labels that come later (``--kafka.labels_topic``).

One forward per poll predicts every image (scored when its label is joined) and gives the feature the join keeps,
so joining costs no second pass; a learner that trains through the backbone keeps the image instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from mepo_stream.alignment import AlignMode
from mepo_stream.label_join import Refused
from mepo_stream.learner import OnlineLearner
from server.snapshot import ranked
from server.snapshot import top_k as best


@dataclass(frozen=True)
class Arrival:
    """One image as it arrived: what the learner keeps of it and what it predicted."""

    item: torch.Tensor  # what the join keeps: the feature [D], or (a learner that needs it) the uint8 image [3, S, S]
    prediction: int | None  # top-1 label (None before any class is known)
    top_k: list[dict]  # ``[{"label", "name", "probability"}]``, most probable first (as ``/v1/predict`` answers)
    novelty: float | None = None  # its novelty score (None before any class is known)
    novel: bool = False  # above the learner's calibrated threshold: an image worth a label first


@torch.no_grad()
def arrive(learner: OnlineLearner, images: torch.Tensor, top_k: int, class_names: dict[int, str],
           align_mode: AlignMode = "running") -> list[Arrival]:
    """Predict uint8 images [B, 3, S, S]; keep each one's feature (cloned, not the batch's storage) or image."""
    encoded = learner.encode(images)
    n_seen = len(learner.exposed)
    keep = encoded.feature.cpu() if learner.learns_from_features else images.cpu()  # [B, D] or [B, 3, S, S]
    if not n_seen:
        return [Arrival(keep[i].clone(), None, []) for i in range(len(images))]
    probs = learner.logits(encoded, (align_mode,))[align_mode][:, :n_seen].softmax(1).cpu()  # [B, n_seen]
    rows = ranked(best(probs, learner.exposed, top_k), class_names)
    novelty = learner.novelty(encoded, align_mode=align_mode)  # [B]
    threshold = math.inf if learner.novelty_threshold is None else learner.novelty_threshold.threshold
    return [Arrival(keep[i].clone(), row[0]["label"], row, float(novelty[i]), bool(novelty[i] > threshold))
            for i, row in enumerate(rows)]


@dataclass(frozen=True)
class Retraction:
    """A tombstone for the predictions topic: the image with this id was deleted, and so is its prediction."""

    id: str

    def value(self) -> None:
        return None


@dataclass(frozen=True)
class Prediction:
    """A prediction record for the predictions topic: keyed by the image's id, a JSON value."""

    id: str
    top_k: list[dict]
    model_version: int
    time: float
    novelty: float | None = None
    novel: bool = False  # it also goes to ``--kafka.novel_topic``, where a labelling tool asks for its label first

    def value(self) -> bytes:
        return json.dumps({"id": self.id, "top_k": self.top_k, "model_version": self.model_version,
                           "time": self.time, "novelty": self.novelty, "novel": self.novel}).encode()


class KeptLabel(NamedTuple):
    """A label record the join kept and refused later (``unknown_id`` past its TTL), rebuilt for its dead letter."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def kept_label(refused: Refused) -> KeptLabel:
    topic, partition, offset = refused.source or ("", -1, -1)
    return KeptLabel(topic, partition, offset, refused.id.encode(), b"", [("id", refused.id.encode())])
