"""Alignment cost: Meta Cov's Cholesky + solve + blend per training step, as a fraction of the step.

Meta Cov's alignment sits in the gradient path of a host trained by gradient, so the step measured is one
gradient step of the learner (``online_iter`` 1, the linear head: augment, forward under the learner's autocast
dtype, masked cross-entropy, backward, Adam step; fused Adam on CUDA), by default in the paper's recipe (MISA).
Two measurements, side by side in one process on the same mini-batch, on the device the service runs on:

* direct: the alignment module alone, forward and backward on the step's real features [B, D] in training
  mode (running-statistics update, batch covariance, Cholesky, triangular solve, normalise, blend), divided
  by the time of the whole step;
* differential: the same step timed with the alignment switched off (the host method alone), and the
  difference divided by the step with it (``differential_share``: a difference of two noisy timings, so it can
  come out below zero when the alignment costs less than the timing noise; not a ratio).

Usage:
    python -m benchmarks.rows.alignment_cost --spec.mepo runs/refined_dinov2_84
Writes ``benchmarks/results/alignment_cost.json``.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.rows.learner_throughput import stream_batches
from benchmarks.tools.service import ServiceSpec, bare_learner, paper_recipe, timed, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.data import list_files


def main(spec: ServiceSpec = paper_recipe(ServiceSpec()), repeats: int = 10,
         out: Path = Path("benchmarks/results/alignment_cost.json")) -> dict:
    """Measure the alignment's share of a gradient step; write the JSON result.

    Args:
        spec: Model, host, learner configuration (its mini-batch size and precision) and MePo bundle (must hold
            Sigma_pre).
        repeats: Timed repetitions of each measurement (the median is reported).
        out: JSON result path.
    """
    torch.manual_seed(0)
    spec = replace(spec, learner=replace(spec.learner, classifier="linear", online_iter=1))
    learner = bare_learner(spec, len(list_files(spec.data, "train").classes))
    method, dev = learner.method, learner.device
    if method.alignment is None:
        raise ValueError("alignment cost needs a MePo bundle with Sigma_pre: pass --spec.mepo")
    images, labels = stream_batches(spec, 1, dev)[0]
    with torch.no_grad():
        feature = method.encode_images(images).feature  # [B, D] fp32

    def align_only() -> None:
        method.train()
        h = feature.clone().requires_grad_()
        method.alignment(h, mode="batch").sum().backward()

    t_align = statistics.median(timed(align_only, repeats * 5, dev))
    t_step = statistics.median(timed(lambda: learner.observe(images, labels), repeats, dev))
    alignment, method.alignment = method.alignment, None
    t_host = statistics.median(timed(lambda: learner.observe(images, labels), repeats, dev))
    method.alignment = alignment
    return write_result({
        "benchmark": "alignment_cost", "spec": spec.as_json(), "batch_size": spec.learner.batch_size,
        "feature_dim": int(feature.shape[1]), "alignment_s": t_align, "step_s": t_step,
        "step_without_alignment_s": t_host,
        "ratio": t_align / t_step, "differential_share": (t_step - t_host) / t_step,
    }, out, *spec.placement())


def table_rows(r: dict) -> list[Row]:
    """The table's row: the alignment's time per training step, as a share of the step."""
    return [("Alignment (Cholesky + solve + blend) per training step", fmt(r["alignment_s"], "ms"),
             fmt(r["step_s"], "ms") + " (step)", r["ratio"], "< 0.03", r["ratio"] < 0.03)]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
