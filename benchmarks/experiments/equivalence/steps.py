"""The six steps compared: what each side computes for steps 1-5 (the host) and step 6 (the refine's outer step),
and their rows."""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.experiments.equivalence.comparison import (
    Row,
    compare,
    compare_index,
    compare_states,
    compare_updates,
    with_noise_floor,
)
from benchmarks.experiments.equivalence.ours import OurRefine
from benchmarks.experiments.equivalence.settings import DOCUMENTED, Settings, Tensors
from benchmarks.experiments.equivalence.shared_state import SharedState

Collected = dict[tuple[str, str], torch.Tensor]
"""(step, tensor) -> what a side computed for it."""


FORWARD_TENSORS = (("index", "prompt selection [B]"), ("query", "query [B, D]"), ("cls", "CLS [B, D]"),
                   ("aligned", "aligned CLS [B, D]"), ("logits", "logits [B, C]"), ("key_loss", "key loss"))


def forward_step(train: bool, task: int) -> str:
    return f"1 forward ({'train, task ' + str(task) if train else 'eval'})"


def collect_host(side, state: SharedState, h: torch.Tensor, settings: Settings) -> Collected:
    """Everything steps 1-5 compare, computed once by ``side``; ``h`` [B, D] is the batch step 2 aligns."""
    out: Collected = {}
    x = state.transform(state.images)
    for train, task in ((True, 0), (False, 0), (True, settings.later_task)):
        tensors = side.forward(x, train, task)
        out |= {(forward_step(train, task), label): tensors[key] for key, label in FORWARD_TENSORS}
    step = "2 Meta Cov alignment"
    for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64)):
        out[(step, f"re-coloured batch, {name} [B, D]")] = side.recoloured(h, dtype)
    out[(step, "aligned feature, fp32 [B, D]")] = side.aligned(h)
    return out | collect_steps(side, settings)


def collect_steps(side, settings: Settings) -> Collected:
    """Steps 3-5: one Adam step's loss and gradients, then every trainable tensor and its update after
    ``online_iter`` steps."""
    one, n = side.train_step(1), settings.online_iter
    out: Collected = {("3 masked loss", "CE + key loss (step 1)"): torch.tensor(one.loss)}
    out |= {("4 gradients (step 1)", name): g for name, g in one.grads[0].items()}
    many, step = side.train_step(n), f"5 after {n} Adam steps"
    out[(step, "mean loss")] = torch.tensor(many.loss)
    out |= {(step, f"Adam setting: {k}"): v for k, v in many.settings.items()}
    for name, p in many.params.items():
        out[(step, name)] = p
        out[(step, f"update of {name}")] = p.double() - many.start[name].double()
    return out


def compare_collected(ours: Collected, theirs: Collected, tol: float, update_tol: float,
                      documented: dict[str, str]) -> list[Row]:
    """A row for every (step, tensor) both sides computed; steps in ``documented`` are expected to differ."""
    rows = []
    for (step, tensor), a in ours.items():
        why = documented.get(step)
        if tensor.startswith("prompt selection"):
            rows.append(compare_index(step, tensor, a, theirs[(step, tensor)], why))
        else:
            limit = update_tol if tensor.startswith("update of") else tol
            rows.append(compare(step, tensor, a, theirs[(step, tensor)], limit, why))
    return rows


def host_rows(ours, theirs, noise, state: SharedState, settings: Settings, tol: float, update_tol: float
              ) -> list[Row]:
    """Steps 1-5 of ours against theirs and, when ``noise`` is given, against our own fp32 noise floor."""
    h = ours.forward(state.transform(state.images), True, 0)["cls"]
    documented = {forward_step(True, settings.later_task): DOCUMENTED["index_bug"]}
    mine = collect_host(ours, state, h, settings)
    rows = compare_collected(mine, collect_host(theirs, state, h, settings), tol, update_tol, documented)
    if noise is not None:
        floor = compare_collected(mine, collect_host(noise, state, h, settings), tol, update_tol, documented)
        with_noise_floor(rows, floor)
    return rows


Trace = tuple[Tensors, list[Tensors], Tensors]
"""A side's outer step: the initial state, the state after every SGD step, and the state after Reptile."""


def our_trace(ours: OurRefine) -> Trace:
    initial, trace = ours.initial_state(), []
    final = ours.outer_step(lambda s: trace.append({k: v.detach().clone() for k, v in s.items()}))
    return initial, trace, final


def trace_rows(mine: Trace, other: Callable[[Tensors], object], settings: Settings, tol: float, update_tol: float
               ) -> list[Row]:
    """Step 6: ``other`` (built from our initial state) step by step against our trace, compared as it runs (a
    ViT-B state is 350 MB: the other side's states are never kept)."""
    initial, trace, final = mine
    labels, rows = refine_step_labels(settings), []

    def check(state: Tensors) -> None:
        k = len(rows) // 2
        if k >= len(trace):
            raise AssertionError(f"the other side took more SGD steps than ours ({len(trace)})")
        step = f"6 refine: {labels[k]}"
        rows.extend([compare_states(step, trace[k], state, tol),
                     compare_updates(step, trace[k], state, initial, update_tol)])

    theirs = other(initial).outer_step(check)
    if len(rows) != 2 * len(trace):
        raise AssertionError(f"the other side took {len(rows) // 2} SGD steps, ours {len(trace)}")
    step = f"6 refine: after the Reptile update (eps {settings.reptile_eps})"
    return rows + [compare_states(step, final, theirs, tol), compare_updates(step, final, theirs, initial, update_tol)]


def refine_rows(ours: OurRefine, theirs: Callable[[Tensors], object], noise: Callable[[Tensors], object] | None,
                settings: Settings, tol: float, update_tol: float) -> list[Row]:
    """Step 6 of ours against theirs and, when ``noise`` is given, against our own fp32 noise floor."""
    mine = our_trace(ours)
    rows = trace_rows(mine, theirs, settings, tol, update_tol)
    if noise is not None:
        with_noise_floor(rows, trace_rows(mine, noise, settings, tol, update_tol))
    return rows


def refine_step_labels(settings: Settings) -> list[str]:
    """What each SGD step of the outer step is (one batch per pass here: batch 256 holds every set)."""
    inner = [f"inner SGD step (task {t + 1}, epoch {e + 1})" for t in range(settings.refine_tasks) for e in range(4)]
    return inner + ["joint SGD step (theta-hat)"]
