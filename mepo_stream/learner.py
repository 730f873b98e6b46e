"""The online learner: one pass over a stream of labelled mini-batches, rehearsal-free.

Per stream mini-batch (the reference's MISA loop):

1. register unseen labels; the head's output k means "the k-th class seen in the stream" (labels remapped by
   order of first appearance), and the head has every output from the start;
2. repeat ``online_iter`` times on the same images: augment (one random draw per batch), forward, masked
   cross-entropy (+ the method's auxiliary loss), Adam step.

Training logits are masked to the classes present in the mini-batch (MISA's non-parametric mask); evaluation
uses no mask (MISA/MePo) or the seen-class mask (MVP/FlyGCL), by ``eval_mask``.

Example:
    >>> learner = OnlineLearner(method, n_classes=10, cfg=LearnerConfig())  # doctest: +SKIP
    >>> loss = learner.observe(images_uint8, labels)                        # doctest: +SKIP
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from mepo_stream.alignment import AlignMode
from mepo_stream.backbone import normalization
from mepo_stream.methods.base import ContinualMethod
from mepo_stream.transforms import Transform, test_transform, train_transform


@dataclass(frozen=True)
class LearnerConfig:
    """Online learning settings (defaults: the reference's MISA+MePo script)."""

    lr: float = 5e-3
    """Adam learning rate (constant)."""
    batch_size: int = 32
    """Stream mini-batch size (the reference: batchsize 64 // 2)."""
    online_iter: int = 3
    """Gradient steps taken on each stream mini-batch."""
    train_mask: Literal["batch", "seen", "none"] = "batch"
    """Training logit mask: classes present in the mini-batch (MISA), classes seen so far, or none."""
    eval_mask: Literal["none", "seen"] = "none"
    """Evaluation logit mask: none (MISA/MePo) or seen classes only (MVP/FlyGCL)."""
    samples_per_slot: int = 5000
    """Task-free prompt slot schedule: slot = samples_seen // samples_per_slot (the reference uses task ids)."""
    autoaugment: str | None = "imagenet"
    """AutoAugment policy of the training augmentation (imagenet, cifar10, svhn) or null for none."""


class OnlineLearner:
    """Wraps a host method with the label map, optimizer, transforms and the online update."""

    def __init__(self, method: ContinualMethod, n_classes: int, cfg: LearnerConfig, device: torch.device | None = None):
        self.cfg, self.n_classes = cfg, n_classes
        self.device = device or torch.device("cpu")
        self.method = method.to(self.device)
        img_size = method.backbone.patch_embed.img_size[0]
        mean, std = normalization(method.backbone)
        self.train_tf: Transform = train_transform(img_size, mean, std, cfg.autoaugment)
        self.test_tf: Transform = test_transform(img_size, mean, std)
        self.optimizer = torch.optim.Adam(method.param_groups(cfg.lr), lr=cfg.lr)
        self.exposed: list[int] = []  # original label of head output k
        self._index: dict[int, int] = {}
        self.samples_seen = 0

    def _register(self, labels: torch.Tensor) -> None:
        for y in labels.tolist():
            if y not in self._index:
                if len(self.exposed) >= self.n_classes:
                    raise ValueError(f"label {y} would be class #{len(self.exposed) + 1}, but the head has "
                                     f"{self.n_classes} outputs")
                self._index[y] = len(self.exposed)
                self.exposed.append(y)

    def _train_mask(self, target: torch.Tensor) -> torch.Tensor | None:
        if self.cfg.train_mask == "none":
            return None
        mask = torch.full((self.n_classes,), float("-inf"), device=self.device)
        if self.cfg.train_mask == "batch":
            mask[target.unique()] = 0.0
        else:
            mask[: len(self.exposed)] = 0.0
        return mask

    @property
    def slot(self) -> int:
        return self.samples_seen // self.cfg.samples_per_slot

    def observe(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """Learn one stream mini-batch: uint8 images [B, 3, H, W], original labels [B]; returns the mean loss."""
        self._register(labels)
        target = torch.tensor([self._index[y] for y in labels.tolist()], device=self.device)  # [B]
        images = images.to(self.device)
        mask = self._train_mask(target)
        self.method.train()
        losses = []
        for _ in range(self.cfg.online_iter):
            logits, aux = self.method(self.train_tf(images), slot=self.slot)  # [B, C]
            if mask is not None:
                logits = logits + mask
            loss = F.cross_entropy(logits, target) + aux
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            losses.append(loss.item())
        self.samples_seen += len(labels)
        return sum(losses) / len(losses)

    def state_dict(self) -> dict:
        """Everything the learner changes: trainable tensors (the backbone only if it trains), optimizer, labels."""
        keep_backbone = self.method.trains_backbone
        trainable = {k: v for k, v in self.method.state_dict().items()
                     if keep_backbone or not k.startswith("backbone.")}
        return {"method": trainable, "optimizer": self.optimizer.state_dict(), "exposed": list(self.exposed),
                "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.method.load_state_dict(state["method"], strict=False)
        if unexpected or any(not k.startswith("backbone.") for k in missing):
            raise ValueError(f"learner state does not fit the method: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # never alias another learner's moments
        self.exposed = [int(y) for y in state["exposed"]]
        self._index = {y: i for i, y in enumerate(self.exposed)}
        self.samples_seen = int(state["samples_seen"])

    def _labels(self, index: torch.Tensor) -> torch.Tensor:
        """Head outputs -> original labels (-1 for outputs no class has been mapped to yet)."""
        table = torch.full((self.n_classes,), -1, dtype=torch.long)
        table[: len(self.exposed)] = torch.tensor(self.exposed, dtype=torch.long)
        return table[index.cpu()]

    @torch.no_grad()
    def predict_logits(self, images: torch.Tensor, align_modes: tuple[AlignMode, ...] = ("running",)
                       ) -> dict[AlignMode, torch.Tensor]:
        """Eval-mode logits [B, C] (head order) for uint8 images, per alignment mode, sharing one encode."""
        self.method.eval()
        encoded = self.method.encode(self.test_tf(images.to(self.device)))
        out = {}
        for mode in align_modes:
            logits = self.method.logits(encoded, mode)
            if self.cfg.eval_mask == "seen":
                logits[:, len(self.exposed):] = float("-inf")
            out[mode] = logits
        return out

    def predict(self, images: torch.Tensor, align_modes: tuple[AlignMode, ...] = ("running",)
                ) -> dict[AlignMode, torch.Tensor]:
        """Predicted original labels [B] per alignment mode."""
        return {m: self._labels(lg.argmax(1)) for m, lg in self.predict_logits(images, align_modes).items()}
