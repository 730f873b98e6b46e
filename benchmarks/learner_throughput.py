"""Learner throughput and memory: ``mepo serve`` learning from a real Kafka topic against a bare PyTorch loop.

The service consumes a Si-Blurry stream that is already in the topic (so it never waits for the producer)
and learns it in one pass: decode, validate, batch, test-then-train prediction, ``online_iter`` Adam steps with
augmentation, snapshot publication, checkpoints, metrics and offset commits. Its rate is taken between 10% and
100% of the stream (model loading excluded), from ``/v1/status`` polled every 0.25 s; the resident memory of
its process is read at the same two points. Rehearsal-free learning should not grow with the stream.

The bare loop is the same model (backbone, host method, Meta Cov alignment) and the same Adam doing the same
forward, masked cross-entropy, backward and step ``online_iter`` times per mini-batch, on pre-transformed float
tensors already in memory. It runs right before and right after the service (side by side in one run) and the
two rates are averaged.

Two service configurations are measured, each against the bare loop doing the same model work:

* ``learn_only`` (``--cfg.prequential false``): the bare loop trains only;
* ``prequential`` (the default): the service predicts each mini-batch before learning it (test-then-train
  accuracy and drift detection), one extra eval forward per mini-batch, which the bare loop then does too.

Usage:
    python benchmarks/learner_throughput.py --spec.mepo runs/refined_dinov2_84
Writes ``benchmarks/results/learner_throughput.json``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.service import ServiceSpec, bare_method, running_service, write_result
from mepo_stream.backbone import normalization
from mepo_stream.data import list_files, load_split
from mepo_stream.learner import LearnerConfig
from mepo_stream.transforms import test_transform


def bare_rate(spec: ServiceSpec, cfg: LearnerConfig, batches: int, prequential: bool) -> float:
    """Samples/s of the bare loop over ``batches`` mini-batches (after one warm-up batch); with ``prequential``
    each mini-batch is first predicted by an eval forward, as the service's test-then-train step does."""
    data = load_split(spec.data, "train")
    method = bare_method(spec, len(data.classes)).train()
    batch_size = cfg.batch_size
    optimizer = torch.optim.Adam(method.param_groups(cfg.lr), lr=cfg.lr)
    tf = test_transform(spec.img_size, *normalization(method.backbone))
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    xs, ys = [], []
    for b in range(batches + 1):
        idx = perm[b * batch_size: (b + 1) * batch_size]
        xs.append(tf(data.images[idx]))  # [B, 3, S, S] float, in memory
        ys.append(data.targets[idx])
    start = 0.0
    for b, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if b == 1:
            start = time.perf_counter()  # after the warm-up batch
        mask = torch.full((len(data.classes),), float("-inf"))
        mask[y.unique()] = 0.0
        if prequential:
            with torch.no_grad():
                method.eval()
                method(x, align_mode="running")[0].argmax(1)
                method.train()
        for _ in range(cfg.online_iter):
            logits, aux = method(x, slot=0)  # [B, C]
            loss = F.cross_entropy(logits + mask, y) + aux
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return batches * batch_size / (time.perf_counter() - start)


def measure(spec: ServiceSpec, prequential: bool, bare_batches: int, work: Path) -> dict:
    """Bare loop, the service on the whole stream, bare loop again; rates and the service's memory."""
    cfg = LearnerConfig()  # what the service runs with
    before = bare_rate(spec, cfg, bare_batches, prequential)
    spec = replace(spec, extra=(*spec.extra, "--cfg.prequential", str(prequential).lower()))
    with running_service(spec, work) as service:
        n = service.stream_length
        status = service.wait_learned(n)
    after = bare_rate(spec, cfg, bare_batches, prequential)
    t0, s0, rss0 = next(p for p in service.trace if p[1] >= 0.1 * n)
    t1, s1, rss1 = service.trace[-1]
    service_rate, bare = (s1 - s0) / (t1 - t0), (before + after) / 2
    return {"service_samples_per_s": service_rate, "bare_samples_per_s": bare, "bare_before_after": [before, after],
            "ratio": service_rate / bare, "rss_bytes_at_10pct": rss0, "rss_bytes_at_100pct": rss1,
            "rss_growth": (rss1 - rss0) / rss0, "measured_between_samples": [s0, s1],
            "dead_lettered": status["dead_lettered"]}


def main(spec: ServiceSpec = ServiceSpec(), eval_period: int = 0, bare_batches: int = 8,
         work: Path = Path("benchmarks/results/work/learner"),
         out: Path = Path("benchmarks/results/learner_throughput.json")) -> dict:
    """Measure the service's learning rate and memory against the bare loop, in both configurations.

    Args:
        spec: Stream, model and MePo bundle of the service under test.
        eval_period: The service's any-time evaluation period (0 = off: it is extra model work on the test set,
            which the bare loop does not do).
        bare_batches: Timed mini-batches of each bare run.
        work: Broker and service logs and the service's checkpoint.
        out: JSON result path.
    """
    torch.manual_seed(0)
    spec = replace(spec, extra=(*spec.extra, "--cfg.eval_period", str(eval_period)))
    configs = {name: measure(spec, prequential, bare_batches, work / name)
               for name, prequential in (("learn_only", False), ("prequential", True))}
    return write_result({
        "benchmark": "learner_throughput", "spec": {**spec.__dict__, "mepo": str(spec.mepo)},
        "stream_samples": len(list_files(spec.data, "train").files), "batch_size": LearnerConfig.batch_size,
        "online_iter": LearnerConfig.online_iter,
        "eval_period": eval_period, **configs,
    }, out)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
