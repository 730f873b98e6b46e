"""What each side's step hands back (``Trained``) and the hooks that record it: the same for our side and the
reference's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from benchmarks.experiments.equivalence.settings import Tensors


@dataclass
class Trained:
    """The outcome of a side's step on the mini-batch."""

    loss: float
    """The mean loss over the Adam steps, as the side's step returns it."""
    start: Tensors
    """Every trainable tensor before the steps (our names and layout)."""
    grads: list[Tensors]
    """Gradient of every trainable tensor at each Adam step (our names and layout)."""
    params: Tensors
    """Every trainable tensor afterwards (our names and layout)."""
    settings: Tensors
    """The optimizer's settings for the trainable tensors (lr, betas, eps, weight decay, amsgrad, maximize)."""


@contextlib.contextmanager
def step_recorder(optimizer: torch.optim.Optimizer, names: dict[int, str], into: list[Tensors],
                  layout: Callable[[str, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Record every trainable tensor's gradient (in our layout) just before each of ``optimizer``'s steps."""
    def hook(opt, args, kwargs):
        into.append({names[id(p)]: layout(names[id(p)], p.grad.clone()) for group in opt.param_groups
                     for p in group["params"] if p.grad is not None})

    handle = optimizer.register_step_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def adam_settings(optimizer: torch.optim.Optimizer) -> Tensors:
    """The settings of the groups that hold a trainable tensor, as tensors (one row each: [groups, ...])."""
    groups = [g for g in optimizer.param_groups if any(p.requires_grad for p in g["params"])]
    keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
    return {k: torch.tensor([g[k] for g in groups], dtype=torch.float64) for k in keys} | {
        "type": torch.tensor([type(optimizer).__name__ == "Adam"], dtype=torch.float64)}


@contextlib.contextmanager
def recording(obj: object, attr: str, into: list) -> Iterator[None]:
    """Within: ``obj.attr(...)`` also appends its (args, result) to ``into`` (an instance-level wrapper)."""
    original = getattr(obj, attr)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        into.append((args, out))
        return out

    setattr(obj, attr, wrapper)
    try:
        yield
    finally:
        delattr(obj, attr)


@contextlib.contextmanager
def forward_hook(module: torch.nn.Module, into: list) -> Iterator[None]:
    """Within: every call of ``module`` appends its (inputs, output) to ``into``."""
    handle = module.register_forward_hook(lambda m, args, out: into.append((args, out)))
    try:
        yield
    finally:
        handle.remove()


StepCallback = Callable[[Tensors], None]
