"""The stream contract's transport half: how the producer and the server reach Kafka, create topics and key records.

``producers/`` and ``server/`` never import each other; they meet only through Kafka, so both take from here how
to connect (``KafkaConfig``, security settings included), how topics are created and how a record is keyed, and
the two sides cannot drift apart. The record itself (value and headers) is ``mepo_stream.records``. kafka-python
is imported inside the functions that talk to a cluster, so the core imports no client library.

Example:
    >>> kafka = KafkaConfig(bootstrap_servers="k1:9092,k2:9092", security_protocol="SASL_SSL",
    ...                     sasl_mechanism="SCRAM-SHA-512", sasl_plain_username="learner", sasl_plain_password="pw")
    >>> options = kafka.client_options()
    >>> options["bootstrap_servers"], options["security_protocol"], options["sasl_plain_password"]
    (['k1:9092', 'k2:9092'], 'SASL_SSL', 'pw')
    >>> "pw" in repr(kafka)  # the password reaches kafka-python, never a log line
    False
    >>> record_key("cifar10/T5-N50-M10/seed1")
    b'cifar10/T5-N50-M10/seed1'
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mepo_stream.errors import ConfigError

if TYPE_CHECKING:
    from kafka import KafkaProducer


@dataclass(frozen=True)
class KafkaConfig:
    """Where the stream lives, and how to reach the cluster (passed through to kafka-python)."""

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated host:port list of the Kafka cluster."""
    topic: str = "mepo.images"
    """Topic of the labelled image stream."""
    dead_letter_topic: str = "mepo.images.dlq"
    """Topic that receives records that cannot be learned, with the reason in their headers."""
    labels_topic: str | None = None
    """Topic of labels that come later (records with headers ``id`` and ``label``): set, images may come without a
    label but with an id; the learner predicts them at arrival (to --kafka.predictions_topic), keeps their features
    and learns each when its label is joined (docs "Labels that come later"). Null: every image carries its label."""
    predictions_topic: str = "mepo.predictions"
    """Where the learner writes its prediction of every image that came without a label (JSON, keyed by id)."""
    novel_topic: str | None = None
    """Where the learner also writes each image that came without a label and was flagged novel (a class it has not
    learned, by its calibrated threshold), as its prediction (JSON with ``novelty``, keyed by id): a labelling tool
    asks for these labels first. Null: none are written."""
    group_id: str = "mepo-learner"
    """Consumer group of the learner."""
    snapshot_topic: str | None = "mepo.snapshots"
    """Compacted topic the learner publishes its model snapshots to and ``mepo replica`` servers follow (null:
    the learner publishes none)."""
    state_topic: str | None = None
    """Compacted topic of per-partition learner state: set, learning scales out over a consumer group (each
    learner learns the partitions it is assigned, keeps their state here, and serves the sum over all partitions;
    docs "Scale-out"). Null: one learner, whose checkpoint in --checkpoint_dir is the source of truth."""
    snapshot_chunk_bytes: int = 1_000_000
    """Largest part of a snapshot in one record: a bigger snapshot travels as several records. Keep it below the
    broker's ``message.max.bytes`` (1,048,588 by default) and the clients' ``max_request_size`` (1 MiB)."""
    security_protocol: str = "PLAINTEXT"
    """PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."""
    sasl_mechanism: str | None = None
    """PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, ... (with a SASL protocol)."""
    sasl_plain_username: str | None = None
    """SASL user name."""
    sasl_plain_password: str | None = field(default=None, repr=False)
    """SASL password (never logged)."""
    ssl_cafile: str | None = None
    """CA bundle for SSL."""
    ssl_certfile: str | None = None
    """Client certificate for SSL."""
    ssl_keyfile: str | None = None
    """Client key for SSL."""

    def client_options(self) -> dict:
        """kafka-python keyword arguments common to producers, consumers and admin clients."""
        keys = ("security_protocol", "sasl_mechanism", "sasl_plain_username", "sasl_plain_password",
                "ssl_cafile", "ssl_certfile", "ssl_keyfile")
        opts = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        return {"bootstrap_servers": self.bootstrap_servers.split(","), **opts}


@dataclass(frozen=True)
class ReplayConfig:
    """How fast and how much a producer replays (``mepo produce``, and ``mepo demo``'s producer)."""

    rate: float | None = None
    """Records per second (null: as fast as the broker takes them)."""
    limit: int | None = None
    """Stop after this many records (null: the whole stream)."""
    partitions: int = 1
    """Partitions of the topic if it has to be created."""
    label_delay: int | None = None
    """Send each image without its label, and the label to --kafka.labels_topic this many records later (null:
    labels attached to their images)."""
    label_delay_max: int | None = None
    """With --replay.label_delay: each label's delay is drawn uniformly from label_delay..label_delay_max records."""
    label_loss: float = 0.0
    """With --replay.label_delay: the share of labels that never come (drawn with the stream's seed)."""
    partition_by: Literal["stream", "position", "label", "id"] = "stream"
    """How records spread over the topic's partitions: ``stream`` keys every record by the stream id (the whole
    stream on one partition, in order); ``position`` deals them round-robin by stream position (record i to
    partition i mod P: learners in a group share the work evenly); ``label`` keys them by stream id and label
    (a stand-in for a key of your own, such as a camera id: each key's records stay in order on one partition);
    ``id`` keys each record by its sample id, as a table's records are, so a correction or deletion keyed by the
    id lands on its image's partition (what learners in a group need to correct samples). Each partition keeps
    its records in stream order."""


def record_key(stream_id: str, label: int | None = None) -> bytes:
    """The partition key of a record: its stream id, so the whole stream lands on one partition and is read in
    order, whatever the topic's partition count; with ``label``, the stream id and the label (``--replay.partition_by
    label``), so each label's records stay in order on one partition."""
    return stream_id.encode() if label is None else f"{stream_id}/label{label}".encode()


def require_client() -> None:
    """Fail with the extra to install where the Kafka client is missing (``pip install mepo-stream`` leaves it out)."""
    if importlib.util.find_spec("kafka") is None:
        raise ConfigError("talking to Kafka needs the kafka extra, which this install leaves out: "
                          "pip install 'mepo-stream[kafka]'")


def ensure_topics(kafka: KafkaConfig, *topics: str, partitions: int = 1, configs: dict[str, str] | None = None
                  ) -> None:
    """Create those of ``topics`` (default: the stream's topic and its dead-letter topic) that do not exist yet,
    with replication 1 and the topic ``configs`` given; an existing topic is left as it is.

    Producer and server may both call this, in either order: a topic the other side created first is kept.
    """
    require_client()
    from kafka.admin import KafkaAdminClient, NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(**kafka.client_options())
    try:
        existing = set(admin.list_topics())
        wanted = dict.fromkeys(topics or (kafka.topic, kafka.dead_letter_topic))  # in order, once each
        new = [NewTopic(t, partitions, 1, topic_configs=configs or {}) for t in wanted if t not in existing]
        if new:
            admin.create_topics(new)
    except TopicAlreadyExistsError:  # created by the other side meanwhile
        pass
    finally:
        admin.close()


def open_producer(kafka: KafkaConfig, **options) -> KafkaProducer:
    """A producer that keeps each partition's records in order and never writes one twice on a retry
    (``acks="all"``, idempotent); ``options`` tune batching and request sizes."""
    require_client()
    from kafka import KafkaProducer

    return KafkaProducer(**kafka.client_options(), acks="all", enable_idempotence=True, **options)
