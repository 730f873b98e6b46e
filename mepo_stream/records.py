"""The stream's record format, shared by the producer and the learner (which meet only through Kafka).

One record per image: the value is the encoded image (JPEG/PNG bytes); headers (ASCII values) carry

* ``label``: the class index (int) in the dataset's label space;
* ``sample_index``: the image's index in its dataset split (what "learned exactly once" is counted by);
* ``stream_position``: its position in the Si-Blurry order;
* ``stream_id``: which replay of which stream it belongs to (dataset, sampler settings, seed);
* ``dataset`` and ``content-type``, for people reading the topic.

Records are keyed by ``stream_id``, so a stream lands on one partition and is read in order.

Example:
    >>> rec = parse_headers(record_headers(3, 10, 7, "cifar10/5-50-10/seed1", "cifar10"), n_classes=10)
    >>> rec.label, rec.sample_index, rec.stream_id
    (3, 10, 'cifar10/5-50-10/seed1')
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA = "mepo-image/1"


@dataclass(frozen=True)
class KafkaConfig:
    """Where the stream lives, and how to reach the cluster (passed through to kafka-python)."""

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated host:port list of the Kafka cluster."""
    topic: str = "mepo.images"
    """Topic of the labelled image stream."""
    dead_letter_topic: str = "mepo.images.dlq"
    """Topic that receives records that cannot be learned, with the reason in their headers."""
    group_id: str = "mepo-learner"
    """Consumer group of the learner."""
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


class RecordError(ValueError):
    """A record that cannot be learned; ``reason`` is a short code for the dead-letter header."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class RecordMeta:
    label: int
    sample_index: int
    stream_position: int
    stream_id: str


def record_headers(label: int, sample_index: int, position: int, stream_id: str, dataset: str,
                   content_type: str = "image/jpeg") -> list[tuple[str, bytes]]:
    values = {"schema": SCHEMA, "label": label, "sample_index": sample_index, "stream_position": position,
              "stream_id": stream_id, "dataset": dataset, "content-type": content_type}
    return [(k, str(v).encode()) for k, v in values.items()]


def _int(headers: dict[str, bytes], name: str) -> int:
    if name not in headers:
        raise RecordError(f"missing_{name}", f"the record has no {name!r} header")
    try:
        return int(headers[name].decode("ascii"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RecordError(f"bad_{name}", f"header {name!r} is not an integer: {headers[name][:32]!r}") from e


def parse_headers(headers: list[tuple[str, bytes]] | None, n_classes: int) -> RecordMeta:
    """Validate a record's headers against the label space ``0..n_classes-1``."""
    h = {k: v for k, v in headers or [] if isinstance(v, bytes | bytearray)}
    label = _int(h, "label")
    if not 0 <= label < n_classes:
        raise RecordError("label_out_of_range", f"label {label} is outside 0..{n_classes - 1}")
    index = _int(h, "sample_index")
    if index < 0:
        raise RecordError("bad_sample_index", f"sample_index {index} is negative")
    position = _int(h, "stream_position") if "stream_position" in h else -1
    stream_id = h.get("stream_id", b"").decode("utf-8", "replace") or "unknown"
    return RecordMeta(label, index, position, stream_id)
