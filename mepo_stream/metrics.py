"""The Si-Blurry any-time evaluation metrics: A_AUC, A_last, A_avg and F_last.

Definitions follow the reference trainer (MISA/MePo ``_trainer.py``):

* an *any-time* evaluation runs every ``eval_period`` samples on the test samples of the classes seen so far
  and records micro (sample-weighted) top-1 accuracy; **A_AUC** is the plain mean of those accuracies;
* an *end-of-task* evaluation runs after each (hidden) task; **A_last** is the last one, **A_avg** their mean;
* **F_last** is the mean, over classes whose best earlier end-of-task accuracy is > 0, of that best earlier
  accuracy minus the final accuracy.

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
    """Stream position (samples seen) of each any-time evaluation."""
    accuracy: list[float] = field(default_factory=list)
    """Micro top-1 accuracy on the seen-class test subset at each any-time evaluation."""
    task_accuracy: list[float] = field(default_factory=list)
    """Accuracy after each task."""
    task_class_accuracy: list[dict[int, float]] = field(default_factory=list)
    """Per-class accuracy after each task, keyed by class id."""

    def add_anytime(self, samples_seen: int, acc: float) -> None:
        self.samples.append(int(samples_seen))
        self.accuracy.append(float(acc))

    def add_end_of_task(self, acc: float, class_acc: dict[int, float]) -> None:
        self.task_accuracy.append(float(acc))
        self.task_class_accuracy.append({int(k): float(v) for k, v in class_acc.items()})

    @property
    def a_auc(self) -> float:
        return sum(self.accuracy) / len(self.accuracy) if self.accuracy else float("nan")

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
        return {"A_auc": self.a_auc, "A_last": self.a_last, "A_avg": self.a_avg, "F_last": self.f_last}

    def to_dict(self) -> dict:
        return {**asdict(self), **self.summary()}
