"""The stream's record format, shared by the producer and the learner (which meet only through Kafka).

One record per image: the value is the encoded image (JPEG/PNG bytes); headers (ASCII values) carry

* ``label``: the class index (int) in the dataset's label space;
* ``sample_index``: the image's index in its dataset split (what "learned exactly once" is counted by);
* ``stream_position``: its position in the Si-Blurry order;
* ``stream_id``: which replay of which stream it belongs to (dataset, sampler settings, seed);
* ``dataset`` and ``content-type``, for people reading the topic.

Records are keyed by ``stream_id`` (``mepo_stream.kafka.record_key``), so a stream lands on one partition and
is read in order; how to reach the cluster and create the topics is ``mepo_stream.kafka`` too.

Example:
    >>> rec = parse_headers(record_headers(3, 10, 7, "cifar10/5-50-10/seed1", "cifar10"), n_classes=10)
    >>> rec.label, rec.sample_index, rec.stream_id
    (3, 10, 'cifar10/5-50-10/seed1')
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA = "mepo-image/1"


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
