"""What corrections and deletions cost through Kafka: ``mepo serve --corrections.enabled`` learning a stream with 5 %
of its records corrections and 1 % deletions against the same images without them, and the time from a tombstone's
write to the broker to the model without it.

``benchmarks.rows.corrections`` measures the learner's own state without a broker (and the table's disk and memory over
a long stream); this runs the service as users run it (``benchmarks.tools.service``: an embedded broker, ``mepo serve``
in its own process, HTTP). Labels come with their images; a correction is an empty record with ``id`` and ``label``
headers on the image topic, a deletion a tombstone keyed by the id, each of an id sent ``settle`` or more records
before. The stream is in the broker before the timing starts, so the rate is the learner's, not the producer's. The
tombstone's wait is measured with the learner idle (the stream learned): one tombstone at a time, from the producer's
send to the ``/v1/status`` that counts it applied.

Usage:
    python -m benchmarks.rows.corrections_service                          # ViT-S/14 @ 84, 3,000 CIFAR-10 images
    python -m benchmarks.rows.corrections_service --spec.train_per_class 4 --tombstones 5   # smoke sizes
Writes ``benchmarks/results/corrections_service.json``.
"""

from __future__ import annotations

import random
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

from kafka import KafkaProducer

from benchmarks.tools.service import ServiceSpec, ServiceUnderTest, quantiles, running_service, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.data import list_files
from mepo_stream.kafka import KafkaConfig
from mepo_stream.records import label_headers, record_headers

Record = tuple[bytes, bytes | None, list[tuple[str, bytes]]]  # key, value (None: a tombstone), headers


def records(spec: ServiceSpec, corrections: float, deletions: float, settle: int = 200, seed: int = 1
            ) -> tuple[list[Record], dict[str, int]]:
    """The spec's images in a shuffled order with their labels, each keyed by its id, and (with their shares of the
    records) a correction or a deletion of an id sent ``settle`` or more records before; the changes' counts."""
    listing = list_files(spec.data, "train")
    rng = random.Random(seed)
    order = rng.sample(range(len(listing.files)), len(listing.files))
    n_classes = len(listing.class_names)
    labels = {i: listing.targets[i] for i in order}
    out: list[Record] = []
    counts = {"corrections": 0, "deletions": 0}
    per_image = 1 / (1 - corrections - deletions)
    for position, index in enumerate(order):
        id = f"bench/{index}"
        headers = record_headers(labels[index], index, position, "bench", spec.dataset, "image/jpeg", id=id)
        out.append((id.encode(), listing.files[index].read_bytes(), headers))
        sent = [i for i in order[: max(0, position - settle)] if i in labels]
        draw = rng.random()
        if sent and draw < corrections * per_image:
            i = rng.choice(sent)
            labels[i] = (labels[i] + rng.randrange(1, n_classes)) % n_classes
            out.append((f"bench/{i}".encode(), b"", label_headers(f"bench/{i}", labels[i])))
            counts["corrections"] += 1
        elif sent and draw < (corrections + deletions) * per_image:
            i = rng.choice(sent)
            del labels[i]
            out.append((f"bench/{i}".encode(), None, []))
            counts["deletions"] += 1
    return out, counts


def send(producer: KafkaProducer, stream: list[Record]) -> None:
    for key, value, headers in stream:
        producer.send(KafkaConfig.topic, key=key, value=value, headers=headers)
    producer.flush()


def applied(status: dict) -> dict[str, int]:
    c = status["corrections"]
    return {"corrections": c["corrections_applied"] + c["corrections_refused"],
            "deletions": c["deletions_applied"] + c["deletions_refused"]}


def learn(service: ServiceUnderTest, producer: KafkaProducer, stream: list[Record], changes: dict[str, int],
          timeout_s: float = 3600) -> dict:
    """Send the stream, then time the service from its first learned sample to the last record applied."""
    images = sum(value != b"" and value is not None for _, value, _ in stream)
    send(producer, stream)
    first: tuple[float, int] | None = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, now = service.status(), time.perf_counter()
        if first is None and status["samples_seen"] > 0:
            first = (now, status["samples_seen"])
        if status["samples_seen"] >= images and applied(status) == changes:
            assert first is not None
            seconds = now - first[0]
            return {"images": images, **changes, "seconds": round(seconds, 2),
                    "images_per_s": round((images - first[1]) / seconds, 1), "status": status["corrections"]}
        time.sleep(0.05)
    raise TimeoutError(f"the stream was not learned within {timeout_s} s")


def tombstone_waits(service: ServiceUnderTest, producer: KafkaProducer, ids: list[str]) -> list[float]:
    """One tombstone at a time: from the send to the status that counts it applied (seconds)."""
    waits = []
    for id in ids:
        before = service.status()["corrections"]["deletions_applied"]
        start = time.perf_counter()
        producer.send(KafkaConfig.topic, key=id.encode(), value=None).get(30)
        while service.status()["corrections"]["deletions_applied"] == before:
            time.sleep(0.002)
        waits.append(time.perf_counter() - start)
    return waits


def main(spec: ServiceSpec = replace(ServiceSpec(), train_per_class=300), corrections: float = 0.05,
         deletions: float = 0.01, tombstones: int = 50, work: Path = Path("/tmp/mepo-bench-corrections-service"),
         out: Path = Path("benchmarks/results/corrections_service.json")) -> dict:
    """The service on the stream without changes, then on it with them (a fresh service and broker each), then the
    tombstone waits; write the result.

    Args:
        spec: What the service learns, with which model (``--corrections.enabled`` and no any-time evaluation are
            added): one that can take a sample out exactly, so no Sigma_pre bundle (its alignment's running
            statistics depend on the order of the stream, and the service refuses it).
        corrections: Share of the records that are corrections.
        deletions: Share of the records that are deletions.
        tombstones: Tombstones timed one at a time once the stream is learned.
        work: Where the services' checkpoints, tables and logs go.
        out: Where the JSON goes.
    """
    spec = replace(spec, extra=(*spec.extra, "--corrections.enabled", "true", "--protocol.eval_period", "0"))
    with_changes, counts = records(spec, corrections, deletions)
    without = [r for r in with_changes if r[1] != b"" and r[1] is not None]
    results = {}
    for name, stream, expected in (("without", without, {"corrections": 0, "deletions": 0}),
                                   ("with_changes", with_changes, counts)):
        shutil.rmtree(work / name, ignore_errors=True)  # a sample table without its checkpoint is refused
        with running_service(spec, work / name, produce_first=False) as service:
            producer = KafkaProducer(bootstrap_servers=service.bootstrap, acks="all", linger_ms=10)
            results[name] = learn(service, producer, stream, expected)
            if name == "with_changes":
                kept = sorted({key.decode() for key, _, _ in without} - {k.decode() for k, v, _ in stream if v is None})
                waits = tombstone_waits(service, producer, random.Random(2).sample(kept, tombstones))
                results["tombstone_waits_s"] = {**quantiles(waits), "mean_s": statistics.fmean(waits),
                                                "n": len(waits)}
            producer.close()
    w, wo = results["with_changes"], results["without"]
    result = {
        "what": f"mepo serve through Kafka, labels inline, {corrections:.0%} of records corrections and "
                f"{deletions:.0%} deletions, against the same images without them",
        "spec": spec.as_json(), **results,
        "change_share": round((w["corrections"] + w["deletions"]) / len(with_changes), 4),
        "ratio": round(w["images_per_s"] / wo["images_per_s"], 3),
    }
    dev, dtype = spec.placement()
    return write_result(result, out, dev, dtype)


def table_rows(r: dict) -> list[Row]:
    """The table's rows: ``mepo serve``'s rate with changes against without, and a tombstone's wait from its
    write."""
    w, wo, wait, spec = r["with_changes"], r["without"], r["tombstone_waits_s"], r["spec"]
    return [(f"Corrections and deletions through Kafka: mepo serve's rate with {100 * r['change_share']:.1f} % of "
             f"records changes (corrections 5 : deletions 1), {w['images']:,} images, {spec['model']} @ "
             f"{spec['img_size']} px, against the same images without", fmt(w["images_per_s"], "/s"),
             fmt(wo["images_per_s"], "/s"), r["ratio"], "≥ 0.9", r["ratio"] >= 0.9),
            (f"Corrections and deletions through Kafka: a tombstone written to the model without it, learner idle "
             f"(p50 / p99 of {wait['n']})", f"{fmt(wait['p50_s'], 'ms')} / {fmt(wait['p99_s'], 'ms')}", "–", None,
             "–", None)]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
