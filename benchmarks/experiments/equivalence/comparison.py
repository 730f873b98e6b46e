"""The comparison machinery: one row per compared tensor, its differences, tolerance, noise floor and verdict."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.experiments.equivalence.settings import FP32_NOISE, FP32_RESOLUTION, NOISE_FACTOR, Tensors


@dataclass
class Row:
    """One compared tensor."""

    step: str
    tensor: str
    max_abs: float
    max_rel: float
    tol: float
    passed: bool | None
    """None: a difference that is explained (``verdict`` says how, ``note`` names the doc line)."""
    note: str = ""
    noise_rel: float | None = None
    """The same comparison between our side and itself evaluated in another fp32 order (the noise floor)."""

    @property
    def verdict(self) -> str:
        if self.passed is not None:
            return "yes" if self.passed else "no"
        if self.note.startswith(FP32_RESOLUTION):
            return "fp32 resolution"
        return "fp32 noise" if self.note.startswith(FP32_NOISE) else "documented"


def difference(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """Max absolute difference and that relative to the reference tensor's largest magnitude."""
    if ours.shape != theirs.shape:
        raise ValueError(f"shapes differ: ours {tuple(ours.shape)}, theirs {tuple(theirs.shape)}")
    a, b = ours.detach().double().cpu(), theirs.detach().double().cpu()
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    return max_abs, max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))


def compare(step: str, tensor: str, ours: torch.Tensor, theirs: torch.Tensor, tol: float,
            documented: str | None = None) -> Row:
    """A row for two tensors; passes when the relative difference is within ``tol`` (``documented``: expected)."""
    max_abs, max_rel = difference(ours, theirs)
    passed = None if documented else max_rel <= tol
    return Row(step, tensor, max_abs, max_rel, tol, passed, documented or "")


def with_noise_floor(rows: list[Row], floor: list[Row]) -> None:
    """Give each row its noise floor (the same comparison of our side with itself in another fp32 order), and call
    a row over tolerance fp32 noise when it stays within ``NOISE_FACTOR`` times that floor."""
    by_key = {(r.step, r.tensor): r for r in floor}
    for row in rows:
        row.noise_rel = by_key[(row.step, row.tensor)].max_rel
        if row.passed is False and row.max_rel <= NOISE_FACTOR * row.noise_rel:
            row.passed, row.note = None, f"{FP32_NOISE} ({row.max_rel / row.noise_rel:.1f}x the floor)"


def compare_index(step: str, tensor: str, ours: torch.Tensor, theirs: torch.Tensor,
                  documented: str | None = None) -> Row:
    """A row for two integer selections: the share of entries that differ (must be 0)."""
    wrong = (ours.cpu() != theirs.cpu()).float().mean().item()
    note = f"ours {ours.tolist()[:8]}, theirs {theirs.tolist()[:8]}"
    return Row(step, tensor, wrong, wrong, 0.0, None if documented else wrong == 0,
               f"{documented}; {note}" if documented else note)


def compare_states(step: str, ours: Tensors, theirs: Tensors, tol: float) -> Row:
    """A row for two whole states: the worst tensor's differences (named in the note)."""
    if set(ours) != set(theirs):
        raise ValueError(f"the states hold other tensors: {sorted(set(ours) ^ set(theirs))[:6]}")
    diffs = {k: difference(ours[k], theirs[k]) for k in ours}
    worst_abs = max(diffs, key=lambda k: diffs[k][0])
    worst_rel = max(diffs, key=lambda k: diffs[k][1])
    return Row(step, f"all {len(diffs)} tensors", diffs[worst_abs][0], diffs[worst_rel][1], tol,
               diffs[worst_rel][1] <= tol, f"worst: {worst_rel} (rel), {worst_abs} (abs)")


def compare_updates(step: str, ours: Tensors, theirs: Tensors, start: Tensors, tol: float) -> Row:
    """A row for two updates from the same ``start``: ``ours - start`` against ``theirs - start`` (in fp64), the
    worst tensor's. Why: a small learning rate moves a parameter by far less than its size, so the parameters can
    agree to 1e-6 while their updates disagree; only the update shows a wrong step."""
    diffs = {k: difference(ours[k].double() - start[k].double(), theirs[k].double() - start[k].double())
             for k in ours if ours[k].is_floating_point()}
    worst = max(diffs, key=lambda k: diffs[k][1])
    row = Row(step, f"update of all {len(diffs)} tensors", max(d[0] for d in diffs.values()), diffs[worst][1], tol,
              diffs[worst][1] <= tol, f"worst: {worst}")
    if not row.passed and all(d[1] <= tol or d[0] <= last_bits(theirs[k]) for k, d in diffs.items()):
        row.passed, row.note = None, f"{FP32_RESOLUTION}; worst: {worst}"
    return row


def last_bits(t: torch.Tensor) -> float:
    """Two units in the last place of a tensor's largest fp32 entry: what rounding alone can change it by."""
    return 2 * torch.finfo(torch.float32).eps * t.detach().abs().max().item()


def markdown_table(rows: list[Row]) -> str:
    """The result table as docs/fidelity.md shows it."""
    lines = ["| step | tensor | max abs diff | max rel diff | noise floor (rel) | pass |", "|---|---|---|---|---|---|"]
    for r in rows:
        floor = "" if r.noise_rel is None else f"{r.noise_rel:.2e}"
        verdict = "**no**" if r.verdict == "no" else r.verdict
        lines.append(f"| {r.step} | {r.tensor} | {r.max_abs:.2e} | {r.max_rel:.2e} | {floor} | {verdict} |")
    return "\n".join(lines)
