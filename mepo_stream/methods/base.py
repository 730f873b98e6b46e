"""What every host method is: a feature encoder, a linear head, optional Meta Cov, its ``Readout`` (statistics
classifier, standardisation, input transform, precision, logit mask), and the one prediction path.

Example (a finished model predicts over the classes seen so far; an empty statistics classifier is uniform):
    >>> from mepo_stream.model import ModelConfig, create_model
    >>> from mepo_stream.backbone import BackboneConfig
    >>> model = create_model(ModelConfig(backbone=BackboneConfig(name="test_vit", weights=None, img_size=32)), 5)
    >>> model.predict_proba(torch.zeros(2, 3, 32, 32, dtype=torch.uint8), n_seen=3)
    tensor([[0.3333, 0.3333, 0.3333],
            [0.3333, 0.3333, 0.3333]])
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mepo_stream.alignment import AlignMode, FeatureAlignment
from mepo_stream.backbone import input_size
from mepo_stream.errors import StateRefused
from mepo_stream.fixed_shape import in_blocks, pad_rows
from mepo_stream.novelty import NoveltyScore, novelty_scores, prepare
from mepo_stream.precision import autocast
from mepo_stream.transforms import Transform


@dataclass
class Encoded:
    """What a method's encoder hands to the head."""

    feature: torch.Tensor
    """[B, D] feature before alignment (CLS after the final norm for every method here)."""
    aux_loss: torch.Tensor
    """Scalar auxiliary training loss (e.g. prompt-key matching); 0 when the method has none."""
    logit_scale: torch.Tensor | None = None
    """Optional [B, C] multiplier of the logits (MVP's instance-wise mask)."""


@dataclass(frozen=True)
class Readout:
    """How a model takes its input and reads out its feature, fixed when it is built
    (``mepo_stream.model.readout``; a bare host, as in a unit test, keeps these defaults)."""

    classifier: nn.Module | None = None
    """The statistics classifier (NCM or streaming LDA); None: the linear head predicts."""
    standardize: nn.Module | None = None
    """Running standardisation of the linear head's input (None: off)."""
    transform: Transform | None = None
    """uint8 images -> the backbone's normalised input at its resolution."""
    dtype: torch.dtype = torch.float32
    """Autocast precision of the backbone and prompts."""
    eval_mask: Literal["none", "seen"] = "seen"
    """Prediction logit mask: none (MISA/MePo) or the seen classes only (MVP/FlyGCL)."""
    backbone_sha256: str | None = None
    """``mepo_stream.model.weights_sha256`` of the backbone as built, before any cast."""
    forward_batch: int | None = None
    """Every eval-mode forward of the learning path runs on exactly this many images (None: as many as given):
    ``encode_images``; every readout of features (``predict_logits``) on exactly this many rows."""
    invariant_predictions: bool = False
    """Predictions (``predict_proba``) encode their images in the learning path's fixed shape too."""


@runtime_checkable
class PromptHost(Protocol):
    """A host with prompts that ISA warms up and a bundle carries (MISA's): anything else has none to load."""

    def initial_prompts(self) -> dict[str, torch.Tensor]: ...

    def load_initial_prompts(self, tensors: dict[str, torch.Tensor]) -> None: ...


class ContinualMethod(nn.Module):
    """A host method: ``encode`` gives the pre-head feature, ``logits`` aligns it (Meta Cov) and classifies.

    Subclasses implement ``encode(x, slot)`` returning an ``Encoded``: the feature [B, D], the method's
    auxiliary loss, and optionally a logit multiplier. ``slot`` is the task-free prompt slot the learner picks
    from the number of samples seen; methods without slots ignore it.

    The classifier is the linear ``head`` (trained by gradient; optionally on running-standardised features)
    unless the learner attaches a statistics ``classifier`` (NCM or streaming LDA, ``mepo_stream.heads``);
    the linear head then only carries the gradient that trains the method's prompts.
    """

    def __init__(self, backbone: VisionTransformer, n_classes: int, alignment: FeatureAlignment | None = None,
                 readout: Readout = Readout()):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.num_features, n_classes)
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)
        self.alignment = alignment
        self.classifier, self.standardize = readout.classifier, readout.standardize
        self.transform, self.dtype, self.eval_mask = readout.transform, readout.dtype, readout.eval_mask
        self.backbone_sha256 = readout.backbone_sha256
        self.forward_batch, self.invariant_predictions = readout.forward_batch, readout.invariant_predictions

    @property
    def n_classes(self) -> int:
        return self.head.out_features

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def input_size(self) -> int:
        """The side of the square images the backbone takes: what a camera image is decoded and resized to."""
        return input_size(self.backbone)

    def encode(self, x: torch.Tensor, slot: int | None = None) -> Encoded:
        raise NotImplementedError

    def param_groups(self, lr: float) -> list[dict]:
        """Optimizer parameter groups: every trainable parameter at ``lr`` (methods override to differ)."""
        return [{"params": [p for p in self.parameters() if p.requires_grad], "lr": lr}]

    @property
    def trains_backbone(self) -> bool:
        return any(p.requires_grad for p in self.backbone.parameters())

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor that learning changes: the whole state but a frozen backbone's. With the same backbone,
        it is what a checkpoint, a snapshot or a replica needs to restore this method exactly."""
        keep_backbone = self.trains_backbone  # a key filter, not _without_frozen_backbone: reading never mutates
        return {k: v for k, v in self.state_dict().items() if keep_backbone or not k.startswith("backbone.")}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load what ``trainable_state_dict`` gave; raise ``StateRefused`` for tensors that do not fit this method
        (other names, or other shapes: another configuration). A frozen backbone is left out of the load, as it is
        out of the state: an int8 one (``--learner.precision int8``) could not load a partial state at all."""
        try:
            with self._without_frozen_backbone():
                missing, unexpected = self.load_state_dict(state, strict=False)
        except RuntimeError as e:  # a shape that differs
            raise StateRefused(f"the tensors do not fit this method: {e}") from e
        if unexpected or any(not k.startswith("backbone.") for k in missing):
            raise StateRefused(f"the tensors do not fit this method: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")

    @contextmanager
    def _without_frozen_backbone(self) -> Iterator[None]:
        """Within: the module tree without its backbone when nothing trains it (order kept). For loading only,
        which mutates the module anyway: a snapshot's state is read from other threads while it serves."""
        modules = self._modules
        if not self.trains_backbone:
            self._modules = {name: m for name, m in modules.items() if name != "backbone"}
        try:
            yield
        finally:
            self._modules = modules

    def aligned(self, encoded: Encoded, align_mode: AlignMode = "batch") -> torch.Tensor:
        """The classifier's input [B, D]: the feature, aligned first when Meta Cov is on."""
        h = encoded.feature
        return h if self.alignment is None else self.alignment(h, mode=align_mode)

    def linear_logits(self, h: torch.Tensor, encoded: Encoded) -> torch.Tensor:
        """The trained linear head's logits [B, C] for classifier inputs ``h`` [B, D]."""
        if self.standardize is not None:
            h = self.standardize(h)
        logits = self.head(h)  # [B, C]
        return logits if encoded.logit_scale is None else logits * encoded.logit_scale

    def logits(self, encoded: Encoded, align_mode: AlignMode = "batch") -> torch.Tensor:
        """Class logits [B, C]: the statistics classifier's when one is attached, else the linear head's."""
        h = self.aligned(encoded, align_mode)
        if self.classifier is not None and not self.training:
            return self.classifier(h)
        return self.linear_logits(h, encoded)

    def forward(self, x: torch.Tensor, slot: int | None = None, align_mode: AlignMode = "batch"
                ) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = self.encode(x, slot)
        return self.logits(encoded, align_mode), encoded.aux_loss

    # --- the one prediction path: the any-time evaluation, test-then-train, serving and replicas ---------------
    @torch.inference_mode()
    def encode_images(self, images: torch.Tensor, fixed_shape: bool = True) -> Encoded:
        """The eval-mode encoding of uint8 images [B, 3, H, W] (feature in fp32), as the learning path sees them.

        Why a fixed shape: the math libraries pick kernels by shape (oneDNN's bf16 attention on AMX packs its
        operands only for larger batches; cuBLAS picks tiles and split-K by the matrix sizes), and at bf16 another
        kernel rounds differently: an image's feature would then depend on how many images shared its forward.
        So every forward here runs on exactly ``forward_batch`` images: a batch is cut into
        such chunks and the last is padded with black images whose outputs are dropped. An image's feature is
        then the same bits in every mini-batch, which a group of learners needs to build one learner's model
        (docs/scale-out.md). ``fixed_shape=False`` runs the batch as it is (``predict_proba`` unless
        ``invariant_predictions``).

        Example (one image alone, or among others: the same feature):
            >>> from mepo_stream.model import ModelConfig, create_model
            >>> from mepo_stream.backbone import BackboneConfig
            >>> tiny = BackboneConfig(name="test_vit", weights=None, img_size=32)
            >>> model = create_model(ModelConfig(backbone=tiny), 5)
            >>> images = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
            >>> torch.equal(model.encode_images(images[2:3]).feature, model.encode_images(images).feature[2:3])
            True
        """
        if self.training:  # a snapshot's copy is in eval mode already: no walk over every module per request
            self.eval()
        size = self.forward_batch if fixed_shape else None
        if size is None or len(images) == 0:
            return self._encode(images)
        parts = [self._encode(pad_rows(chunk, size), len(chunk)) for chunk in images.split(size)]
        if len(parts) == 1:  # the learner's full mini-batch, or a partial one: nothing to join
            return parts[0]
        scales = [p.logit_scale for p in parts if p.logit_scale is not None]  # every part's, or none
        return Encoded(torch.cat([p.feature for p in parts]), parts[0].aux_loss, torch.cat(scales) if scales else None)

    def _encode(self, images: torch.Tensor, keep: int | None = None) -> Encoded:
        """One forward of uint8 images [B, 3, H, W]; the encoding of the first ``keep`` (all when None)."""
        assert self.transform is not None, "a model that encodes uint8 images normalises them (create_model)"
        with autocast(self.device, self.dtype):
            encoded = self.encode(self.transform(images.to(self.device, non_blocking=True)))
        scale = encoded.logit_scale
        return Encoded(encoded.feature[:keep].float(), encoded.aux_loss, None if scale is None else scale[:keep])

    @torch.inference_mode()
    def predict_logits(self, encoded: Encoded, n_seen: int, align_mode: AlignMode = "running") -> torch.Tensor:
        """Logits [B, C] in head order of an encoding; outputs past the ``n_seen`` classes seen so far are -inf
        under the seen mask.

        Why in blocks of ``forward_batch`` rows (``mepo_stream.fixed_shape``): a row's logits then do not depend
        on how many rows were read out with it, as its feature does not. The batch alignment is the exception:
        it aligns each row by its batch's moments, by design."""
        size = None if align_mode == "batch" else self.forward_batch
        logits = in_blocks(lambda h, scale: self.logits(Encoded(h, encoded.aux_loss, scale), align_mode),
                           size, encoded.feature, encoded.logit_scale).float()
        if self.eval_mask == "seen":
            logits[:, n_seen:] = float("-inf")
        return logits

    @torch.inference_mode()
    def predict_proba(self, images: torch.Tensor, n_seen: int, align_mode: AlignMode = "running") -> torch.Tensor:
        """Probabilities [B, n_seen] over the classes seen so far (head order) for uint8 images, on the CPU."""
        return self.answer(images, n_seen, align_mode)[0]

    @torch.inference_mode()
    def answer(self, images: torch.Tensor, n_seen: int, align_mode: AlignMode = "running",
               novelty: NoveltyScore | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``predict_proba``'s probabilities [B, n_seen], and each image's novelty score [B] (``novelty``, resolved
        for this classifier by ``mepo_stream.novelty``; None: not scored), from one forward, on the CPU."""
        encoded = self.encode_images(images, fixed_shape=self.invariant_predictions)
        logits = self.predict_logits(encoded, n_seen, align_mode)[:, :n_seen]  # [B, n_seen]
        if novelty is None or n_seen == 0:
            return logits.softmax(dim=1).cpu(), None
        h = self.aligned(encoded, align_mode)  # [B, D], the classifier's input
        return logits.softmax(dim=1).cpu(), novelty_scores(self.classifier, h, logits, novelty).cpu()

    def inference_copy(self) -> ContinualMethod:
        """An eval-mode copy of everything learning changes, sharing a frozen backbone, with the classifier
        solved and the alignment factorised once here rather than on every request."""
        solve = getattr(self.classifier, "solve_chosen", None)
        if solve is not None:
            solve()  # the original keeps it too: its next test-then-train step shares the solve
        prepare(self.classifier)  # and the novelty score's factorisations, cached beside the solve
        memo = {} if self.trains_backbone else {id(self.backbone): self.backbone}
        frozen = copy.deepcopy(self, memo=memo).eval()
        if frozen.alignment is not None and int(frozen.alignment.running_batches) > 0:
            frozen.alignment.running_transform()
        return frozen

    def train(self, mode: bool = True) -> ContinualMethod:
        super().train(mode)
        self.backbone.eval()  # the frozen backbone never runs in training mode (no dropout, drop-path)
        return self

