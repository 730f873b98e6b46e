"""What an order-invariant learner has learned from part of a stream, as float64 sums indexed by original label.

Why: the statistics classifiers (``mepo_stream.heads``) are sums: per-class counts and feature sums, the second
moment of all features, and the prequential hits of every shrinkage candidate. Sums of disjoint parts of a stream,
added, are the sums of the whole stream, so N learners that each learn some partitions of a topic build, together,
the model one learner would build (``server.learner.partitions``). Each learner numbers classes in the order it
first sees them, so the parts are kept by *original label*, never by a learner's head index; ``head_order``
turns a sum back into the classifier's layout for one learner's label map.

Example:
    >>> a, b = LabelStatistics.zeros(3, 2, 1), LabelStatistics.zeros(3, 2, 1)
    >>> a.add(torch.tensor([[1., 0.]]), torch.tensor([2]), torch.tensor([0.]))
    >>> b.add(torch.tensor([[0., 1.], [1., 1.]]), torch.tensor([0, 2]), torch.tensor([1.]))
    >>> merged = LabelStatistics.total([a, b])
    >>> merged.counts.tolist(), merged.samples, merged.hits.tolist()
    ([1.0, 0.0, 2.0], 3, [1.0])
    >>> counts, sums = merged.head_order([2, 0])  # this learner saw label 2 first, then 0; output 2 is unmapped
    >>> counts.tolist(), sums.tolist()
    ([2.0, 1.0, 0.0], [[2.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

FIELDS = ("counts", "sums", "second", "hits")


@dataclass
class LabelStatistics:
    """Additive sums of one part of a stream (float64, on the CPU)."""

    counts: torch.Tensor  # [L] samples per original label
    sums: torch.Tensor  # [L, D] feature sums per original label
    second: torch.Tensor  # [D, D] sum of x x^T over every sample
    hits: torch.Tensor  # [K] prequential correct predictions per shrinkage candidate (K = 0: no candidates)

    @classmethod
    def zeros(cls, n_labels: int, dim: int, n_candidates: int) -> LabelStatistics:
        f64 = torch.float64
        return cls(torch.zeros(n_labels, dtype=f64), torch.zeros(n_labels, dim, dtype=f64),
                   torch.zeros(dim, dim, dtype=f64), torch.zeros(n_candidates, dtype=f64))

    @property
    def samples(self) -> int:
        return int(self.counts.sum())

    @property
    def shape(self) -> tuple[int, int, int]:
        """(labels, feature dimension, shrinkage candidates): two parts add only if their shapes match."""
        return self.sums.shape[0], self.sums.shape[1], self.hits.shape[0]

    @torch.no_grad()
    def add(self, h: torch.Tensor, labels: torch.Tensor, hits: torch.Tensor) -> None:
        """Fold features [B, D] with original labels [B] and the batch's prequential hits [K] in."""
        self._fold(h, labels, 1.0)
        self.hits += hits.to("cpu", torch.float64)

    @torch.no_grad()
    def remove(self, h: torch.Tensor, labels: torch.Tensor) -> None:
        """Take features [B, D] learned with original labels [B] out (a deletion): the sums of a part that never had
        them. Their prequential hits stay, as the stream's history."""
        taken = torch.bincount(labels.to("cpu", torch.long), minlength=len(self.counts))  # [L]
        if bool((taken > self.counts).any()):
            raise ValueError("removing more samples of a label than this part has: these were never learned here")
        self._fold(h, labels, -1.0)

    def move(self, h: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
        """Features [B, D] learned with original labels ``old`` [B] belong to ``new`` [B] (a correction)."""
        self.remove(h, old)
        self._fold(h, new, 1.0)

    def _fold(self, h: torch.Tensor, labels: torch.Tensor, sign: float) -> None:
        h = h.detach().to("cpu", torch.float64)  # [B, D]
        labels = labels.to("cpu", torch.long)
        self.counts.index_add_(0, labels, torch.full(labels.shape, sign, dtype=torch.float64))
        self.sums.index_add_(0, labels, h, alpha=sign)
        self.second += sign * (h.T @ h)

    @classmethod
    def total(cls, parts: Iterable[LabelStatistics], like: LabelStatistics | None = None) -> LabelStatistics:
        """The sum of ``parts`` (zeros shaped as ``like`` when there are none)."""
        parts = list(parts)
        if not parts:
            if like is None:
                raise ValueError("the total of no parts needs a shape (like=)")
            return cls.zeros(*like.shape)
        shapes = {p.shape for p in parts}
        if len(shapes) > 1:
            raise ValueError(f"statistics of different shapes cannot be added: {sorted(shapes)}")
        return cls(*(torch.stack([getattr(p, f) for p in parts]).sum(0) for f in FIELDS))

    def replace_part(self, old: LabelStatistics | None, new: LabelStatistics) -> LabelStatistics:
        """This total with one part ``old`` (None: a part not in it yet) replaced by ``new``: two additions, whatever
        the number of parts (float64 rounding of the order of the total's magnitude per call)."""
        return LabelStatistics(*((getattr(self, f) + getattr(new, f) - (0 if old is None else getattr(old, f)))
                                 for f in FIELDS))

    def head_order(self, exposed: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts [C] and sums [C, D] in a learner's head order (head output k is label ``exposed[k]``), zero for
        head outputs no label is mapped to yet; C is the label count."""
        counts, sums = torch.zeros_like(self.counts), torch.zeros_like(self.sums)
        index = torch.tensor(exposed, dtype=torch.long)
        counts[: len(exposed)], sums[: len(exposed)] = self.counts[index], self.sums[index]
        return counts, sums

    @classmethod
    def from_head_order(cls, counts: torch.Tensor, sums: torch.Tensor, second: torch.Tensor, hits: torch.Tensor,
                        exposed: list[int]) -> LabelStatistics:
        """The inverse of ``head_order``: a classifier's buffers and its label map as label-indexed sums, on the CPU
        whatever the classifier's device (a group's state store adds them there)."""
        out = cls(torch.zeros(counts.shape, dtype=torch.float64), torch.zeros(sums.shape, dtype=torch.float64),
                  second.detach().double().cpu().clone(), hits.detach().double().cpu().clone())
        index = torch.tensor(exposed, dtype=torch.long)
        out.counts[index] = counts[: len(exposed)].double().cpu()
        out.sums[index] = sums[: len(exposed)].double().cpu()
        return out

    def clone(self) -> LabelStatistics:
        return LabelStatistics(*(getattr(self, f).clone() for f in FIELDS))

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {prefix + f: getattr(self, f) for f in FIELDS}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str = "") -> LabelStatistics:
        return cls(*(tensors[prefix + f].to(torch.float64) for f in FIELDS))
