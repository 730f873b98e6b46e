"""Bare learner throughput: samples/s of the learner's own model work alone, with no service around it.

The same bare loop as ``learner_throughput`` (the core ``OnlineLearner`` on mini-batches already decoded and on
the device), without the service run, for a model too large to stream through the service on the measuring
machine in reasonable time, and as an absolute figure: ``make bench`` runs it on a GPU for ViT-B/16 at 224 px
(random init: speed does not depend on the weights) in bf16, learning with the paper's recipe (MISA).

Usage:
    python -m benchmarks.rows.bare_learner --spec.model vit_base_patch16_224 --spec.weights null --spec.img_size 224
Writes ``benchmarks/results/bare_learner.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.rows.learner_throughput import bare_rate
from benchmarks.tools.service import ServiceSpec, paper_recipe, write_result
from benchmarks.tools.table import Row, fmt


def main(spec: ServiceSpec = paper_recipe(ServiceSpec()), batches: int = 20, prequential: bool = False,
         out: Path = Path("benchmarks/results/bare_learner.json")) -> dict:
    """Measure samples/s of the bare learner; write the JSON result.

    Args:
        spec: Model, host, learner configuration (with its precision) and MePo bundle.
        batches: Timed mini-batches (after one warm-up mini-batch).
        prequential: Predict each mini-batch before learning it, as the service's test-then-train does.
        out: JSON result path.
    """
    torch.manual_seed(0)
    return write_result({
        "benchmark": "bare_learner", "spec": spec.as_json(), "batches": batches, "prequential": prequential,
        "bare_samples_per_s": bare_rate(spec, batches, prequential),
    }, out, *spec.placement())


def table_rows(r: dict) -> list[Row]:
    """The table's row: the bare learner's samples/s, against the GPU goal."""
    s, rate = r["spec"], r["bare_samples_per_s"]
    return [(f"Bare learner, {s['model']} @ {s['img_size']} px, {s['method']} + {s['learner']['classifier']} "
             f"(samples/s)", fmt(rate, "/s"), "–", None, "≥ 400/s on an H100-class GPU", rate >= 400)]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
