"""What "one image, one feature" costs: the learner in its fixed shape against free shapes, side by side, and
single-image predictions with and without ``--learner.invariant_predictions`` against the backbone's own forward.

* ``learner``: the bare learner loop (``benchmarks.rows.learner_throughput``'s test-then-train on decoded mini-batches)
  with every forward in the fixed shape (``--learner.batch_size``, the default) and with free shapes (what it did
  before), in alternating rounds on one model (free, fixed, free, fixed, ...); each round's ratio is fixed over the
  mean of the free runs on both sides of it, and the result is the median round. Full mini-batches: a steady
  stream's. A partial mini-batch (``partial`` images: a partition's last, an idle topic's) is timed apart: it
  pays a full mini-batch's forward in the fixed shape.
* ``predict``: p50 of one image through ``predict_proba`` (what ``/v1/predict`` and the batcher run, without
  HTTP), free and invariant, against p50 of the backbone's own forward of that image at the same precision.
* ``int8``: where int8 runs (the CPU), the learner with activations quantised per row (``Int8Linear``, exact and
  invariant) against per batch (``torch.ao``'s dynamic quantisation, what it ran before), alternated the same way.

Usage:
    python -m benchmarks.rows.batch_invariance
Writes ``benchmarks/results/batch_invariance.json``.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.rows.learner_throughput import learn, stream_batches
from benchmarks.tools.service import ServiceSpec, bare_learner, seconds, synchronize, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.data import list_files
from mepo_stream.learner import OnlineLearner
from mepo_stream.precision import autocast


def alternate(a, b, rounds: int) -> dict:
    """Rates of ``a()`` and ``b()`` (each returns samples/s) in alternating runs a, b, a, ..., b, a: each round's
    ratio is its ``b`` over the mean of the ``a`` runs on both sides; the median round is the result."""
    runs_a, runs_b = [a()], []
    for _ in range(rounds):
        runs_b.append(b())
        runs_a.append(a())
    ratios = [rb / ((x + y) / 2) for rb, x, y in zip(runs_b, runs_a, runs_a[1:], strict=False)]
    return {"a_samples_per_s": runs_a, "b_samples_per_s": runs_b, "ratios": ratios,
            "ratio": statistics.median(ratios)}


def rate(learner: OnlineLearner, batches: list, forward_batch: int | None) -> float:
    """Samples/s of the learner over ``batches`` with its forward shape set to ``forward_batch``."""
    learner.method.forward_batch = forward_batch

    def run() -> None:
        for images, labels in batches:
            learn(learner, images, labels, True)

    return sum(len(labels) for _, labels in batches) / seconds(run, learner.device)


def learner_cost(spec: ServiceSpec, batches: int, rounds: int, partial: int) -> dict:
    """The fixed shape against free shapes, side by side, on full and on partial mini-batches."""
    learner = bare_learner(spec, len(list_files(spec.data, "train").classes))
    warm_up, *timed = stream_batches(spec, batches + 1, learner.device)
    learn(learner, *warm_up, True)
    size = spec.learner.batch_size
    full = alternate(lambda: rate(learner, timed, None), lambda: rate(learner, timed, size), rounds)
    cut = [(images[:partial], labels[:partial]) for images, labels in timed]
    part = alternate(lambda: rate(learner, cut, None), lambda: rate(learner, cut, size), rounds)
    return {"batch_size": size, "full": full, "partial_images": partial, "partial": part}


def p50_ms(fn, dev: torch.device, repeats: int) -> float:
    """Median wall milliseconds of ``fn()`` over ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(dev)
        start = time.perf_counter()
        fn()
        synchronize(dev)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def predict_cost(spec: ServiceSpec, repeats: int) -> dict:
    """Single-image predict p50, free and invariant, against the backbone's own forward of the image."""
    learner = bare_learner(spec, len(list_files(spec.data, "train").classes))
    images, labels = stream_batches(spec, 1, learner.device)[0]
    learn(learner, images, labels, True)
    model, image = learner.method.inference_copy(), images[:1]
    x = model.transform(image)

    @torch.inference_mode()
    def backbone() -> None:
        with autocast(model.device, model.dtype):
            model.backbone.forward_features(x)

    def predict(invariant: bool):
        model.invariant_predictions = invariant
        return lambda: model.predict_proba(image, len(learner.exposed))

    out = {"backbone_ms": p50_ms(backbone, model.device, repeats),
           "free_ms": p50_ms(predict(False), model.device, repeats),
           "invariant_ms": p50_ms(predict(True), model.device, repeats)}
    return {**out, "free_x_backbone": out["free_ms"] / out["backbone_ms"],
            "invariant_x_backbone": out["invariant_ms"] / out["backbone_ms"]}


def per_batch_int8(spec: ServiceSpec, learner: OnlineLearner) -> OnlineLearner:
    """A copy of ``spec``'s int8 ``learner`` whose backbone quantises activations per batch (``torch.ao``'s dynamic
    quantisation of the float backbone): the int8 path before activations were quantised per row."""
    other = copy.deepcopy(learner)
    fp32 = replace(spec, learner=replace(spec.learner, precision="fp32"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other.method.backbone = torch.ao.quantization.quantize_dynamic(
            bare_learner(fp32, learner.n_classes).method.backbone, {torch.nn.Linear}, dtype=torch.qint8)
    return other


def int8_cost(spec: ServiceSpec, batches: int, rounds: int) -> dict:
    """int8 per row (exact, invariant) against per batch, side by side, full mini-batches."""
    spec = replace(spec, learner=replace(spec.learner, precision="int8"))
    learner = bare_learner(spec, len(list_files(spec.data, "train").classes))
    before = per_batch_int8(spec, learner)
    warm_up, *timed = stream_batches(spec, batches + 1, learner.device)
    for each in (learner, before):
        learn(each, *warm_up, True)
    size = spec.learner.batch_size
    return alternate(lambda: rate(before, timed, None), lambda: rate(learner, timed, size), rounds)


def main(spec: ServiceSpec = ServiceSpec(), batches: int = 10, rounds: int = 5, partial: int = 5,
         repeats: int = 30, out: Path = Path("benchmarks/results/batch_invariance.json")) -> dict:
    """The learner's rate and single-image predict latency with and without invariance, measured side by side.

    Args:
        spec: Model and stream (the default learner: frozen DINOv2 ViT-S/14 at 84 px, streaming LDA).
        batches: Mini-batches in each timed run.
        rounds: Alternating rounds of each comparison.
        partial: Images in a partial mini-batch.
        repeats: Timed calls of each single-image latency.
        out: JSON result.
    """
    torch.manual_seed(0)
    dev, dtype = spec.placement()
    result = {"spec": spec.as_json(), "learner": learner_cost(spec, batches, rounds, partial),
              "predict": predict_cost(spec, repeats)}
    if dev.type == "cpu":
        result["int8"] = int8_cost(spec, batches, rounds)
    return write_result(result, out, dev, dtype)


def table_rows(r: dict) -> list[Row]:
    """The table's rows: the fixed shape's cost on full and partial mini-batches, single-image predictions free and
    invariant, and the int8 learner per row against per batch (where int8 runs)."""
    learner, predict = r["learner"], r["predict"]
    b, part = learner["batch_size"], learner["partial_images"]
    rows: list[Row] = [
        (f"One image, one feature: the learner with every forward in its fixed shape ({b} images) ÷ free shapes, "
         f"full mini-batches, side by side (samples/s)", fmt(statistics.median(learner["full"]["b_samples_per_s"]),
                                                            "/s"),
         fmt(statistics.median(learner["full"]["a_samples_per_s"]), "/s") + " (free shapes)",
         learner["full"]["ratio"], "≥ 0.97", learner["full"]["ratio"] >= 0.97),
        (f"The same on a partial mini-batch of {part} images (padded to {b})",
         fmt(statistics.median(learner["partial"]["b_samples_per_s"]), "/s"),
         fmt(statistics.median(learner["partial"]["a_samples_per_s"]), "/s") + " (free shapes)",
         learner["partial"]["ratio"], "–", None)]
    for name, what in (("free", "as it comes (the default)"), ("invariant", "--learner.invariant_predictions")):
        rows.append((f"Predict p50, one image, {what} (bare: the backbone's own forward)",
                     f"{predict[f'{name}_ms']:.1f} ms", f"{predict['backbone_ms']:.1f} ms",
                     predict[f"{name}_x_backbone"], "–", None))
    if int8 := r.get("int8"):  # where int8 runs (the CPU)
        rows.append(("int8 learner, activations per row (exact, invariant) ÷ per batch (before), side by side "
                     "(samples/s)", fmt(statistics.median(int8["b_samples_per_s"]), "/s"),
                     fmt(statistics.median(int8["a_samples_per_s"]), "/s") + " (per batch)", int8["ratio"], "–",
                     None))
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI as run

    run(main, as_positional=False)
