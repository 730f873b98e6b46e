"""What the novelty score costs a prediction: the snapshot's answer of one image with the default score against the
same answer without one.

Why: every answer carries its novelty score (``mepo_stream.novelty``). With the streaming LDA it is one more
quadratic form of the image's feature, its factorisations cached with the snapshot, so it should cost next to
nothing beside the backbone's forward. The reference is the same snapshot answering with ``novelty_score`` None:
the same forward, logits and softmax, and no score. Rounds alternate the two (the machine's speed drifts between
minutes), each ``repeats`` single-image answers after one warm-up; the figure is the median of the rounds' p50
ratios, with their range.

Usage:
    python -m benchmarks.rows.novelty_cost --rounds 7 --repeats 50
Writes ``benchmarks/results/novelty_cost.json``.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from benchmarks.rows.learner_throughput import stream_batches
from benchmarks.tools.service import ServiceSpec, bare_learner, quantiles, timed, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.data import list_files
from mepo_stream.novelty import DEFAULT_SCORE
from server.config import ServeConfig
from server.snapshot import take_snapshot


def main(spec: ServiceSpec = ServiceSpec(), batches: int = 4, rounds: int = 7, repeats: int = 50,
         out: Path = Path("benchmarks/results/novelty_cost.json")) -> dict:
    """Time one image's answer with and without the score, in alternating rounds.

    Args:
        spec: The model and learner.
        batches: Mini-batches the learner learns first (classes to answer with, sums for the score).
        rounds: Alternating rounds of the two.
        repeats: Answers timed per round and kind.
        out: The results file.
    """
    learner = bare_learner(spec, len(list_files(spec.data, "train").classes))
    for images, labels in stream_batches(spec, batches, learner.device):
        learner.observe(images, labels)
    scored = take_snapshot(learner, 1, ServeConfig.alignment.inference_mode, DEFAULT_SCORE)
    plain = replace(scored, novelty_score=None)
    image = stream_batches(spec, 1, learner.device)[0][0][:1]  # [1, 3, S, S]
    per_round = []
    for _ in range(rounds):
        with_score = quantiles(timed(lambda: scored.answer(image), repeats, learner.device))["p50_s"]
        without = quantiles(timed(lambda: plain.answer(image), repeats, learner.device))["p50_s"]
        per_round.append({"with_p50_s": with_score, "without_p50_s": without, "ratio": with_score / without})
    ratios = [r["ratio"] for r in per_round]
    result = {"benchmark": "novelty_cost", "score": DEFAULT_SCORE, "model": spec.model, "img_size": spec.img_size,
              "classes_learned": len(learner.exposed), "rounds": rounds, "repeats": repeats,
              "per_round": per_round, "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
              "with_p50_s": statistics.median(r["with_p50_s"] for r in per_round),
              "without_p50_s": statistics.median(r["without_p50_s"] for r in per_round)}
    return write_result(result, out, learner.device, learner.dtype)


def table_rows(r: dict) -> list[Row]:
    """The answer's p50 with the score against without, the median of the rounds with their range."""
    low, high = r["ratio_range"]
    return [(f"Predict p50 of one image with its novelty score ({r['score']}) against without "
             f"(median of {r['rounds']} rounds, ratios {low:.3f}–{high:.3f})",
             fmt(r["with_p50_s"], "ms"), fmt(r["without_p50_s"], "ms"), r["ratio"], "≤ 1.05", r["ratio"] <= 1.05)]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
