"""Learning scaled out: two learners in a group against one learner, on the same stream already in Kafka.

Each learner is ``mepo serve --kafka.state_topic ...`` in its own process with one torch thread, pinned to a core
of its own (``taskset``); the single learner runs alone on one core with one thread. The stream (``--spec``'s
images, dealt round-robin over 4 partitions) is in Kafka before the learners start; each learner's own samples
(``mepo_samples_learned_total``) are polled, and the aggregate rate counts the samples learned from the moment
every learner owns partitions (the group has settled: the first learner to start learns alone until then) to the
poll that finds the whole stream learned.

The reference is the machine's own limit: the bare learner loop (``benchmarks.rows.learner_throughput``'s, the same
model and test-then-train on decoded batches) in one process against two at once, one core and one thread each.
On a VM two vCPUs need not scale 2x even for bare PyTorch (shared caches, memory bandwidth, the host's SMT), so the
result is the learners' ratio next to that limit (``of_limit``: 2 ÷ 1 learners over 2 ÷ 1 bare loops).

Sized to the machine: every timed run lasts at least ``--min_seconds`` (30 s by default). The bare loops run first,
that long each; the stream is then sized from their rate so that the pair learns that long after its group has
settled (and the single learner, about twice as long). A fixed stream measured start-up on a fast machine.

Also checked on the real model: the two groups' merged sums (read from their state topics) against each other,
the shrinkage each chose from its summed prequential hits, and the A_last of each at both choices.

Also measured, from the learners' metrics: the merge cost per model change (``mepo_state_merge_duration_seconds``),
the cost of writing its partition states (``mepo_checkpoint_duration_seconds``) and the bytes written per learner
per second. "On paper" extrapolates the merge and publish costs to N learners (one partition each), L classes
and D dimensions (``on_paper``) from the per-element cost of adding sums, measured here, and the single learner's
rate.

Usage:
    python -m benchmarks.rows.scale_out --out benchmarks/results/scale_out.json
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch

from benchmarks.rows.learner_throughput import learn, stream_batches
from benchmarks.tools.common import wait_until
from benchmarks.tools.service import CLI, ROOT, ServiceSpec, bare_learner, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.cli import config_options
from mepo_stream.data import list_files, load_split
from mepo_stream.kafka import KafkaConfig, ensure_topics
from mepo_stream.label_statistics import LabelStatistics
from server.broker import EmbeddedBroker, free_port
from server.learner.changelog import Changelog

PARTITIONS = 4
"""Partitions of the benchmark's topic, as in the scale-out recipe (two per learner of the pair)."""
BARE_BATCHES = 20
"""Mini-batches a bare loop cycles through (decoded once, before the clock starts)."""
SHAPES = [(n, classes, dim) for n in (2, 10, 100) for classes, dim in ((10, 384), (100, 384), (1000, 768))]


def _metric(text: str, name: str) -> float:
    """A sample's value in a Prometheus exposition (0 when absent)."""
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram in a Prometheus exposition."""
    return _metric(text, f"{name}_sum"), _metric(text, f"{name}_count")


def _learner(spec: ServiceSpec, kafka: KafkaConfig, group: str, core: int, work: Path) -> tuple[subprocess.Popen, str]:
    """``mepo serve`` of ``group`` pinned to ``core`` with one thread; its process and URL."""
    port = free_port()
    args = ["taskset", "-c", str(core), *CLI, "serve", "--kafka.bootstrap_servers", kafka.bootstrap_servers,
            "--kafka.topic", kafka.topic,
            "--kafka.group_id", group, "--kafka.state_topic", f"state-{group}", "--kafka.snapshot_topic", "null",
            "--data.dataset", spec.dataset, "--data.train_per_class", str(spec.train_per_class),
            "--backbone.name", spec.model, "--backbone.weights", spec.weights or "null",
            "--backbone.img_size", str(spec.img_size), "--method", spec.method,
            *config_options(spec.learner, "--learner."), "--protocol.eval_period", "0",
            "--checkpoint_dir", str(work / f"{group}-{core}"), "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(work / f"{group}-{core}.log", "wb") as log:  # the child holds its own handle
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return process, f"http://127.0.0.1:{port}"


def run_group(spec: ServiceSpec, bootstrap: str, learners: int, n: int, work: Path) -> dict:
    """``learners`` learners of one group, one core each, on the stream already in Kafka; timed from the moment
    every learner owns partitions (the group has settled) until the stream is learned."""
    group = f"g{learners}-{free_port()}"
    kafka = KafkaConfig(bootstrap_servers=bootstrap, topic=f"images-{group}")
    ensure_topics(kafka, kafka.topic, partitions=PARTITIONS)
    subprocess.run([*CLI, "produce", "--data.dataset", spec.dataset, "--data.train_per_class",
                    str(spec.train_per_class), "--kafka.bootstrap_servers", bootstrap, "--kafka.topic",
                    kafka.topic, "--replay.partition_by", "position"], check=True, capture_output=True,
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    procs = [_learner(spec, kafka, group, core, work) for core in range(learners)]
    clients = [httpx.Client(base_url=url, timeout=30) for _, url in procs]

    def learned() -> float:
        return sum(_metric(c.get("/metrics").text, "mepo_samples_learned_total") for c in clients)

    try:
        processes = [proc for proc, _ in procs]
        wait_until(lambda: all(_metric(c.get("/metrics").text, "mepo_partitions_owned") > 0 for c in clients),
                   "every learner to own partitions", 600, processes=processes)
        start, before = time.monotonic(), learned()
        if before >= n:
            raise RuntimeError(f"all {n} samples were learned before the group settled: stream more images "
                               f"(--spec.train_per_class)")
        wait_until(lambda: learned() >= n, f"{n} samples learned", 3600, processes=processes)
        wall = time.monotonic() - start
        wait_until(lambda: all(_metric(c.get("/metrics").text, "mepo_state_records_written_total") > 0
                               for c in clients), "every learner's states written once the topic idles", 120)
        texts = [c.get("/metrics").text for c in clients]
    finally:
        for c in clients:
            c.close()
        for proc, _ in procs:
            proc.terminate()
            proc.wait(120)
    merges = [_histogram(t, "mepo_state_merge_duration_seconds") for t in texts]
    writes = [_histogram(t, "mepo_checkpoint_duration_seconds") for t in texts]
    states = Changelog(replace(kafka, state_topic=f"state-{group}")).read_all()
    merged = LabelStatistics.total(state.stats for state in states.values())
    return {"learners": learners, "samples": int(n - before), "seconds": wall, "samples_per_s": (n - before) / wall,
            "merged": merged,
            "merge_s_per_change": sum(s for s, _ in merges) / max(sum(c for _, c in merges), 1),
            "state_write_s": sum(s for s, _ in writes) / max(sum(c for _, c in writes), 1),
            "state_bytes_per_learner_per_s": [_metric(t, "mepo_state_written_bytes_total") / wall for t in texts]}


def _bare_worker(spec: ServiceSpec, core: int, seconds: float, barrier, results) -> None:
    """The bare learner (``benchmarks.rows.learner_throughput``'s) on one core with one thread, timed for ``seconds``
    (at least one mini-batch) after all workers have warmed up (the barrier), so their timed loops overlap."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    learner = bare_learner(spec, len(list_files(spec.data, "train").classes))
    warm_up, *timed = stream_batches(spec, BARE_BATCHES + 1, learner.device)
    learn(learner, *warm_up, True)
    barrier.wait()
    start, done = time.perf_counter(), 0
    while done == 0 or time.perf_counter() - start < seconds:  # one mini-batch at least
        learn(learner, *timed[done % len(timed)], True)
        done += 1
    results.put(done * spec.learner.batch_size / (time.perf_counter() - start))


def bare_scaling(spec: ServiceSpec, workers: int, seconds: float) -> float:
    """Aggregate samples/s of ``workers`` bare learners at once for ``seconds``, one core and one thread each:
    what the machine gives two processes, the limit of two learners on it."""
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_bare_worker, args=(spec, core, seconds, barrier, results))
             for core in range(workers)]
    for proc in procs:
        proc.start()
    rates = [results.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join()
    return sum(rates)


def stream_size(spec: ServiceSpec, pair_rate: float, seconds: float) -> int:
    """Images per class for the pair of learners to learn ``seconds`` after its group settles, at ``pair_rate``
    (the two bare loops' samples/s): half again as many, for the samples the first learner learns alone while the
    second joins; at least ``spec.train_per_class``, at most what the dataset has."""
    classes = len(list_files(spec.data, "train").classes)
    wanted = max(spec.train_per_class, math.ceil(1.5 * pair_rate * seconds / classes))
    return len(list_files(replace(spec.data, train_per_class=wanted), "train").files) // classes


def same_model(spec: ServiceSpec, one: LabelStatistics, two: LabelStatistics, test_per_class: int) -> dict:
    """How far apart the two groups' merged sums are (largest relative difference), which shrinkage each chose
    from its summed prequential hits, and the test accuracy (A_last) of each at its own and at the other's."""
    differences = {name: float((getattr(one, name) - getattr(two, name)).abs().max() / getattr(one, name).abs().max())
                   for name in ("counts", "sums", "second")}
    learner = bare_learner(spec, len(list_files(spec.data, "train").classes))
    test = load_split(replace(spec.data, test_per_class=test_per_class, load_size=spec.limits.size), "test")
    h = torch.cat([learner.encode(test.images[i:i + 128]).feature for i in range(0, len(test), 128)])  # [N, D]
    out: dict = {"relative_difference": differences, "test_images": len(test)}
    for name, stats in (("one", one), ("two", two)):
        learner.load_statistics(stats)
        lda = learner.method.classifier
        accuracy = [float((learner.to_labels(lda.scores(h, k).argmax(1)) == test.targets).float().mean())
                    for k in range(len(lda.shrinkage))]
        predictions = [learner.to_labels(lda.scores(h, k).argmax(1)) for k in range(len(lda.shrinkage))]
        out[name] = {"shrinkage": float(lda.shrinkage[lda.chosen]), "a_last": accuracy[lda.chosen],
                     "a_last_per_shrinkage": accuracy, "hits": lda.hits.tolist()}
        out.setdefault("_predictions", []).append(predictions)
    first, second = out.pop("_predictions")
    out["identical_predictions_per_shrinkage"] = [bool(torch.equal(a, b)) for a, b in zip(first, second, strict=True)]
    return out


def add_cost_per_element(repeats: int = 5) -> float:
    """Seconds per float64 element to add partitions' sums (``LabelStatistics.total``), at 100 classes x 384."""
    parts = [LabelStatistics.zeros(100, 384, 4) for _ in range(8)]
    elements = 8 * (100 + 100 * 384 + 384 * 384 + 4)
    best = min(_timed(lambda: LabelStatistics.total(parts)) for _ in range(repeats))
    return best / elements


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def on_paper(per_element: float, rate: float, every: int = 512) -> list[dict]:
    """Costs for N learners (one partition each), L classes and D dimensions, each learner learning ``rate``
    samples/s and writing its partition's state every ``every`` samples (``--checkpoint_every``):

    * ``state_bytes``: one partition state (its sums in float64; the learned ids aside);
    * ``merge_s``: one remote state folded in (its part replaced in the remote total: 2 parts' additions, plus a
      fresh sum of N parts every N replacements: about 3 parts, whatever N), then the total loaded (1 part);
    * ``step_merge_s``: per learning step, the own partition added to the remote total and loaded (3 parts);
    * ``merge_share``: the share of one core every learner spends merging the others' states (N - 1 of them,
      each ``rate / every`` times a second);
    * ``incoming_bytes_per_s``: what every learner reads from the state topic.
    """
    rows = []
    for n, classes, dim in SHAPES:
        elements = classes + classes * dim + dim * dim + 4
        part_s, updates_per_s = per_element * elements, (n - 1) * rate / every
        rows.append({"learners": n, "classes": classes, "dim": dim, "state_bytes": 8 * elements,
                     "merge_s": 4 * part_s, "step_merge_s": 3 * part_s, "merge_share": 4 * part_s * updates_per_s,
                     "incoming_bytes_per_s": 8 * elements * updates_per_s})
    return rows


def main(spec: ServiceSpec = ServiceSpec(), min_seconds: float = 30.0, test_per_class: int = 100,
         out: Path = Path("benchmarks/results/scale_out.json"),
         work: Path = Path("benchmarks/results/work/scale_out")) -> dict:
    """Two learners (one thread, one core each) against one, on the same stream; the same for the bare learner
    loop (the machine's own limit for two processes); and the costs on paper. Every timed run lasts at least
    ``min_seconds`` on the machine at hand: the bare loops run that long, and the stream is sized from their rate.

    Args:
        spec: Model and stream (the default learner: frozen backbone, streaming LDA; no bundle). Its
            ``train_per_class`` is the stream's least size; more where ``min_seconds`` needs it.
        min_seconds: The shortest timed run (0: one mini-batch per bare loop, and the stream as ``spec`` says).
        test_per_class: Test images per class for the A_last of each group's model.
        out: JSON result.
        work: Logs and checkpoints.
    """
    spec = replace(spec, mepo=None)  # Meta Cov's running statistics cannot be merged: the default head without it
    work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    bare = {str(k): bare_scaling(spec, k, min_seconds) for k in (1, 2)}
    spec = replace(spec, train_per_class=stream_size(spec, bare["2"], min_seconds))
    n = len(list_files(spec.data, "train").files)
    with EmbeddedBroker(log_path=work / "broker.log") as broker:
        one = run_group(spec, broker.bootstrap, 1, n, work)
        two = run_group(spec, broker.bootstrap, 2, n, work)
    exact = same_model(spec, one.pop("merged"), two.pop("merged"), test_per_class)
    per_element = add_cost_per_element()
    ratio, bare_ratio = two["samples_per_s"] / one["samples_per_s"], bare["2"] / bare["1"]
    result = {"spec": spec.as_json(), "stream_samples": n, "min_seconds": min_seconds,
              "long_enough": min(one["seconds"], two["seconds"]) >= min_seconds, "one": one, "two": two,
              "ratio": ratio, "bare_samples_per_s": bare, "bare_ratio": bare_ratio, "of_limit": ratio / bare_ratio,
              "same_model": exact, "add_s_per_element": per_element,
              "on_paper": on_paper(per_element, one["samples_per_s"])}
    return write_result(result, out, *spec.placement())


def table_rows(r: dict) -> list[Row]:
    """The table's rows: two learners over one against the machine's own limit, and that limit."""
    one, two = r["one"], r["two"]
    bare = r["bare_samples_per_s"]
    return [("Learning scaled out: 2 learners (1 thread, 1 core each) on 4 partitions, ÷ 1 learner (samples/s), "
             f"over the machine's 2 ÷ 1 limit (runs ≥ {r['min_seconds']:.0f} s)", fmt(two["samples_per_s"], "/s"),
             fmt(one["samples_per_s"], "/s") + " (1 learner)", r["of_limit"], "≥ 0.95",
             r["of_limit"] >= 0.95 and r["long_enough"]),
            ("The machine's limit: 2 bare learner loops at once (1 thread, 1 core each), ÷ 1 (samples/s)",
             fmt(bare["2"], "/s"), fmt(bare["1"], "/s") + " (1 loop)", r["bare_ratio"], "–", None)]


if __name__ == "__main__":
    from jsonargparse import CLI as run

    run(main, as_positional=False)
