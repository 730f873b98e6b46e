"""Alignment cost: Meta Cov's Cholesky + solve + blend per training step, as a fraction of the step.

Two measurements, side by side in one process on the same mini-batch:

* direct: the alignment module alone, forward and backward on the step's real features [B, D] in training
  mode (running-statistics update, batch covariance, Cholesky, triangular solve, normalise, blend), divided
  by the time of a whole training step (forward, masked cross-entropy, backward, Adam step) of the model;
* differential: the same step timed with the alignment switched off (the host method alone), and the
  difference divided by the step with it.

Usage:
    python -m benchmarks.alignment_cost --spec.mepo runs/refined_dinov2_84
Writes ``benchmarks/results/alignment_cost.json``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.service import ServiceSpec, bare_method, write_result
from mepo_stream.backbone import normalization
from mepo_stream.data import load_split
from mepo_stream.learner import LearnerConfig
from mepo_stream.methods.base import ContinualMethod
from mepo_stream.transforms import test_transform


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _step_fn(method: ContinualMethod, x: torch.Tensor, y: torch.Tensor):
    lr = LearnerConfig.lr  # the service's
    optimizer = torch.optim.Adam(method.param_groups(lr), lr=lr)

    def step() -> None:
        logits, aux = method(x, slot=0)
        loss = F.cross_entropy(logits, y) + aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def main(spec: ServiceSpec = ServiceSpec(), batch_size: int = 32, repeats: int = 10,
         out: Path = Path("benchmarks/results/alignment_cost.json")) -> dict:
    """Measure the alignment's share of a training step; write the JSON result.

    Args:
        spec: Model and MePo bundle (must hold Sigma_pre).
        batch_size: Mini-batch size (the service's 32).
        repeats: Timed repetitions of each measurement (the median is reported).
        out: JSON result path.
    """
    torch.manual_seed(0)
    data = load_split(spec.data, "train")
    method = bare_method(spec, len(data.classes)).train()
    if method.alignment is None:
        raise ValueError("alignment cost needs a MePo bundle with Sigma_pre: pass --spec.mepo")
    x = test_transform(spec.img_size, *normalization(method.backbone))(data.images[:batch_size])  # [B, 3, S, S]
    y = data.targets[:batch_size]
    with torch.no_grad():
        feature = method.encode(x, 0).feature  # [B, D]

    def align_only() -> None:
        h = feature.clone().requires_grad_()
        method.alignment(h, mode="batch").sum().backward()

    t_align = _timed(align_only, repeats * 5)
    t_step = _timed(_step_fn(method, x, y), repeats)
    alignment, method.alignment = method.alignment, None
    t_host = _timed(_step_fn(method, x, y), repeats)
    method.alignment = alignment
    return write_result({
        "benchmark": "alignment_cost", "spec": {**spec.__dict__, "mepo": str(spec.mepo)}, "batch_size": batch_size,
        "feature_dim": int(feature.shape[1]), "alignment_s": t_align, "step_s": t_step,
        "step_without_alignment_s": t_host,
        "ratio": t_align / t_step, "ratio_differential": (t_step - t_host) / t_step,
    }, out)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
