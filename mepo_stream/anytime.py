"""Any-time evaluation (the Si-Blurry protocol): when to evaluate, what to score, and the paper's metrics.

One implementation for ``mepo evaluate`` and the streaming server, so both report the same A_AUC for the
same stream. Definitions follow the reference trainer (MISA/MePo ``_trainer.py``):

* an *any-time* evaluation runs on the test samples of the classes seen so far once exactly ``next_eval``
  samples are learned (then ``next_eval += eval_period``), and records micro top-1 accuracy at that position;
  **A_AUC** is the plain mean of those accuracies. The reference evaluates after the mini-batch that would
  cross ``next_eval`` (``samples_seen + batch > next_eval``), up to a batch early; here a mini-batch is cut
  short at ``next_eval`` instead (``AnytimeEvaluation.room``), so the evaluation "at 500" sees 500 samples;
* an *end-of-task* evaluation runs after each (hidden) task; **A_last** is the last one, **A_avg** their mean;
* **F_last** is the mean, over classes whose best earlier end-of-task accuracy is > 0, of that best earlier
  accuracy minus the final accuracy;
* **novelty AUROC** (not in the paper; issue 67): at every any-time evaluation, how well the learner's novelty
  score (``mepo_stream.novelty``, ``OnlineLearner.novelty``) tells the test images of the classes not learned yet
  from those of the classes learned, over the test images of *every* class (the accuracy sees only the learned
  ones); undefined (None) while no class, or every class, is learned. ``novelty_auroc_mean`` averages the defined
  ones, as A_AUC averages the accuracies.

Example:
    >>> curve = AnytimeCurve()
    >>> curve.add_anytime(1000, 0.5); curve.add_anytime(2000, 0.7)
    >>> curve.add_end_of_task(0.6, {0: 1.0, 1: 0.2}); curve.add_end_of_task(0.4, {0: 0.5, 1: 0.3, 2: 0.4})
    >>> round(curve.a_auc, 3), curve.a_last, curve.a_avg, round(curve.f_last, 3)
    (0.6, 0.4, 0.5, 0.2)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from mepo_stream.alignment import AlignMode
from mepo_stream.data import ImageSet
from mepo_stream.learner import OnlineLearner
from mepo_stream.methods.base import Encoded
from mepo_stream.novelty import auroc


@dataclass(frozen=True)
class ProtocolConfig:
    """When and how the any-time accuracy is measured (``mepo evaluate`` and ``mepo serve`` alike)."""

    eval_period: int = 1000
    """Any-time evaluation every this many stream samples (0 = none; the service then loads no test split)."""
    eval_batch_size: int = 128
    """Test batch size (the reference's 2 x batchsize; it matters for batch-statistics alignment)."""


def per_class_accuracy(pred: torch.Tensor, target: torch.Tensor) -> dict[int, float]:
    """Accuracy of each class present in ``target`` (labels as given, e.g. original dataset ids)."""
    out = {}
    for c in target.unique().tolist():
        sel = target == c
        out[int(c)] = (pred[sel] == c).float().mean().item()
    return out


@dataclass
class AnytimeCurve:
    """Accumulates the evaluations of one run and derives the paper's metrics from them."""

    samples: list[int] = field(default_factory=list)
    """Stream position (scheduled samples seen) of each any-time evaluation."""
    accuracy: list[float] = field(default_factory=list)
    """Micro top-1 accuracy on the seen-class test subset at each any-time evaluation."""
    task_accuracy: list[float] = field(default_factory=list)
    """Accuracy after each task."""
    task_class_accuracy: list[dict[int, float]] = field(default_factory=list)
    """Per-class accuracy after each task, keyed by class id."""
    novelty_auroc: list[float | None] = field(default_factory=list)
    """AUROC of the novelty score, not-yet-learned against learned test images, at each any-time evaluation that
    measured it (``AnytimeEvaluation`` measures it at every one); None where it is undefined."""

    def add_anytime(self, samples_seen: int, acc: float, novelty_auroc: float | None = None,
                    measured: bool = False) -> None:
        """Record an any-time evaluation; with ``measured``, its novelty AUROC too (None or NaN: undefined)."""
        self.samples.append(int(samples_seen))
        self.accuracy.append(float(acc))
        if measured:
            defined = novelty_auroc is not None and novelty_auroc == novelty_auroc
            self.novelty_auroc.append(float(novelty_auroc) if defined else None)  # type: ignore[arg-type]

    def add_end_of_task(self, acc: float, class_acc: dict[int, float]) -> None:
        self.task_accuracy.append(float(acc))
        self.task_class_accuracy.append({int(k): float(v) for k, v in class_acc.items()})

    @property
    def a_auc(self) -> float:
        return sum(self.accuracy) / len(self.accuracy) if self.accuracy else float("nan")

    @property
    def novelty_auroc_mean(self) -> float:
        """The mean of the defined novelty AUROCs (NaN when none is)."""
        defined = [a for a in self.novelty_auroc if a is not None]
        return sum(defined) / len(defined) if defined else float("nan")

    @property
    def a_last(self) -> float:
        return self.task_accuracy[-1] if self.task_accuracy else float("nan")

    @property
    def a_avg(self) -> float:
        return sum(self.task_accuracy) / len(self.task_accuracy) if self.task_accuracy else float("nan")

    @property
    def f_last(self) -> float:
        if len(self.task_class_accuracy) < 2:
            return 0.0
        final, earlier = self.task_class_accuracy[-1], self.task_class_accuracy[:-1]
        drops = []
        for c in final:
            best = max((acc[c] for acc in earlier if c in acc), default=0.0)
            if best > 0:
                drops.append(best - final[c])
        return sum(drops) / len(drops) if drops else 0.0

    def summary(self) -> dict[str, float]:
        return {"A_auc": self.a_auc, "A_last": self.a_last, "A_avg": self.a_avg, "F_last": self.f_last,
                "novelty_auroc_mean": self.novelty_auroc_mean}

    def to_dict(self) -> dict:
        return {**asdict(self), **self.summary()}

    @classmethod
    def from_dict(cls, d: dict) -> AnytimeCurve:
        """Inverse of ``to_dict`` (JSON or checkpoint round trip; JSON turns class ids into strings)."""
        return cls(list(d["samples"]), list(d["accuracy"]), list(d["task_accuracy"]),
                   [{int(k): float(v) for k, v in c.items()} for c in d["task_class_accuracy"]],
                   list(d.get("novelty_auroc", [])))  # absent in curves written before it was measured


def batch_room(samples_seen: int, batch_size: int, eval_period: int) -> int:
    """The size of the mini-batch after ``samples_seen`` samples: ``batch_size``, or fewer so that it ends where
    the next any-time evaluation is scheduled (every ``eval_period`` samples; 0: none)."""
    return batch_size if eval_period <= 0 else min(batch_size, eval_period - samples_seen % eval_period)


def stream_batches(tasks: list[list[int]], batch_size: int, eval_period: int, seen: int = 0) -> list[list[int]]:
    """A stream's mini-batches as ``mepo evaluate`` and the service learn them: consecutive, never across a task's
    end or a scheduled evaluation (``seen``: samples learned before the first of them).

    Example:
        >>> stream_batches([[0, 1, 2, 3, 4], [5, 6]], batch_size=2, eval_period=3)
        [[0, 1], [2], [3, 4], [5], [6]]
    """
    batches = []
    for task in tasks:
        start = 0
        while start < len(task):
            size = batch_room(seen, batch_size, eval_period)
            batches.append(task[start : start + size])
            start, seen = start + size, seen + len(batches[-1])
    return batches


class EncodedTestSet:
    """The test images' encodings, computed once while the learner's encoder cannot change.

    Why: a learner whose host trains nothing but the classifier (the default, or prompts kept fixed) encodes
    every test image to the same feature at every evaluation, so the backbone forward is the evaluation's
    whole cost and needs paying once. A learner that trains its encoder is encoded afresh every time.
    Encoding is per image (eval mode, no batch statistics), so the cached features are the ones a fresh
    forward would give.
    """

    def __init__(self, test: ImageSet, batch_size: int = 128):
        self.test, self.batch_size = test, batch_size
        self._feature: torch.Tensor | None = None  # [N, D]
        self._scale: torch.Tensor | None = None  # [N, C] (MVP's logit multiplier) or None
        self._done = torch.zeros(len(test), dtype=torch.bool)

    def get(self, learner: OnlineLearner, idx: torch.Tensor) -> Encoded:
        """The encoding of test images ``idx`` [B] as ``learner`` sees them now."""
        if learner.encoder_trains:
            return learner.encode(self.test.images[idx])
        self._fill(learner, idx[~self._done[idx]])
        assert self._feature is not None, "every image of idx is encoded by now"
        scale = None if self._scale is None else self._scale[idx]
        return Encoded(self._feature[idx], torch.zeros((), device=self._feature.device), scale)

    def _fill(self, learner: OnlineLearner, missing: torch.Tensor) -> None:
        for chunk in missing.split(self.batch_size) if len(missing) else ():
            enc = learner.encode(self.test.images[chunk])
            if self._feature is None:
                self._feature = enc.feature.new_zeros(len(self.test), enc.feature.shape[1])
                if enc.logit_scale is not None:
                    self._scale = enc.logit_scale.new_zeros(len(self.test), enc.logit_scale.shape[1])
            self._feature[chunk.to(self._feature.device)] = enc.feature
            if self._scale is not None:
                assert enc.logit_scale is not None, "a learner's encodings all carry a logit scale, or none does"
                self._scale[chunk.to(self._scale.device)] = enc.logit_scale
            self._done[chunk] = True


@torch.no_grad()
def evaluate_seen(learner: OnlineLearner, encodings: EncodedTestSet, modes: tuple[AlignMode, ...] = ("running",)
                  ) -> dict[AlignMode, tuple[float, dict]]:
    """Micro accuracy and per-class accuracy on the seen-class test images, per alignment mode.

    Test images are taken in dataset order in batches of ``encodings.batch_size`` (this matters for the
    ``batch`` mode, whose statistics come from the test batch, as in the reference). One encoding serves all
    modes, and predictions come from the learner's one prediction function.
    """
    test = encodings.test
    keep = torch.isin(test.targets, torch.tensor(learner.exposed, dtype=torch.long)).nonzero().squeeze(1)  # [K]
    if len(keep) == 0:
        return {m: (float("nan"), {}) for m in modes}
    preds: dict[AlignMode, list[torch.Tensor]] = {m: [] for m in modes}
    for chunk in keep.split(encodings.batch_size):
        for mode, logits in learner.logits(encodings.get(learner, chunk), modes).items():
            preds[mode].append(learner.to_labels(logits.argmax(1)))
    target = test.targets[keep]
    out = {}
    for mode, parts in preds.items():
        p = torch.cat(parts)
        out[mode] = ((p == target).float().mean().item(), per_class_accuracy(p, target))
    return out


@torch.no_grad()
def novelty_auroc(learner: OnlineLearner, encodings: EncodedTestSet, modes: tuple[AlignMode, ...] = ("running",)
                  ) -> dict[AlignMode, float]:
    """AUROC of the learner's novelty score (``OnlineLearner.novelty``) ranking the test images of classes not
    learned yet above those of learned classes, over every test image, per alignment mode (NaN while no class, or
    every class, is learned). Batches as ``evaluate_seen``'s, in dataset order."""
    test = encodings.test
    learned = torch.isin(test.targets, torch.tensor(learner.exposed, dtype=torch.long))  # [N]
    if bool(learned.all()) or not bool(learned.any()):
        return {m: float("nan") for m in modes}
    scores: dict[AlignMode, list[torch.Tensor]] = {m: [] for m in modes}
    for chunk in torch.arange(len(test)).split(encodings.batch_size):
        encoded = encodings.get(learner, chunk)
        for mode in modes:
            scores[mode].append(learner.novelty(encoded, align_mode=mode))
    return {m: auroc(torch.cat(parts), ~learned) for m, parts in scores.items()}


class AnytimeEvaluation:
    """One run's any-time evaluation: the schedule, the test encodings and a curve per mode.

    Whoever assembles the mini-batches asks ``room`` how many samples may be learned before the next
    evaluation and cuts the batch there; ``after_batch`` then evaluates exactly at the scheduled position.

    Example:
        >>> from mepo_stream.learner import LearnerConfig
        >>> from mepo_stream.model import ModelConfig, create_model
        >>> from mepo_stream.backbone import BackboneConfig
        >>> images, names = torch.zeros(4, 3, 32, 32, dtype=torch.uint8), ["a", "b"]
        >>> test = ImageSet(images, torch.tensor([0, 1, 0, 1]), names, names)
        >>> cfg = LearnerConfig(autoaugment=None)
        >>> learner = OnlineLearner(create_model(ModelConfig(backbone=BackboneConfig(name="test_vit", weights=None,
        ...                                                  img_size=32), learner=cfg), 2), cfg)
        >>> run = AnytimeEvaluation(test, eval_period=2)
        >>> run.room(learner, batch_size=32)  # the first mini-batch stops at the evaluation due at 2
        2
        >>> _ = learner.observe(test.images[:2], test.targets[:2]); run.after_batch(learner) is not None
        True
        >>> run.curves["running"].samples, run.room(learner, batch_size=32)
        ([2], 2)
    """

    def __init__(self, test: ImageSet, eval_period: int, batch_size: int = 128,
                 modes: tuple[AlignMode, ...] = ("running",)):
        self.encodings = EncodedTestSet(test, batch_size)
        self.eval_period, self.modes = eval_period, modes
        self.next_eval = eval_period
        self.curves = {m: AnytimeCurve() for m in modes}

    def room(self, learner: OnlineLearner, batch_size: int) -> int:
        """The size of the next mini-batch: ``batch_size``, or fewer so that it ends at the next evaluation."""
        return batch_room(learner.samples_seen, batch_size, self.eval_period)

    def batches(self, learner: OnlineLearner, task: list[int], batch_size: int) -> list[list[int]]:
        """A task's stream indices as mini-batches in order, each cut at the next scheduled evaluation (learn each
        and call ``after_batch`` in turn)."""
        return stream_batches([task], batch_size, self.eval_period, learner.samples_seen)

    def after_batch(self, learner: OnlineLearner) -> dict[AlignMode, tuple[float, dict]] | None:
        """Call after each learned mini-batch; when the learner has reached the next scheduled position, runs the
        evaluation and returns (accuracy, per-class accuracy) per mode, else None."""
        if self.eval_period <= 0 or learner.samples_seen < self.next_eval:
            return None
        results = evaluate_seen(learner, self.encodings, self.modes)
        novelty = novelty_auroc(learner, self.encodings, self.modes)
        for mode, (acc, _) in results.items():
            self.curves[mode].add_anytime(self.next_eval, acc, novelty[mode], measured=True)
        self.next_eval += self.eval_period
        return results

    def end_of_task(self, learner: OnlineLearner) -> dict[AlignMode, tuple[float, dict]]:
        """The end-of-task evaluation (A_last, A_avg, F_last); returns (accuracy, per-class accuracy) per mode."""
        results = evaluate_seen(learner, self.encodings, self.modes)
        for mode, (acc, class_acc) in results.items():
            self.curves[mode].add_end_of_task(acc, class_acc)
        return results

    def state_dict(self) -> dict:
        return {"next_eval": self.next_eval, "curves": {m: c.to_dict() for m, c in self.curves.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.next_eval = int(state["next_eval"])
        self.curves = {m: AnytimeCurve.from_dict(state["curves"][m]) for m in self.modes}
