"""Immutable model snapshots for serving while the learner keeps training.

A snapshot is a frozen copy of everything the learner trains (prompts, keys, head, alignment statistics;
the backbone too for methods that fine-tune it, otherwise the frozen backbone is shared), plus the label
map. The learner publishes a new snapshot after each update by swapping one reference, so a request always
sees one consistent model, never a half-updated one. Predictions use the ``running`` alignment statistics by
default (non-transductive: an image's prediction does not depend on the other images in its request), through
the learner's own prediction function (``masked_logits``), with probabilities over the classes seen so far.

Example:
    >>> from mepo_stream.model import build_method
    >>> from mepo_stream.backbone import BackboneConfig
    >>> from mepo_stream.learner import LearnerConfig
    >>> method = build_method("frozen", 3, BackboneConfig(name="test_vit", weights=None, img_size=32))
    >>> learner = OnlineLearner(method, 3, LearnerConfig(autoaugment=None))
    >>> _ = learner.observe(torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8), torch.tensor([2, 0, 2, 0]))
    >>> snap = take_snapshot(learner, version=1)
    >>> sorted(label for label, _ in snap.top_k(snap.probabilities(torch.zeros(1, 3, 32, 32, dtype=torch.uint8)), 3)[0])
    [0, 2]
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from mepo_stream.alignment import AlignMode
from mepo_stream.heads import StreamingLDA
from mepo_stream.learner import OnlineLearner, encode_for_prediction, masked_logits
from mepo_stream.methods.base import ContinualMethod
from mepo_stream.transforms import Transform


@dataclass(frozen=True)
class Snapshot:
    method: ContinualMethod
    exposed: tuple[int, ...]
    version: int
    samples_seen: int
    transform: Transform
    device: torch.device
    dtype: torch.dtype = torch.float32
    align_mode: AlignMode = "running"

    @torch.inference_mode()
    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """Class probabilities [B, n_seen] over the seen classes (in ``exposed`` order) for uint8 images."""
        if not self.exposed:
            raise LookupError("the model has not learned any class yet")
        n_seen = len(self.exposed)
        encoded = encode_for_prediction(self.method, self.transform, images, self.device, self.dtype)
        logits = masked_logits(self.method, encoded, self.align_mode, n_seen, "seen")[:, :n_seen]  # [B, n_seen]
        return logits.softmax(dim=1).cpu()

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The method's tensors that learning changes: all of its state but a frozen backbone's. With the same
        backbone, they are what another process needs to answer as this snapshot does (``server.replica``)."""
        keep_backbone = self.method.trains_backbone
        return {k: v for k, v in self.method.state_dict().items() if keep_backbone or not k.startswith("backbone.")}

    def top_k(self, probs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
        """Top-k (original label, probability) pairs per row of ``probabilities``' output."""
        values, index = probs.topk(min(k, probs.shape[1]), dim=1)
        return [[(self.exposed[i], p) for i, p in zip(row_i.tolist(), row_p.tolist(), strict=True)]
                for row_i, row_p in zip(index, values, strict=True)]


def take_snapshot(learner: OnlineLearner, version: int, align_mode: AlignMode = "running") -> Snapshot:
    """Copy the learner's trainable state (sharing its backbone when that is frozen) into an eval-mode snapshot."""
    method = learner.method
    if isinstance(method.classifier, StreamingLDA) and method.classifier.seen:
        method.classifier.solve(method.classifier.chosen)  # once, not per request; the copy and the learner's
        # prequential scoring of the next batch share it
    memo = {} if method.trains_backbone else {id(method.backbone): method.backbone}
    frozen = copy.deepcopy(method, memo=memo).eval()
    if frozen.alignment is not None and int(frozen.alignment.running_batches) > 0:
        frozen.alignment.running_factor()  # factorise once here, not on every request
    return Snapshot(frozen, tuple(learner.exposed), version, learner.samples_seen, learner.test_tf, learner.device,
                    learner.dtype, align_mode)
