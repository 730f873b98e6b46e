"""``mepo produce``: replay a dataset's training split into Kafka as a Si-Blurry stream.

One record per image, in the Si-Blurry order of ``mepo_stream.sampler`` (the same N, M, T and seed flags as
``evaluate``): the value is the image file's encoded bytes, the headers follow ``mepo_stream.records``. By
default every record is keyed by the stream id (dataset, sampler settings, seed), so the whole stream goes to one
partition and the learner reads it in order, whatever the topic's partition count. ``--replay.partition_by
position`` deals the stream round-robin over the topic's partitions (for learners in a group, docs "Scale-out"),
``label`` keys records by label; each partition keeps its records in stream order. With the idempotent producer
(``acks=all``) retries cannot reorder or duplicate records.

Every image carries its id, ``<stream id>/<file>`` (``mepo_stream.records.sample_id``; the stream id names the
dataset by its folder's name), and its ``file`` relative to the dataset's root: what a correction or deletion names.

``--replay.label_delay D`` replays the stream as images now and labels later: each image goes without its label but
with its id, and its label goes to ``--kafka.labels_topic`` D records later (or
drawn up to ``--replay.label_delay_max``; a share ``--replay.label_loss`` never comes: ``mepo_stream.label_delay``).

On SIGINT or SIGTERM it flushes the records sent so far, logs how many, and exits with 130 or 143 (the stream is
incomplete: a script must not go on as if it were whole).

Example:
    mepo produce --data.dataset cifar10 --data.train_per_class 100 --stream.seed 1
    mepo produce --replay.partitions 4 --replay.partition_by position
    mepo produce --kafka.labels_topic mepo.labels --replay.label_delay 50 --replay.label_delay_max 200
"""

from __future__ import annotations

import logging
import time

from tqdm import tqdm

from mepo_stream.data import DataConfig, list_files
from mepo_stream.errors import ConfigError
from mepo_stream.kafka import KafkaConfig, ReplayConfig, ensure_topics, open_producer, record_key
from mepo_stream.label_delay import label_schedule
from mepo_stream.records import MAX_ID, label_headers, record_headers, sample_id, stream_id
from mepo_stream.sampler import SiBlurryConfig, si_blurry_stream
from mepo_stream.shutdown import Stopped

log = logging.getLogger(__name__)
CONTENT_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp"}


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
    ids = _ids(sid, listing.names)
    labels_later = _labels_later(kafka, replay, [(i, listing.targets[i]) for i in order], stream.seed)
    ensure_topics(kafka, kafka.topic, partitions=replay.partitions)
    if labels_later is not None:
        assert kafka.labels_topic is not None  # _labels_later refuses a label delay without one
        ensure_topics(kafka, kafka.labels_topic)
    producer = open_producer(kafka, linger_ms=10, batch_size=262_144, max_request_size=4 * 1024 * 1024)
    n_partitions = len(producer.partitions_for(kafka.topic))
    start, sent = time.monotonic(), 0
    try:
        for position, index in enumerate(tqdm(order, desc=f"produce {sid}", unit="img")):
            path, label = listing.files[index], listing.targets[index]
            content_type = CONTENT_TYPES.get(path.suffix.lower(), "application/octet-stream")
            headers = record_headers(None if labels_later is not None else label, index, position, sid, data.dataset,
                                     content_type, id=ids[index], file=listing.names[index])
            producer.send(kafka.topic, value=path.read_bytes(), headers=headers,
                          key=ids[index].encode() if replay.partition_by == "id" else
                          record_key(sid, label if replay.partition_by == "label" else None),
                          partition=position % n_partitions if replay.partition_by == "position" else None)
            sent += 1
            if labels_later is not None:
                _send_labels(producer, kafka, ids, labels_later.pop(position, []))
            if replay.rate:
                time.sleep(max(0.0, start + sent / replay.rate - time.monotonic()))
        for _, labelled in sorted((labels_later or {}).items()):  # labels due after the last image
            _send_labels(producer, kafka, ids, labelled)
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


def _labels_later(kafka: KafkaConfig, replay: ReplayConfig, stream: list[tuple[int, int]], seed: int
                  ) -> dict[int, list[tuple[int, int]]] | None:
    """With --replay.label_delay: ``{stream position: [(sample index, label) of the images whose labels are sent
    after it]}`` for the stream's (sample index, label) in order (a label that never comes is in no list); None:
    labels attached to their images."""
    if replay.label_delay is None:
        return None
    if kafka.labels_topic is None:
        raise ConfigError("--replay.label_delay sends the labels to their own topic: set --kafka.labels_topic "
                          "(the learner needs the same)")
    due: dict[int, list[tuple[int, int]]] = {}
    schedule = label_schedule(len(stream), replay.label_delay, replay.label_delay_max, replay.label_loss, seed)
    for labelled, at in zip(stream, schedule, strict=True):
        if at is not None:
            due.setdefault(at, []).append(labelled)
    return due


def _ids(sid: str, names: list[str]) -> list[str]:
    """Each image's id (``sample_id``), by sample index; a file whose id would pass ``MAX_ID`` is refused before
    anything is sent (a learner dead-letters such a record)."""
    ids = [sample_id(sid, name) for name in names]
    if too_long := next((id for id in ids if len(id) > MAX_ID), None):
        raise ConfigError(f"the id of {too_long!r} passes {MAX_ID} characters: give the folder or its files "
                          "shorter names")
    return ids


def _send_labels(producer, kafka: KafkaConfig, ids: list[str], labelled: list[tuple[int, int]]) -> None:
    """Send the labels of these (sample index, label) pairs to the labels topic, each keyed by its image's id."""
    for index, label in labelled:
        producer.send(kafka.labels_topic, value=b"", key=ids[index].encode(), headers=label_headers(ids[index], label))
