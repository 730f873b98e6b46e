"""Learner throughput and memory: ``mepo serve`` learning from a real Kafka topic against a bare PyTorch loop.

The service consumes a Si-Blurry stream that is already in the topic (so it never waits for the producer)
and learns it in one pass: decode, validate, batch, test-then-train prediction, the learner's update,
snapshot publication, checkpoints, metrics and offset commits. Its rate is taken from ``/v1/status``, polled every
0.25 s, between the first poll past 10% of the stream and the last poll before its last whole mini-batch: both
ends while it learns (model loading excluded, and the stream's last partial mini-batch, learned only once the
topic has been idle for a poll, 0.5 s, is the stream's end and not the service's speed). The resident memory of
its process is read at the same two points. Rehearsal-free learning should not grow with the stream.

The bare loop is the service's own ``OnlineLearner`` (built by the same function, with the same configuration,
on the same device, under the same autocast dtype) calling ``observe`` on mini-batches that are already
decoded, batched and on the device: the model work of the service and nothing else. That is one no-grad
forward and a statistics update per mini-batch for a statistics classifier on a host without prompts, and
``online_iter`` augmented Adam steps (plus the statistics forward, if any) for a host trained by gradient. It
runs right before and right after each service run (side by side in one run) and the two rates are averaged.
A shared machine drifts by 10-20 % within minutes, and one such round says little, so the service runs
``rounds`` times, alternated with the bare loop (bare, service, bare, service, ..., bare): each round's ratio is
its service against the bare runs on both sides of it, and the result is the median round, with every round kept.

Four configurations are measured, each against the bare loop doing the same model work:

* ``learn_only`` (``--prequential false``): the bare loop learns only;
* ``prequential`` (the default): the service predicts each mini-batch before learning it (test-then-train
  accuracy and drift detection), one extra eval forward per mini-batch, which the bare loop then does too;
* ``paper_recipe``: the paper's MISA with the SGD-trained linear head (``online_iter`` Adam steps per
  mini-batch), the expensive configuration, with test-then-train prediction;
* ``int8_learn_only`` (on the CPU): ``learn_only`` with the backbone's Linear layers in int8
  (``--learner.precision int8``), against the bare loop with the same int8 backbone.

Usage:
    python -m benchmarks.rows.learner_throughput --spec.mepo runs/refined_dinov2_84
Writes ``benchmarks/results/learner_throughput.json``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.tools.camera_streams import SIZES, camera_folder
from benchmarks.tools.service import ServiceSpec, bare_learner, paper_recipe, running_service, seconds, write_result
from benchmarks.tools.table import Row, fmt, spread
from mepo_stream.data import DataConfig, list_files, load_split
from mepo_stream.images import decode_images
from mepo_stream.learner import OnlineLearner
from server.config import ServeConfig

Batch = tuple[torch.Tensor | list[bytes], torch.Tensor]
"""A mini-batch of the bare loop: uint8 images [B, 3, S, S] on the device (or their encoded bytes), and labels."""


def stream_batches(spec: ServiceSpec, batches: int, dev: torch.device, encoded: bool = False) -> list[Batch]:
    """``batches`` random mini-batches of the stream as the learner gets them from the service: uint8 images
    decoded at the service's size (already on ``dev`` here), or, ``encoded``, the files' bytes as the records carry
    them; and original labels (on the CPU, as the service's)."""
    if encoded:
        listing = list_files(spec.data, "train")
        blobs, targets = [f.read_bytes() for f in listing.files], torch.tensor(listing.targets)
        return [([blobs[i] for i in idx.tolist()], targets[idx]) for idx in _draws(len(blobs), spec, batches)]
    data = load_split(replace(spec.data, load_size=spec.limits.size), "train")
    return [(data.images[idx].to(dev), data.targets[idx]) for idx in _draws(len(data), spec, batches)]


def _draws(n: int, spec: ServiceSpec, batches: int) -> list[torch.Tensor]:
    """Indices of ``batches`` mini-batches of a seeded permutation of ``n`` samples, from its start again when it
    runs out."""
    perm, size = torch.randperm(n, generator=torch.Generator().manual_seed(0)), spec.learner.batch_size
    return [perm[torch.arange(b * size, (b + 1) * size) % n] for b in range(batches)]


def decoded(spec: ServiceSpec, images: torch.Tensor | list[bytes], dev: torch.device) -> torch.Tensor:
    """A mini-batch's images on ``dev``, decoded first where they are bytes, as the service's intake decodes them
    (``decode_images``: JPEGs on the GPU beside a CUDA model, each on the CPU otherwise)."""
    if isinstance(images, torch.Tensor):
        return images
    return torch.stack(decode_images(images, spec.limits, dev)).to(dev)  # [B, 3, S, S]


def learn(learner: OnlineLearner, images: torch.Tensor, labels: torch.Tensor, prequential: bool) -> None:
    """One mini-batch as the service learns it (``Alone.update``): encoded once where nothing trains the encoder,
    scored for the novelty threshold, predicted first under test-then-train, then observed."""
    encoded = None if learner.trains_by_gradient else learner.encode(images)
    if prequential:
        learner.test_then_train(images, labels, ServeConfig.alignment.inference_mode, encoded)
        return
    if learner.novelty_threshold is not None:
        learner.observe_novelty(learner.encode(images) if encoded is None else encoded, labels)
    learner.observe(images, labels, encoded)


WARM_UP_BATCHES = 3
"""Untimed mini-batches before a bare run: a GPU's first ones set up its libraries. After a single one, the H200's
first bare run in a process went at a third of the later runs' rate; three are not yet checked on a GPU."""


def bare_rate(spec: ServiceSpec, batches: int, prequential: bool, decodes: bool = False) -> float:
    """Samples/s of the bare learner (``bare_run``)."""
    return bare_run(spec, batches, prequential, decodes)[0]


def bare_run(spec: ServiceSpec, batches: int, prequential: bool, decodes: bool = False) -> tuple[float, float]:
    """Samples/s and CPU milliseconds per sample (this process's, every thread) of the bare learner over ``batches``
    mini-batches, after ``WARM_UP_BATCHES``; ``decodes``: each mini-batch decoded from its bytes first, the decode
    timed with the learning."""
    learner = bare_learner(spec, len(list_files(spec.data, "train").classes))
    dev = learner.device
    drawn = stream_batches(spec, batches + WARM_UP_BATCHES, dev, encoded=decodes)
    warm_up, timed = drawn[:WARM_UP_BATCHES], drawn[WARM_UP_BATCHES:]
    for images, labels in warm_up:
        learn(learner, decoded(spec, images, dev), labels, prequential)

    def run() -> None:
        for images, labels in timed:
            learn(learner, decoded(spec, images, dev), labels, prequential)

    n, cpu = batches * spec.learner.batch_size, time.process_time()
    wall = seconds(run, learner.device)
    return n / wall, 1000 * (time.process_time() - cpu) / n


def measure(spec: ServiceSpec, prequential: bool, bare_batches: int, rounds: int, work: Path,
            bare_decodes: bool = False) -> dict:
    """``rounds`` service runs alternated with bare runs; the median round's rates and memory, and every round."""
    bares = [bare_run(spec, bare_batches, prequential, bare_decodes)]
    runs = []
    for r in range(rounds):
        runs.append(service_round(spec, prequential, work / f"round{r}"))
        bares.append(bare_run(spec, bare_batches, prequential, bare_decodes))
    return {"method": spec.method, "classifier": spec.learner.classifier, "prequential": prequential,
            "bare_decodes": bare_decodes, "bare_cpu_ms_per_sample": statistics.median(c for _, c in bares),
            **median_round(runs, [rate for rate, _ in bares])}


def median_round(runs: list[dict], bares: list[float]) -> dict:
    """Each service run against the bare runs on both sides of it (``bares`` has one more entry than ``runs``):
    the median round's fields, the range of the ratios, and every round.

    Example:
        >>> r = median_round([{"service_samples_per_s": s} for s in (90.0, 80.0, 99.0)], [100.0, 100.0, 100.0, 80.0])
        >>> r["service_samples_per_s"], r["bare_before_after"], r["ratio"], r["ratio_range"]
        (90.0, [100.0, 100.0], 0.9, [0.8, 1.1])
    """
    for run, before, after in zip(runs, bares[:-1], bares[1:], strict=True):
        run.update(bare_before_after=[before, after], bare_samples_per_s=(before + after) / 2)
        run["ratio"] = run["service_samples_per_s"] / run["bare_samples_per_s"]
    ratios = sorted(run["ratio"] for run in runs)
    median = next(run for run in runs if run["ratio"] == ratios[(len(ratios) - 1) // 2])
    return {**median, "ratio_range": [ratios[0], ratios[-1]], "rounds": runs}


def service_round(spec: ServiceSpec, prequential: bool, work: Path) -> dict:
    """One service run on the whole stream: its learning rate and resident memory at 10% and 100% of it."""
    with running_service(replace(spec, extra=(*spec.extra, "--prequential", str(prequential).lower())),
                         work) as service:
        n = service.stream_length
        status = service.wait_learned(n)
    (t0, s0, rss0, cpu0), (t1, s1, rss1, cpu1) = learning_window(service.trace, n, spec.learner.batch_size)
    return {"service_samples_per_s": (s1 - s0) / (t1 - t0), "cpu_ms_per_sample": 1000 * (cpu1 - cpu0) / (s1 - s0),
            "rss_bytes_at_10pct": rss0, "rss_bytes_at_100pct": rss1,
            "rss_growth": (rss1 - rss0) / rss0, "measured_between_samples": [s0, s1],
            "dead_lettered": status["dead_lettered"]}


def learning_window(trace: list[tuple[float, int, int]], n: int, batch_size: int) -> tuple[tuple, tuple]:
    """Two status polls while the service learns: the first past 10% of the stream and the last before its last
    whole mini-batch (the last partial one waits for the topic to go idle). A stream too short to be polled twice
    while it is learned (the smoke run) gets the first poll and the last.

    Example:
        >>> learning_window([(0.0, 0, 1), (1.0, 320, 1), (2.0, 640, 1), (3.0, 992, 1), (4.0, 1000, 1)], 1000, 32)
        ((1.0, 320, 1), (2.0, 640, 1))
    """
    whole = n - n % batch_size
    start = next(p for p in trace if p[1] >= 0.1 * n)
    during = [p for p in trace if start[1] < p[1] < whole]
    return (start, during[-1]) if during else (trace[0], trace[-1])


ON_REQUEST = ("librdkafka_learn_only",)
"""Configurations measured only when named: the client matters beside a nearly free model (``learner_overhead``)."""


def configurations(spec: ServiceSpec) -> dict[str, tuple[ServiceSpec, bool]]:
    """The measured configurations: name -> (spec, test-then-train prediction); on the CPU also the default
    learning only with its backbone in int8 (``--learner.precision int8``, against its own int8 bare loop)."""
    known = {"learn_only": (spec, False), "prequential": (spec, True), "paper_recipe": (paper_recipe(spec), True),
             "librdkafka_learn_only": (replace(spec, extra=(*spec.extra, "--consumer", "librdkafka")), False)}
    if spec.placement()[0].type == "cpu":
        known["int8_learn_only"] = (replace(spec, learner=replace(spec.learner, precision="int8")), False)
    return known


def main(spec: ServiceSpec = ServiceSpec(), eval_period: int = 0, bare_batches: int = 8, rounds: int = 3,
         configs: tuple[str, ...] | None = None, camera: str | None = None,
         work: Path = Path("benchmarks/results/work/learner"),
         out: Path = Path("benchmarks/results/learner_throughput.json")) -> dict:
    """Measure the service's learning rate and memory against the bare loop, in each configuration.

    Args:
        spec: Stream, model, learner configuration and MePo bundle of the service under test.
        camera: Stream the dataset's images upscaled to this camera size (e.g. 1280x960) as JPEGs, built here once
            (``benchmarks.tools.camera_streams``, 5 test images a class).
        eval_period: The service's any-time evaluation period (0 = off: it is extra model work on the test set,
            which the bare loop does not do).
        bare_batches: Timed mini-batches of each bare run.
        rounds: Service runs per configuration, each between two bare runs; the median round is reported.
        configs: The configurations to measure (null: learn_only, prequential, paper_recipe and, on the CPU,
            int8_learn_only; librdkafka_learn_only, the learner reading with ``--consumer librdkafka``, when named).
        work: Broker and service logs and the service's checkpoint.
        out: JSON result path.
    """
    torch.manual_seed(0)
    if camera is not None:
        data = DataConfig(spec.dataset, train_per_class=spec.train_per_class, test_per_class=5)
        spec = replace(spec, dataset=str(camera_folder(data, *SIZES[camera])))
    spec = replace(spec, extra=(*spec.extra, "--protocol.eval_period", str(eval_period)))
    known = configurations(spec)
    if unknown := set(configs or ()) - set(known):
        raise ValueError(f"unknown configuration(s) {sorted(unknown)}; choose from {', '.join(known)}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    chosen = configs if configs is not None else [name for name in known if name not in ON_REQUEST]
    measured = {name: measure(s, prequential, bare_batches, rounds, work / name)
                for name, (s, prequential) in known.items() if name in chosen}
    return write_result({
        "benchmark": "learner_throughput", "spec": spec.as_json(),
        "stream_samples": len(list_files(spec.data, "train").files), "batch_size": spec.learner.batch_size,
        "online_iter": spec.learner.online_iter, "eval_period": eval_period, **measured,
    }, out, *spec.placement())


def table_rows(r: dict) -> list[Row]:
    """The table's rows of a result: each configuration it measured (the service against its own bare loop), and
    the memory of the test-then-train run."""
    rows: list[Row] = []
    for name in ("learn_only", "librdkafka_learn_only", "prequential", "paper_recipe", "int8_learn_only"):
        if c := r.get(name):  # the configurations a row measures (int8 on the CPU only; the smoke run: the first)
            recipe = {"paper_recipe": " (the paper's recipe)", "int8_learn_only": ", int8 backbone",
                      "librdkafka_learn_only": ", read with librdkafka"}.get(name, "")
            what = "with test-then-train prediction" if c["prequential"] else "learning only"
            dtype = "int8" if name == "int8_learn_only" else r["machine"]["dtype"]
            cpu = ("" if "cpu_ms_per_sample" not in c else
                   f"; CPU {c['cpu_ms_per_sample']:.2f} ms a sample, its loop {c['bare_cpu_ms_per_sample']:.2f}")
            rows.append((f"Learner throughput from Kafka, {c['method']} + {c['classifier']}{recipe}, {what} "
                         f"(samples/s{spread(c)}{cpu})", fmt(c["service_samples_per_s"], "/s"),
                         f"{fmt(c['bare_samples_per_s'], '/s')} (its loop, {dtype})", c["ratio"], "≥ 0.90",
                         c["ratio"] >= 0.9))
    if c := r.get("prequential"):
        rows.append(("Learner memory (RSS) at 10% → 100% of the stream",
                     f"{fmt(c['rss_bytes_at_10pct'], 'MB')} → {fmt(c['rss_bytes_at_100pct'], 'MB')}", "–",
                     c["rss_growth"], "growth < 0.05", c["rss_growth"] < 0.05))
    return rows


def overhead_rows(r: dict) -> list[Row]:
    """The learner rows of the nearly free model, whose goal is lower: the per-sample work of a Python service
    (Kafka's record parsing, the claims) is most of what it does."""
    what = f"nearly free model ({r['spec']['model']} @ {r['spec']['img_size']} px)"
    return [(text.replace("Learner throughput from Kafka", f"Learner throughput from Kafka, {what}"), ours, bare,
             ratio, "≥ 0.70", ratio is not None and ratio >= 0.7)
            for text, ours, bare, ratio, _, _ in table_rows(r) if not text.startswith("Learner memory")]


def camera_rows(r: dict, decoded: str) -> list[Row]:
    """The learner rows of a camera stream, named by where its JPEGs decode (no memory row: one short round)."""
    what = f"{r['stream_samples']} 1280x960 JPEGs {decoded}, {r['spec']['model']} @ {r['spec']['img_size']} px"
    return [(text.replace("Learner throughput from Kafka", f"Learner throughput from Kafka, {what}"), *rest)
            for text, *rest in table_rows(r) if not text.startswith("Learner memory")]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
