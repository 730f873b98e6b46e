"""What corrections and deletions cost the learner (``--corrections.enabled``): its rate with 5 % of the records
being corrections and 1 % deletions against the same stream without them, the time from reading a tombstone to a
model without it, the sample table's bytes per id on disk, and the learner's resident memory over a long stream.

The learner's own state (``server.learner.state.LearnerState``: the default frozen host + streaming LDA, labels on
their own topic 50-200 records after their images) takes the records in polls of a mini-batch, as the loop hands
them over, and checkpoints every ``--checkpoint_every`` samples as the loop does (the sample table commits then). No
broker: its time and memory are not the learner's, and the rows that need one are the end-to-end tests. A change
names an id whose label came at least ``settle`` records earlier (a relabel to a random other label, or a tombstone
of an id not deleted yet). Resident memory is split into anonymous memory (the learner's own) and file-backed pages
(the sample table's memory map, which the kernel reclaims at will).

Usage:
    python -m benchmarks.rows.corrections                      # ViT-S/14 (384-d): 5,000 images each way, 100,000 long
    python -m benchmarks.rows.corrections --n 400 --long 2000  # smoke sizes
Writes ``benchmarks/results/corrections.json``.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.rows.label_join_memory import IMAGES, LABELS, Record, jpegs
from benchmarks.tools.service import write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.backbone import BackboneConfig
from mepo_stream.data import DataConfig
from mepo_stream.images import ImageLimits
from mepo_stream.kafka import KafkaConfig
from mepo_stream.label_delay import label_schedule
from mepo_stream.records import label_headers, record_headers
from server.allocator import keep_freed_memory
from server.config import CorrectionsConfig, ServeConfig
from server.learner.state import LearnerState, open_learner
from server.metrics import ServerMetrics

START_MS = 1_700_000_000_000


def memory() -> dict[str, int]:
    """Resident memory of this process: anonymous (heap, tensors) and file-backed (memory maps), in bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return {"rss_bytes": fields["VmRSS"], "anon_bytes": fields["RssAnon"], "file_bytes": fields["RssFile"]}


def stream(n: int, size: int, n_classes: int, corrections: float, deletions: float, settle: int = 300
           ) -> Iterator[Record]:
    """Records in the order a consumer reads them: each image, the labels due after it, and (with their shares of
    the records) a correction or a deletion of an id labelled ``settle`` or more records before."""
    rng, values = random.Random(1), jpegs(size)
    due: dict[int, list[int]] = {}
    for position, at in enumerate(label_schedule(n, 50, 200, 0.0, seed=1)):
        assert at is not None
        due.setdefault(at, []).append(position)
    labels = [rng.randrange(n_classes) for _ in range(n)]
    per_position = 2 / (1 - corrections - deletions)  # records per image: itself, its label, and the changes
    corrections, deletions = corrections * per_position, deletions * per_position  # chances per image
    labelled: list[int] = []  # positions whose label was sent, in order
    deleted: set[int] = set()
    offsets = {IMAGES: 0, LABELS: 0}

    def record(topic: str, stamp: int, key: bytes, value: bytes | None, headers: list) -> Record:
        offsets[topic] += 1
        return Record(topic, 0, offsets[topic] - 1, stamp, key, value, headers)  # type: ignore[arg-type]

    for position in range(n + 201):
        stamp = START_MS + 10 * position
        if position < n:
            headers = record_headers(None, position, position, "bench", "synthetic", id=f"bench/{position}")
            yield record(IMAGES, stamp, b"", values[position % len(values)], headers)
        for p in due.pop(position, []):
            yield record(LABELS, stamp, f"bench/{p}".encode(), b"", label_headers(f"bench/{p}", labels[p]))
            labelled.append(p)
        old = [p for p in labelled[: max(0, len(labelled) - settle)][-2000:] if p not in deleted]
        draw = rng.random()
        if old and draw < corrections:
            p = rng.choice(old)
            labels[p] = (labels[p] + rng.randrange(1, n_classes)) % n_classes
            yield record(LABELS, stamp, f"bench/{p}".encode(), b"", label_headers(f"bench/{p}", labels[p]))
        elif old and draw < corrections + deletions:
            p = rng.choice(old)
            deleted.add(p)
            yield record(LABELS, stamp, f"bench/{p}".encode(), None, [])


def run(cfg: ServeConfig, records: Iterator[Record], sample_every: int) -> dict:
    """Feed the records through a fresh learner state in polls of a mini-batch, checkpointing as the loop does."""
    state = open_learner(cfg, ServerMetrics())
    poll, trace, tombstones, latencies = [], [], {}, []
    start, images, checkpoints = time.perf_counter(), 0, 0
    for record in records:
        poll.append(record)
        images += record.topic == IMAGES
        if len(poll) == cfg.learner.batch_size:
            checkpoints += _turn(state, poll, tombstones, latencies)
            poll = []
            if images % sample_every < cfg.learner.batch_size:
                corrections = state.intake.corrections
                trace.append({"images": images, **memory(),
                              "table_ids": 0 if corrections is None else len(corrections.table(None))})
    _turn(state, poll, tombstones, latencies)
    state.learn_pending()
    seconds = time.perf_counter() - start
    corrections = state.intake.corrections
    out = {"images": images, "seconds": round(seconds, 2), "images_per_s": round(images / seconds, 1),
           "samples_learned": state.learner.samples_seen, "checkpoints": checkpoints, "trace": trace}
    if corrections is not None:
        corrections.checkpoint()
        counts, table = corrections.counts[None], corrections.table(None)
        changes = counts["corrections_applied"] + counts["deletions_applied"]
        out |= {"counts": counts, "table_ids": len(table), "change_share": round(changes / (2 * images + changes), 4),
                "table_bytes_on_disk": table.bytes_on_disk(),
                "tombstone_to_model_s": {"p50": statistics.median(latencies),
                                         "p99": statistics.quantiles(latencies, n=100)[98]} if len(latencies) > 1
                else None}
        table.close()
    return out


def _turn(state: LearnerState, poll: list[Record], tombstones: dict[str, float], latencies: list[float]
          ) -> int:
    """One poll: accept it while the pending mini-batch is learned, then checkpoint if due; the tombstones it read
    are timed until the version that applied them."""
    now = time.perf_counter()
    for r in poll:
        if r.value is None:
            tombstones[r.key.decode()] = now
    state.learn_pending()
    state.accept(poll)
    table = state.intake.corrections.table(None) if state.intake.corrections else None
    for id in [i for i in tombstones if table is not None and table.get(i) is None]:
        latencies.append(time.perf_counter() - tombstones.pop(id))
    if not state.accept([]).checkpoint_due or (captured := state.capture()) is None:
        return 0
    state.write(captured)
    return 1


def main(n: int = 5000, long: int = 100_000, feature_model: str = "vit_small_patch14_dinov2", img_size: int = 28,
         long_img_size: int = 14, corrections: float = 0.05, deletions: float = 0.01, sample_every: int = 1000,
         out: Path = Path("benchmarks/results/corrections.json")) -> dict:
    """The stream with and without changes, then the long one with them; write the result.

    Args:
        n: Images of the stream timed with and without changes.
        long: Images of the long stream (memory and the table on disk).
        feature_model: The backbone whose features the table keeps (no weights: cost does not depend on them).
        img_size: Its resolution for the timed streams.
        long_img_size: Its resolution for the long stream (the features' size does not depend on it).
        corrections: Share of the records that are corrections.
        deletions: Share of the records that are deletions.
        sample_every: Images between two memory samples.
        out: Where the JSON goes.
    """
    keep_freed_memory()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        def config(name: str, size: int, enabled: bool) -> ServeConfig:
            cfg = ServeConfig(kafka=KafkaConfig(topic=IMAGES, labels_topic=LABELS),
                              data=DataConfig(dataset="cifar10", train_per_class=1),
                              backbone=BackboneConfig(name=feature_model, weights=None, img_size=size),
                              protocol=ProtocolConfig(eval_period=0), limits=ImageLimits(size=size),
                              corrections=CorrectionsConfig(enabled=enabled), checkpoint_dir=Path(tmp) / name)
            return replace(cfg, learner=replace(cfg.learner, precision="fp32"))

        without = run(config("without", img_size, False), stream(n, img_size, 10, 0.0, 0.0), sample_every)
        with_changes = run(config("with", img_size, True), stream(n, img_size, 10, corrections, deletions),
                           sample_every)
        longer = run(config("long", long_img_size, True), stream(long, long_img_size, 10, corrections, deletions),
                     sample_every)
    tenth = next(t for t in longer["trace"] if t["images"] >= long // 10)
    end = longer["trace"][-1]
    result = {
        "what": f"the learner state, labels 50-200 records late, {corrections:.0%} of records corrections and "
                f"{deletions:.0%} deletions, against the same images without them",
        "feature_model": feature_model, "img_size": img_size,
        "without": {k: v for k, v in without.items() if k != "trace"},
        "with_changes": {k: v for k, v in with_changes.items() if k != "trace"},
        "ratio": round(with_changes["images_per_s"] / without["images_per_s"], 3),
        "tombstone_to_model_s": with_changes["tombstone_to_model_s"],
        "long": {k: v for k, v in longer.items() if k != "trace"},
        "table_bytes_per_id": round(longer["table_bytes_on_disk"] / max(1, longer["table_ids"]), 1),
        "memory_at_tenth": tenth, "memory_at_end": end,
        "anon_growth_after_tenth": round(end["anon_bytes"] / tenth["anon_bytes"] - 1, 4),
        "rss_growth_after_tenth": round(end["rss_bytes"] / tenth["rss_bytes"] - 1, 4),
        "trace": longer["trace"],
    }
    return write_result(result, out, torch.device("cpu"), torch.float32)


def table_rows(r: dict) -> list[Row]:
    """The table's rows: the learner's rate with changes, the tombstone's wait, the disk and the memory over a long
    stream."""
    w, wo, long = r["with_changes"], r["without"], r["long"]
    wait = r["tombstone_to_model_s"] or long["tombstone_to_model_s"]
    return [(f"Corrections and deletions: learner state rate with {100 * w['change_share']:.1f} % of records changes "
             f"(corrections 5 : deletions 1), {w['images']:,} images, {r['feature_model']} @ {r['img_size']} px, "
             f"against the same images without", fmt(w["images_per_s"], "/s"), fmt(wo["images_per_s"], "/s"),
             r["ratio"], "≥ 0.9", r["ratio"] >= 0.9),
            ("Corrections and deletions: a tombstone read to the model without it (p50 / p99; the poll after, no "
             "broker)", f"{fmt(wait['p50'], 'ms')} / {fmt(wait['p99'], 'ms')}", "–", None, "–", None),
            (f"Corrections and deletions: sample table on disk per id ({long['table_ids']:,} ids)",
             f"{r['table_bytes_per_id']:,.0f} B", "–", None, "–", None),
            (f"Corrections and deletions: learner memory (anonymous RSS) at {r['memory_at_tenth']['images']:,} → "
             f"{r['memory_at_end']['images']:,} images",
             f"{fmt(r['memory_at_tenth']['anon_bytes'], 'MB')} → {fmt(r['memory_at_end']['anon_bytes'], 'MB')}",
             "–", r["anon_growth_after_tenth"], "growth < 0.05", r["anon_growth_after_tenth"] < 0.05),
            ("Corrections and deletions: resident set (VmRSS: the sample table's memory-mapped pages included, which "
             "the kernel reclaims at will) over the same images",
             f"{fmt(r['memory_at_tenth']['rss_bytes'], 'MB')} → {fmt(r['memory_at_end']['rss_bytes'], 'MB')}",
             "–", r["rss_growth_after_tenth"], "growth < 0.05", r["rss_growth_after_tenth"] < 0.05)]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
