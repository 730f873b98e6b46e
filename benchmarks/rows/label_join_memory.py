"""Memory of labels that come later: the join's store stays within its bound, and the learner's resident memory
stays flat over a stream ten times longer, where 30 % of the labels never come.

The learner's own state (``server.learner.state.LearnerState``, the default frozen host + streaming LDA, with
``--kafka.labels_topic``) takes the records in polls of a mini-batch, as the loop hands them over (no broker: the
broker's memory is not the learner's): each image without its label, and its label 50-200 records later on the
labels topic, or never (30 %). The images are small JPEGs at the benchmark resolution, drawn once and reused (decoding
is per record); record time advances 10 ms per image. Resident memory is sampled every ``sample_every`` records,
with the store's size; the result compares the stream's first ``n`` records with the ten times longer run.

Usage:
    python -m benchmarks.rows.label_join_memory         # ViT-S/14 features (384-d), 5,000 and 50,000 images
    python -m benchmarks.rows.label_join_memory --n 500 --max_images 200   # smoke sizes
Writes ``benchmarks/results/label_join_memory.json``.
"""

from __future__ import annotations

import io
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image

from benchmarks.tools.service import rss_bytes, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.backbone import BackboneConfig
from mepo_stream.data import DataConfig
from mepo_stream.images import ImageLimits
from mepo_stream.kafka import KafkaConfig
from mepo_stream.label_delay import label_schedule
from mepo_stream.label_join import JoinConfig
from mepo_stream.records import label_headers, record_headers
from server.allocator import keep_freed_memory
from server.config import ServeConfig
from server.learner.state import open_learner
from server.metrics import ServerMetrics

IMAGES, LABELS = "images", "labels"


class Record(NamedTuple):
    """What the learner reads of a kafka-python ConsumerRecord."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def jpegs(size: int, count: int = 16) -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        pixels = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy()
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG")
        out.append(buf.getvalue())
    return out


def stream(n: int, size: int, delay: tuple[int, int], loss: float, n_classes: int):
    """Records in the order a consumer reads them: each image, then the labels due after it."""
    rng, values = random.Random(1), jpegs(size)
    due: dict[int, list[int]] = {}
    for position, at in enumerate(label_schedule(n, delay[0], delay[1], loss, seed=1)):
        if at is not None:
            due.setdefault(at, []).append(position)
    labels = [rng.randrange(n_classes) for _ in range(n)]
    label_offset = 0
    for position in range(n + delay[1] + 1):
        stamp = 1_700_000_000_000 + 10 * position  # ms: 10 ms of record time per image
        if position < n:
            headers = record_headers(None, position, position, "bench", "synthetic", id=f"bench/{position}")
            yield Record(IMAGES, 0, position, stamp, b"", values[position % len(values)], headers)
        for p in due.pop(position, []):
            yield Record(LABELS, 0, label_offset, stamp, b"", b"", label_headers(f"bench/{p}", labels[p]))
            label_offset += 1


def run(cfg: ServeConfig, n: int, sample_every: int, delay: tuple[int, int], loss: float) -> dict:
    """Stream ``n`` images through a fresh learner state; resident memory and store size along the way."""
    state = open_learner(cfg, ServerMetrics())
    poll, trace = [], []
    start, images = time.perf_counter(), 0
    for record in stream(n, cfg.limits.size, delay, loss, len(state.class_names)):
        poll.append(record)
        images += record.topic == IMAGES
        if len(poll) == cfg.learner.batch_size:
            state.learn_pending()
            state.accept(poll)
            poll = []
            if images % sample_every < cfg.learner.batch_size:
                trace.append({"images": images, "rss_bytes": rss_bytes(), "store": len(state.intake.join.images),
                              "labels_waiting": len(state.intake.join.labels)})
    state.accept(poll)
    state.learn_pending()
    counts = state.intake.join.counts()
    assert counts["images"] == n and counts["joined"] == state.learner.samples_seen  # nothing lost, none twice
    return {"images": n, "seconds": round(time.perf_counter() - start, 1), "counts": counts,
            "feature_dim": state.learner.method.backbone.num_features,
            "store_max": max(t["store"] for t in trace), "trace": trace}


def main(n: int = 5000, factor: int = 10, max_images: int = 2000, feature_model: str = "vit_small_patch14_dinov2",
         img_size: int = 28, loss: float = 0.3, delay_min: int = 50, delay_max: int = 200, sample_every: int = 1000,
         out: Path = Path("benchmarks/results/label_join_memory.json")) -> dict:
    """Run the short and the ten times longer stream; write the result.

    Args:
        n: Images in the short stream.
        factor: How many times longer the long stream is.
        max_images: The join's bound (--join.max_images); the TTL is left at its default (an hour of record
            time), so the count bound is what holds the store.
        feature_model: The backbone whose feature the store keeps (no weights: memory does not depend on them).
        img_size: Its resolution (the feature's size does not depend on it; the forward's time does).
        loss: Share of labels that never come.
        delay_min: Least label delay, in records.
        delay_max: Largest label delay, in records.
        sample_every: Images between two memory samples.
        out: Where the JSON goes.
    """
    keep_freed_memory()
    torch.manual_seed(0)
    kafka = KafkaConfig(topic=IMAGES, labels_topic=LABELS)
    cfg = ServeConfig(kafka=kafka, data=DataConfig(dataset="cifar10", train_per_class=1),
                      backbone=BackboneConfig(name=feature_model, weights=None, img_size=img_size),
                      protocol=ProtocolConfig(eval_period=0), join=JoinConfig(max_images=max_images),
                      limits=ImageLimits(size=img_size), checkpoint_dir=Path("/nonexistent"))
    cfg = replace(cfg, learner=replace(cfg.learner, precision="fp32"))
    short = run(cfg, n, sample_every, (delay_min, delay_max), loss)
    long = run(cfg, n * factor, sample_every, (delay_min, delay_max), loss)
    at_n = next(t for t in long["trace"] if t["images"] >= n)
    result = {
        "what": f"the learner state with labels {delay_min}-{delay_max} records late, {loss:.0%} never coming, "
                f"--join.max_images {max_images}",
        "feature_model": feature_model, "img_size": img_size, "feature_dim": long["feature_dim"],
        "max_images": max_images,
        "short": {k: short[k] for k in ("images", "seconds", "counts", "store_max")},
        "long": {k: long[k] for k in ("images", "seconds", "counts", "store_max")},
        "rss_bytes_at_n": at_n["rss_bytes"], "rss_bytes_at_end": long["trace"][-1]["rss_bytes"],
        "rss_growth_after_n": long["trace"][-1]["rss_bytes"] / at_n["rss_bytes"] - 1,
        "store_bounded": long["store_max"] <= max_images,
        "trace": long["trace"],
    }
    return write_result(result, out, torch.device("cpu"), torch.float32)


def table_rows(r: dict) -> list[Row]:
    """The table's rows: the learner's memory over the ten times longer stream, and the join's bound."""
    long, short = r["long"], r["short"]
    rss = f"{fmt(r['rss_bytes_at_n'], 'MB')} → {fmt(r['rss_bytes_at_end'], 'MB')}"
    return [(f"Labels that come later: learner memory (RSS) at {short['images']:,} → {long['images']:,} images, "
             f"30% of labels never coming ({r['feature_dim']}-d features kept)", rss,
             "–", r["rss_growth_after_n"], "growth < 0.05", r["rss_growth_after_n"] < 0.05),
            ("Labels that come later: most images the join held (its bound: --join.max_images)",
             f"{long['store_max']:,}", f"{r['max_images']:,} (the bound)", None, "≤ the bound", r["store_bounded"])]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
