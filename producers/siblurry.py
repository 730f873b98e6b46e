"""``mepo produce``: replay a dataset's training split into Kafka as a Si-Blurry stream.

One record per image, in the Si-Blurry order of ``mepo_stream.sampler`` (the same N, M, T and seed flags as
``evaluate``): the value is the image file's encoded bytes, the headers follow ``mepo_stream.records``. By
default every record is keyed by the stream id (dataset, sampler settings, seed), so the whole stream goes to one
partition and the learner reads it in order, whatever the topic's partition count. ``--replay.partition_by
position`` deals the stream round-robin over the topic's partitions (for learners in a group, docs "Scale-out"),
``label`` keys records by label; each partition keeps its records in stream order. With the idempotent producer
(``acks=all``) retries cannot reorder or duplicate records.

On SIGINT or SIGTERM it flushes the records sent so far, logs how many, and exits with 130 or 143 (the stream is
incomplete: a script must not go on as if it were whole).

Example:
    mepo produce --data.dataset cifar10 --data.train_per_class 100 --stream.seed 1
    mepo produce --replay.partitions 4 --replay.partition_by position
"""

from __future__ import annotations

import logging
import time

from tqdm import tqdm

from mepo_stream.data import DataConfig, list_files
from mepo_stream.kafka import KafkaConfig, ReplayConfig, ensure_topics, open_producer, record_key
from mepo_stream.records import record_headers
from mepo_stream.sampler import SiBlurryConfig, si_blurry_stream
from mepo_stream.shutdown import Stopped

log = logging.getLogger(__name__)
CONTENT_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp"}


def stream_id(data: DataConfig, stream: SiBlurryConfig) -> str:
    per_class = f"/{data.train_per_class}pc" if data.train_per_class else ""
    return f"{data.dataset}{per_class}/T{stream.n_tasks}-N{stream.n}-M{stream.m}/seed{stream.seed}"


def produce(
    data: DataConfig = DataConfig(dataset="cifar10"),
    stream: SiBlurryConfig = SiBlurryConfig(),
    kafka: KafkaConfig = KafkaConfig(),
    replay: ReplayConfig = ReplayConfig(),
) -> int:
    """Replay a dataset's training split into Kafka as a Si-Blurry stream; returns the records sent.

    Args:
        data: Dataset to replay (its train split).
        stream: Si-Blurry settings (same as mepo evaluate).
        kafka: Broker and topic.
        replay: Rate limit, record limit, partitions.
    """
    listing = list_files(data, "train")
    order = si_blurry_stream(listing.targets, stream.n_tasks, stream.n, stream.m, stream.seed).order
    order = order[: replay.limit] if replay.limit is not None else order
    sid = stream_id(data, stream)
    ensure_topics(kafka, kafka.topic, partitions=replay.partitions)
    producer = open_producer(kafka, linger_ms=10, batch_size=262_144, max_request_size=4 * 1024 * 1024)
    n_partitions = len(producer.partitions_for(kafka.topic))
    start, sent = time.monotonic(), 0
    try:
        for position, index in enumerate(tqdm(order, desc=f"produce {sid}", unit="img")):
            path, label = listing.files[index], listing.targets[index]
            headers = record_headers(label, index, position, sid, data.dataset,
                                     CONTENT_TYPES.get(path.suffix.lower(), "application/octet-stream"))
            producer.send(kafka.topic, value=path.read_bytes(), headers=headers,
                          key=record_key(sid, label if replay.partition_by == "label" else None),
                          partition=position % n_partitions if replay.partition_by == "position" else None)
            sent += 1
            if replay.rate:
                time.sleep(max(0.0, start + sent / replay.rate - time.monotonic()))
        producer.flush()
    except Stopped as stop:  # SIGINT or SIGTERM (mepo_stream.shutdown): what was sent reaches the broker first
        producer.flush()
        log.warning("stopped by %s: sent %d of %d records of stream %s to %s in %.1f s", stop.name, sent, len(order),
                    sid, kafka.topic, time.monotonic() - start)
        raise
    finally:
        producer.close()
    log.info("sent %d records of stream %s to %s in %.1f s", sent, sid, kafka.topic, time.monotonic() - start)
    print(f"sent {sent} records of stream {sid} to topic {kafka.topic}")
    return sent
