"""Predictions while the learner learns, in one process: how long one waits for the model thread, against the bare
forward, and what answering costs the learner.

Why: one thread runs the model (``server.model_thread``), so a prediction that comes during a learning step waits.
The learner's step pauses after each transformer block of its forward (``LearnerState.learn``) to answer what waits
(``ModelThread.run_first``, ``answer_waiting``): the wait is a block of a step, not the whole.

This row runs the service's own learner state (``open_learner``, the spec's model) on decoded mini-batches in its
model thread, while a client thread sends single-image predictions through the service's micro-batcher,
``requests_per_s`` of them (a user's requests, not a flood: each one's forward is model work the learner then does
not do). Each round learns the same mini-batches twice, without requests then with them; the latencies are against
the snapshot's bare forward of the same image with nothing else running (``Snapshot.probabilities``), and the
learner's rate with requests against its rate without. ``--first false`` hands predictions to the back of the model
thread's queue instead, where each waits for the whole step in flight: the same row without the pauses.

Usage:
    python -m benchmarks.rows.predict_while_learning --batches 30 --rounds 5
Writes ``benchmarks/results/predict_while_learning.json``.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.rows.learner_throughput import stream_batches
from benchmarks.tools.service import ServiceSpec, quantiles, timed, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.backbone import BackboneConfig
from mepo_stream.records import RecordMeta
from server.batching import MicroBatcher
from server.config import ServeConfig
from server.learner.book import Sample
from server.learner.state import LearnerState, open_learner
from server.metrics import ServerMetrics

RESULT = Path("benchmarks/results/predict_while_learning.json")


def learner_state(spec: ServiceSpec, work: Path) -> LearnerState:
    """The service's learner state for ``spec``, with no any-time evaluation (extra model work on a test set)."""
    backbone = replace(BackboneConfig(), name=spec.model, weights=spec.weights, img_size=spec.img_size)
    cfg = ServeConfig(data=spec.data, backbone=backbone, mepo=spec.mepo, method=spec.method, learner=spec.learner,
                      checkpoint_dir=work, protocol=ProtocolConfig(eval_period=0))
    return open_learner(cfg, ServerMetrics())


def learn(state: LearnerState, batches: list, ask=None, every_s: float = 0.0) -> tuple[float, list[float]]:
    """Learn ``batches`` one step each in the model thread; the learner's samples/s, and the latencies of the
    predictions ``ask`` (a function timing one) made one every ``every_s`` meanwhile."""
    latencies: list[float] = []
    done = threading.Event()

    def client() -> None:
        latencies.append(ask())  # at least one, however short the learning
        while not done.wait(every_s):
            latencies.append(ask())

    asking = threading.Thread(target=client) if ask is not None else None
    samples = [[Sample(image.cpu(), RecordMeta(int(y), i, i, "bench"))
                for i, (image, y) in enumerate(zip(images, labels, strict=True))] for images, labels in batches]
    if asking is not None:
        asking.start()
    start = time.perf_counter()
    for batch in samples:
        state.model_thread.run(state.learn, batch)
    elapsed = time.perf_counter() - start
    done.set()
    if asking is not None:
        asking.join()
    return sum(len(b) for b in samples) / elapsed, latencies


def main(spec: ServiceSpec = ServiceSpec(), batches: int = 30, rounds: int = 5, requests_per_s: float = 4.0,
         first: bool = True, bare_repeats: int = 50, out: Path = RESULT) -> dict:
    dev, dtype = spec.placement()
    with tempfile.TemporaryDirectory() as work:
        state = learner_state(spec, Path(work))
        data = stream_batches(spec, batches, dev)
        learn(state, data[:2])  # classes seen, a snapshot to answer with, the kernels warm
        image = data[0][0][0].cpu()  # [3, S, S]
        snapshot = state.snapshot
        bare = quantiles(timed(lambda: snapshot.probabilities(image[None]), bare_repeats, dev))
        batcher = MicroBatcher(run=state.model_thread.run_first if first else state.model_thread.run)

        def ask() -> float:
            began = time.perf_counter()
            batcher.run(lambda: state.snapshot, [image])
            return time.perf_counter() - began

        measured = []
        for _ in range(rounds):
            quiet, _ = learn(state, data)
            busy, latencies = learn(state, data, ask, 1 / requests_per_s)
            q = quantiles(latencies)
            measured.append({"rate_quiet": quiet, "rate_busy": busy, "rate_ratio": busy / quiet,
                             "requests": len(latencies), "p50_ratio": q["p50_s"] / bare["p50_s"],
                             "p99_ratio": q["p99_s"] / bare["p50_s"], **q})
        state.model_thread.shutdown()
    summary = {key: statistics.median(r[key] for r in measured) for key in ("p50_ratio", "p99_ratio", "rate_ratio")}
    ranges = {f"{key}_range": [min(r[key] for r in measured), max(r[key] for r in measured)] for key in summary}
    return write_result({"benchmark": "predict_while_learning", "spec": spec.as_json(), "batches": batches,
                         "rounds": rounds, "requests_per_s": requests_per_s, "first": first, "bare_forward": bare,
                         **summary, **ranges, "per_round": measured}, out, dev, dtype)


def table_rows(r: dict) -> list[Row]:
    """p50 and p99 against the bare forward, and the learner's rate while answering, each the median of the rounds
    with their range."""
    how = "between a step's blocks" if r["first"] else "after the whole step"
    rounds = f"median of {r['rounds']} rounds"
    bare = fmt(r["bare_forward"]["p50_s"], "ms")
    rows: list[Row] = []
    for q, goal in (("p50", 3.0), ("p99", 6.0)):
        low, high = r[f"{q}_ratio_range"]
        seconds = statistics.median(x[f"{q}_s"] for x in r["per_round"])
        rows.append((f"Predict {q} while learning, in process, answered {how} ({rounds}, ratios {low:.2f}–{high:.2f})",
                     fmt(seconds, "ms"), bare, r[f"{q}_ratio"], f"≤ {goal}", r[f"{q}_ratio"] <= goal))
    low, high = r["rate_ratio_range"]
    busy, quiet = (statistics.median(x[k] for x in r["per_round"]) for k in ("rate_busy", "rate_quiet"))
    rows.append((f"Learning rate while answering {r['requests_per_s']:g} predictions a second, against none asked "
                 f"({rounds}, ratios {low:.2f}–{high:.2f})",
                 fmt(busy, "/s"), fmt(quiet, "/s"), r["rate_ratio"], "≥ 0.9", r["rate_ratio"] >= 0.9))
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
