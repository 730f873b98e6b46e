"""The online learner: one pass over a stream of labelled mini-batches, rehearsal-free.

Per stream mini-batch (the reference's MISA loop):

1. register unseen labels; the head's output k means "the k-th class seen in the stream" (labels remapped by
   order of first appearance), and the head has every output from the start;
2. repeat ``online_iter`` times on the same images: augment (one random draw per batch), forward, masked
   cross-entropy (+ the method's auxiliary loss), Adam step.

Training logits are masked to the classes present in the mini-batch (MISA's non-parametric mask) or to the
classes seen so far; evaluation uses no mask (MISA/MePo) or the seen-class mask (MVP/FlyGCL), by ``eval_mask``.

3. with a statistics classifier (``classifier: ncm | slda``, ``mepo_stream.heads``): one no-grad forward of
   the un-augmented batch, then the classifier's statistics update. A host without trainable parameters
   besides the linear head (``frozen``, ``linear_probe``) then takes no gradient step at all.

``LearnerConfig()`` is the configuration that learns best in our measurements (docs/results.md, "Learning quality");
``PAPER_RECIPE`` is the reference's MISA + MePo setting; ``PAPER_LDA_RECIPE`` trains as it does and predicts by LDA.

Example:
    >>> from mepo_stream.model import ModelConfig, create_model
    >>> from mepo_stream.backbone import BackboneConfig
    >>> cfg = LearnerConfig(autoaugment=None)
    >>> model = create_model(ModelConfig(backbone=BackboneConfig(name="test_vit", weights=None, img_size=32),
    ...                                  learner=cfg), n_classes=4)
    >>> learner = OnlineLearner(model, cfg)
    >>> _ = learner.observe(torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8), torch.tensor([5, 7] * 4))
    >>> learner.exposed, learner.predict(torch.zeros(2, 3, 32, 32, dtype=torch.uint8))["running"].shape
    ([5, 7], torch.Size([2]))
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mepo_stream.alignment import AlignMode
from mepo_stream.backbone import normalization
from mepo_stream.heads import ClassStatistics
from mepo_stream.label_statistics import LabelStatistics
from mepo_stream.methods.base import ContinualMethod, Encoded
from mepo_stream.novelty import (
    CALIBRATE_EVERY,
    DEFAULT_SCORE,
    LOGIT_SCORES,
    FrozenScore,
    NoveltyScore,
    NoveltyThreshold,
    freeze,
    novelty_scores,
    resolve,
)
from mepo_stream.precision import Precision, autocast
from mepo_stream.recipes import build, load
from mepo_stream.transforms import Transform, train_transform


@dataclass(frozen=True)
class LearnerConfig:
    """Online learning settings. Defaults: what learns best here; ``PAPER_RECIPE``: the reference's script."""

    classifier: Literal["slda", "ncm", "linear"] = "slda"
    """What predicts: streaming LDA (class means + shrunk shared covariance), nearest class mean, or the
    linear head trained by SGD (the reference). Statistics classifiers are order-invariant."""
    slda_shrinkage: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4)
    """Shrinkage candidates of the LDA covariance; the learner uses the one with the best test-then-train
    accuracy on the stream so far."""
    slda_prior: Literal["identity", "sigma_pre"] = "identity"
    """Shrinkage target of the LDA covariance: the (scaled) identity, or MePo's Sigma_pre (needs Meta Cov)."""
    standardize: bool = False
    """Standardise features by their running (cumulative) mean and std before the linear head."""
    train_encoder: bool = True
    """Train the host's own parameters (prompts, keys) online; false keeps them at their initialisation (e.g. ISA
    prompts from the bundle) so only the classifier learns, and a statistics classifier then needs no gradient."""
    precision: Precision = "auto"
    """Autocast precision of the backbone and prompts (alignment and statistics stay fp32/fp64): auto = bf16 where
    the hardware multiplies bf16 natively (a bf16 CUDA GPU, a CPU with AMX or AVX512-BF16), fp32 elsewhere. int8
    (never chosen by auto): a frozen host without prompts on the CPU with its backbone's Linear layers quantised
    to int8, the rest fp32; it pays on some CPUs and not on others (docs/performance.md)."""
    cast_frozen_backbone: bool = True
    """At bf16, also cast the backbone of a host without prompts (the default, ``frozen``) to bf16 weights when
    nothing trains it (not only autocast): no bf16 copy of its weights is made on every forward (docs/performance.md:
    faster on CPU, features within 1e-5 cosine)."""
    lr: float = 5e-3
    """Adam learning rate (constant)."""
    batch_size: int = 32
    """Stream mini-batch size (the reference: batchsize 64 // 2). Every eval-mode forward of the learning path runs
    on exactly this many images, a partial batch padded: an image's feature does not depend on its mini-batch."""
    invariant_predictions: bool = False
    """Predictions (HTTP, gRPC, replicas) also run in that fixed shape: an answer never depends on what else was
    asked at the same moment, and equals the learning path's to the bit. The cost is a full mini-batch forward for
    every request batch, heavy on a CPU and small on a GPU (docs/performance.md, "Batch-invariant features")."""
    online_iter: int = 3
    """Gradient steps taken on each stream mini-batch."""
    train_mask: Literal["batch", "seen", "none"] = "batch"
    """Training logit mask: classes present in the mini-batch (MISA), classes seen so far, or none."""
    eval_mask: Literal["none", "seen"] = "seen"
    """Evaluation logit mask: none (MISA/MePo) or seen classes only (MVP/FlyGCL)."""
    samples_per_slot: int = 5000
    """Task-free prompt slot schedule: slot = samples_seen // samples_per_slot (the reference uses task ids)."""
    autoaugment: str | None = "imagenet"
    """AutoAugment policy of the training augmentation (imagenet, cifar10, svhn) or null for none."""


PAPER_RECIPE = build(LearnerConfig, load("paper"))
"""The reference's MISA + MePo setting (``--learner mepo_stream/recipes/paper.yaml``): SGD-trained linear head,
batch-present mask, no mask at evaluation."""

PAPER_LDA_RECIPE = build(LearnerConfig, load("paper_lda"))
"""``PAPER_RECIPE``'s training step (MISA's prompts, keys and linear head trained by the same aligned Adam updates)
at a smaller step, predicting by streaming LDA on the aligned feature over the classes seen: it does not collapse
where ``PAPER_RECIPE`` does (docs/fidelity.md, "What keeps the recipe from collapsing"). The smaller step keeps the
LDA's statistics of earlier prompts' features from going stale (``--learner mepo_stream/recipes/paper_lda.yaml``)."""


@contextmanager
def pausing(backbone: nn.Module, between: Callable[[], None]) -> Iterator[None]:
    """Within it, ``between()`` runs after each of ``backbone``'s transformer blocks (timm's ``blocks``): a long
    forward pauses there for other work, without cutting its batch (whose shape fixes its features' bits)."""
    handles = [block.register_forward_hook(lambda *_: between()) for block in getattr(backbone, "blocks", ())]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class OnlineLearner:
    """The training loop around a complete model (``mepo_stream.model.create_model``): the label map, the
    optimizer, the training augmentation and the test-then-train update, and nothing else."""

    def __init__(self, model: ContinualMethod, cfg: LearnerConfig):
        self.cfg, self.method = cfg, model
        self.n_classes, self.device, self.dtype = model.n_classes, model.device, model.dtype
        self.train_tf: Transform = train_transform(model.input_size, *normalization(model.backbone), cfg.autoaugment)
        self.optimizer = torch.optim.Adam(model.param_groups(cfg.lr), lr=cfg.lr,
                                          fused=True if self.device.type == "cuda" else None)
        self.encoder_trains = any(p.requires_grad for n, p in model.named_parameters() if not n.startswith("head."))
        self.trains_by_gradient = cfg.classifier == "linear" or self.encoder_trains
        self.exposed: list[int] = []  # original label of head output k
        self._index: dict[int, int] = {}
        self.samples_seen = 0
        self.novelty_score: NoveltyScore = DEFAULT_SCORE
        """The score ``novelty`` answers with (``mepo_stream.novelty``; a learner without the streaming LDA answers
        its logits-only fallback)."""
        self.novelty_threshold: NoveltyThreshold | None = None
        """Set it to calibrate a threshold online: ``test_then_train`` and ``observe_features`` then score each
        batch just before learning it and feed it (its state rides in ``state_dict``). None: nothing changes."""
        self._frozen: FrozenScore | None = None  # the calibration's score (``observe_novelty``) ...
        self._scored = 0  # ... and the samples it scored
        self._waiting: list[tuple[NoveltyThreshold, torch.Tensor, list[bool], torch.Tensor | int]] = []

    @property
    def not_mergeable(self) -> str | None:
        """Why the sums of this learner on parts of a stream cannot be added into its model on the whole stream
        (``mepo_stream.label_statistics``); None when they can: a statistics classifier on features nothing
        trains and no running (EMA) alignment, whose state depends on the order of the stream."""
        if self.trains_by_gradient:
            return ("it trains by gradient (the linear head or the host's prompts), so its model depends on the "
                    "order of the stream; use --learner.classifier slda or ncm with --method frozen")
        if self.method.classifier is None:
            return "it has no statistics classifier"
        if self.method.alignment is not None:
            return ("its Meta Cov alignment keeps running (EMA) statistics that depend on the order of the stream; "
                    "use a bundle without Sigma_pre")
        return None

    @property
    def _classifier(self) -> ClassStatistics:
        """The statistics classifier, on the paths that only a learner with one takes."""
        classifier = self.method.classifier
        assert isinstance(classifier, ClassStatistics), "a statistics classifier (NCM or streaming LDA) is attached"
        return classifier

    def statistics_step(self, images: torch.Tensor, labels: torch.Tensor, encoded: Encoded | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Test-then-train of a mergeable learner without folding the batch into its model: the prediction of
        each image (original labels [B]; None before any class is known), the classifier's features [B, D] and
        each shrinkage candidate's prequential hits [K], for a caller that keeps the sums and loads their total
        back (``load_statistics``). Why: the sums are kept per partition of a topic and added up. ``encoded``: the
        batch's encoding, where the caller keeps its features (``forget_features`` takes them back out)."""
        encoded = self.encode(images) if encoded is None else encoded
        pred = self.to_labels(self.logits(encoded)["running"].argmax(1)) if self.exposed else None
        self._register(labels)
        h = self.method.aligned(encoded, "running")  # [B, D]
        target = self._targets(labels, h.device)  # [B]
        return pred, h, self._classifier.prequential_hits(h, target)

    def load_statistics(self, stats: LabelStatistics) -> None:
        """Make the classifier the model of ``stats`` (label-indexed sums); labels new to this learner get head
        outputs in label order."""
        self._register(torch.nonzero(stats.counts).flatten())
        counts, sums = stats.head_order(self.exposed)
        self._classifier.assign(counts, sums, stats.second, stats.hits)
        self.samples_seen = stats.samples

    def statistics(self) -> LabelStatistics:
        """The classifier's sums, label-indexed (the inverse of ``load_statistics``)."""
        c = self._classifier
        return LabelStatistics.from_head_order(c.counts, c.sums, c.second, getattr(c, "hits", torch.zeros(0)),
                                               self.exposed)

    def _register(self, labels: torch.Tensor) -> None:
        for y in labels.tolist():
            if y not in self._index:
                if len(self.exposed) >= self.n_classes:
                    raise ValueError(f"label {y} would be class #{len(self.exposed) + 1}, but the head has "
                                     f"{self.n_classes} outputs")
                self._index[y] = len(self.exposed)
                self.exposed.append(y)

    def _targets(self, labels: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """Head outputs [B] of registered original labels [B]."""
        return torch.tensor([self._index[y] for y in labels.tolist()], device=device or self.device)

    def _as_encoded(self, features: torch.Tensor) -> Encoded:
        """Eval-mode features [B, D] kept since their images were encoded, as the encoding they came from."""
        return Encoded(features.to(self.device, torch.float32), torch.zeros((), device=self.device))

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

    def observe(self, images: torch.Tensor, labels: torch.Tensor, encoded: Encoded | None = None) -> float:
        """Learn one stream mini-batch: uint8 images [B, 3, H, W], original labels [B]; returns the mean loss
        of the gradient steps (0 when the learner takes none). ``encoded``: the batch's prediction encoding, when
        the caller already has it and no gradient step will change the model before the statistics update."""
        self._register(labels)
        target = self._targets(labels)
        images = images.to(self.device, non_blocking=True)
        loss = self._gradient_steps(images, target) if self.trains_by_gradient else 0.0
        if self.method.classifier is not None:
            self._update_statistics(target, self.encode(images) if encoded is None else encoded)
        self.samples_seen += len(labels)
        return loss

    @property
    def learns_from_features(self) -> bool:
        """It takes no gradient step, so a batch's eval-mode features are all it needs to learn: labels that come
        later can be joined to the features kept since the images came (``observe_features``)."""
        return not self.trains_by_gradient and self.method.classifier is not None

    def observe_features(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Learn a mini-batch from its images' eval-mode features [B, D] (``encode(images).feature``, kept while
        the labels [B] were on their way): the same model as ``observe`` on the images, for a learner that
        ``learns_from_features``."""
        if not self.learns_from_features:
            raise ValueError("this learner trains by gradient: it needs the images, not their features")
        if self.novelty_threshold is not None:
            self.observe_novelty(self._as_encoded(features), labels)
        self._register(labels)
        self._update_statistics(self._targets(labels), self._as_encoded(features))
        self.samples_seen += len(labels)

    @property
    def not_correctable(self) -> str | None:
        """Why a learned sample cannot be taken out of this model exactly (None: it can, by ``forget_features``).
        The same condition as merging parts: a model that is a sum of its samples' features forgets one by
        subtracting it; one trained by gradient, or with running (EMA) statistics, has no such inverse."""
        return self.not_mergeable

    def forget_features(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Take samples learned with ``observe_features`` (the same features [B, D], original labels [B]) out of the
        model: afterwards it is the model of a learner that never saw them. A class left with no sample is no longer
        predicted. ``samples_seen`` keeps counting what was learned (the evaluation schedule follows it)."""
        h, target = self._correctable(features, labels)
        self._classifier.remove(h, target)

    def relabel_features(self, features: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
        """Samples learned with labels ``old`` [B] (from these features [B, D]) were labelled wrong: the model of a
        learner that learned them with ``new`` [B] (their prequential scores stay as they were)."""
        h, before = self._correctable(features, old)
        self._register(new)
        self._classifier.move(h, before, self._targets(new, h.device))

    def _correctable(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The classifier's inputs [B, D] and head-order labels [B] of samples this learner learned."""
        h = self.classifier_inputs(features)
        if unknown := sorted(set(labels.tolist()) - set(self._index)):
            raise ValueError(f"labels {unknown} were never learned")
        return h, self._targets(labels)

    def classifier_inputs(self, features: torch.Tensor) -> torch.Tensor:
        """What a statistics step added for kept eval-mode features [B, D]: the classifier's inputs [B, D] (the
        features aligned), for a caller that keeps the sums (``statistics_step``) and takes samples back out."""
        if (why := self.not_correctable) is not None:
            raise ValueError(f"this learner cannot forget a sample exactly: {why}")
        return self.method.aligned(self._as_encoded(features), "running")

    def test_then_train(self, images: torch.Tensor, labels: torch.Tensor, align_mode: AlignMode = "running",
                        encoded: Encoded | None = None) -> torch.Tensor | None:
        """Predict the batch's original labels [B] (None before any class is known), then learn it. ``encoded``:
        the batch's encoding, where the caller keeps its features (a learner that takes no gradient step).

        Why one method: a learner that takes no gradient step (a frozen host with a statistics classifier) feeds
        the prediction's encoding to the statistics update, so the batch costs one backbone forward, not two.
        """
        if encoded is not None and self.trains_by_gradient:
            raise ValueError("a learner that trains by gradient encodes its batch after its steps, not before")
        if not self.exposed:
            self.observe(images, labels, encoded)
            return None
        encoded = self.encode(images) if encoded is None else encoded
        logits = self.logits(encoded, (align_mode,))[align_mode]
        if self.novelty_threshold is not None:
            self.observe_novelty(encoded, labels)
        self.observe(images, labels, None if self.trains_by_gradient else encoded)
        return self.to_labels(logits.argmax(1))

    def _gradient_steps(self, images: torch.Tensor, target: torch.Tensor) -> float:
        mask = self._train_mask(target)
        self.method.train()
        losses = []
        for _ in range(self.cfg.online_iter):
            with autocast(self.device, self.dtype):
                logits, aux = self.method(self.train_tf(images), slot=self.slot)  # [B, C]
            if mask is not None:
                logits = logits + mask
            loss = F.cross_entropy(logits.float(), target) + aux.float()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            losses.append(loss.detach())
        return torch.stack(losses).mean().item()

    @torch.no_grad()
    def _update_statistics(self, target: torch.Tensor, encoded: Encoded) -> None:
        """Fold the un-augmented batch's encoding (as predictions see it) into the classifier."""
        alignment = self.method.alignment
        if alignment is not None and not self.trains_by_gradient:  # nothing else feeds its running statistics
            alignment.update_running(encoded.feature)
        self._classifier.update(self.method.aligned(encoded, "running"), target)

    @torch.no_grad()
    def novelty(self, encoded: Encoded, score: NoveltyScore | None = None, align_mode: AlignMode = "running"
                ) -> torch.Tensor:
        """Novelty scores [B] (float32, higher = more likely a class not learned yet; +inf before any class is
        learned) of an encoding: ``score``, or ``novelty_score`` (``mepo_stream.novelty``). With the streaming LDA
        it costs one quadratic form more than the logits (its factorisations are cached until the next update), and
        a distance score needs no logits."""
        chosen = resolve(self.method.classifier, self.novelty_score if score is None else score)
        if not self.exposed:
            return torch.full((len(encoded.feature),), float("inf"))
        logits = None
        if chosen in LOGIT_SCORES:
            logits = self.logits(encoded, (align_mode,))[align_mode][:, : len(self.exposed)]  # [B, C seen]
        return novelty_scores(self.method.classifier, self.method.aligned(encoded, align_mode), logits, chosen).cpu()

    @torch.no_grad()
    def observe_novelty(self, encoded: Encoded, labels: torch.Tensor, positions: torch.Tensor | int | None = None,
                        threshold: NoveltyThreshold | None = None) -> None:
        """Score a stream batch just before it is learned (original labels [B]) and feed ``threshold`` (default
        ``novelty_threshold``; none: nothing to do) with the scores of the images whose class was learned already.
        ``positions``: each image's stream position [B] (a group's learners pass their records' sample indices, so
        that their thresholds add up to one learner's); default ``samples_seen`` on. ``test_then_train`` and
        ``observe_features`` call it themselves when a threshold is set; ``statistics_step`` (a group) does not:
        call it first, with the partition's threshold.

        A distance score is frozen for ``CALIBRATE_EVERY`` samples (``mepo_stream.novelty.FrozenScore``: an image
        counts as of a learned class if the frozen model had learned it), and the batches it scores wait until it
        is frozen anew, or the state is read (``flush_novelty``), to be scored together: a mini-batch then pays an
        append instead of a chain of small operators."""
        threshold = self.novelty_threshold if threshold is None else threshold
        if threshold is None:
            return
        positions = self.samples_seen if positions is None else positions
        if self._frozen is None or self._scored >= CALIBRATE_EVERY:
            self.flush_novelty()
            self._frozen, self._scored = freeze(self.method.classifier, self.novelty_score), 0
        self._scored += len(labels)
        if self._frozen is None:  # a logit score, or nothing learned yet: scored now
            known = [int(y) in self._index for y in labels.tolist()]
            threshold.observe(self.novelty(encoded), torch.tensor(known, dtype=torch.bool), positions)
            threshold.settle()
            return
        known = [self._index.get(int(y), -1) in self._frozen.learned for y in labels.tolist()]
        self._waiting.append((threshold, self.method.aligned(encoded, "running"), known, positions))

    @torch.no_grad()
    def flush_novelty(self) -> None:
        """Score the batches waiting for the calibration (``observe_novelty``) and feed their thresholds: before the
        thresholds' states are saved."""
        waiting, self._waiting = self._waiting, []
        if not waiting:
            return
        assert self._frozen is not None, "batches wait only for a frozen score"
        scores = self._frozen(torch.cat([h for _, h, _, _ in waiting])).cpu().split([len(k) for _, _, k, _ in waiting])
        for (threshold, _, known, positions), batch in zip(waiting, scores, strict=True):
            threshold.observe(batch, torch.tensor(known, dtype=torch.bool), positions)
        for threshold in {id(t): t for t, _, _, _ in waiting}.values():
            threshold.settle()

    def state_dict(self) -> dict:
        """Everything the learner changes: trainable tensors (the backbone only if it trains), optimizer, labels
        (and the novelty threshold's state when one is set)."""
        state = {"method": self.method.trainable_state_dict(), "optimizer": self.optimizer.state_dict(),
                 "exposed": list(self.exposed), "samples_seen": self.samples_seen}
        if self.novelty_threshold is not None:
            self.flush_novelty()
            state["novelty_threshold"] = self.novelty_threshold.state_dict()
        return state

    @staticmethod
    def statistics_in(state: dict) -> LabelStatistics:
        """The classifier's sums, label-indexed, that a statistics learner's ``state_dict`` holds: ``statistics``
        of a checkpoint, read without building its learner."""
        method = state["method"]
        return LabelStatistics.from_head_order(
            method["classifier.counts"], method["classifier.sums"], method["classifier.second"],
            method.get("classifier.hits", torch.zeros(0)), [int(y) for y in state["exposed"]])

    def load_state_dict(self, state: dict) -> None:
        self.method.load_trainable_state_dict(state["method"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # never alias another learner's moments
        self.exposed = [int(y) for y in state["exposed"]]
        self._index = {y: i for i, y in enumerate(self.exposed)}
        self.samples_seen = int(state["samples_seen"])
        self._frozen, self._waiting = None, []  # another model: frozen anew
        if self.novelty_threshold is not None and "novelty_threshold" in state:
            self.novelty_threshold.load_state_dict(state["novelty_threshold"])

    def to_labels(self, index: torch.Tensor) -> torch.Tensor:
        """Head outputs -> original labels (-1 for outputs no class has been mapped to yet)."""
        table = torch.full((self.n_classes,), -1, dtype=torch.long)
        table[: len(self.exposed)] = torch.tensor(self.exposed, dtype=torch.long)
        return table[index.cpu()]

    def encode(self, images: torch.Tensor, between: Callable[[], None] | None = None) -> Encoded:
        """The eval-mode encoding of uint8 images [B, 3, H, W], as predictions see them. ``between``: called after
        each transformer block of the forward (a service answers waiting predictions there); the forward, so the
        encoding, is the same."""
        if between is None:
            return self.method.encode_images(images)
        with pausing(self.method.backbone, between):
            return self.method.encode_images(images)

    def logits(self, encoded: Encoded, align_modes: tuple[AlignMode, ...] = ("running",)
               ) -> dict[AlignMode, torch.Tensor]:
        """Eval-mode logits [B, C] (head order) of an encoding, per alignment mode."""
        return {mode: self.method.predict_logits(encoded, len(self.exposed), mode) for mode in align_modes}

    def predict_logits(self, images: torch.Tensor, align_modes: tuple[AlignMode, ...] = ("running",)
                       ) -> dict[AlignMode, torch.Tensor]:
        """Eval-mode logits [B, C] (head order) for uint8 images, per alignment mode, sharing one encode."""
        return self.logits(self.encode(images), align_modes)

    def predict(self, images: torch.Tensor, align_modes: tuple[AlignMode, ...] = ("running",)
                ) -> dict[AlignMode, torch.Tensor]:
        """Predicted original labels [B] per alignment mode."""
        return {m: self.to_labels(lg.argmax(1)) for m, lg in self.predict_logits(images, align_modes).items()}
