"""The stream's record format, shared by the producer and the learner (which meet only through Kafka).

One record per image: the value is the encoded image (JPEG/PNG bytes); headers (ASCII values) carry

* ``label``: the class index (int) in the dataset's label space; absent on an image whose label comes later, on
  the labels topic (``mepo_stream.label_join``);
* ``id``: the image's id, which its later label names (required on an image without a label);
* ``sample_index``: the image's index in its dataset split (what "learned exactly once" is counted by);
* ``stream_position``: its position in the Si-Blurry order;
* ``stream_id``: which replay of which stream it belongs to (dataset, sampler settings, seed: ``stream_id``);
* ``file``: the image's file, relative to the dataset's root (``train/cat/0001.jpg``), where it came from one;
* ``dataset`` and ``content-type``, for people reading the topic.

A replayed image's id is its stream id and its ``file`` (``sample_id``): ``photos/T5-N50-M10/seed1/train/cat/0001.jpg``
names one photo of one replay, so a person can address a correction or a deletion by the file they know, and two
replays of a folder (other seeds) stay two samples, each correctable exactly.

A label that comes later is a record of its own on the labels topic: an empty value and the headers ``id`` and
``label`` (``label_headers``, read back by ``parse_label``).

Records are keyed by ``stream_id`` (``mepo_stream.kafka.record_key``), so a stream lands on one partition and
is read in order; how to reach the cluster and create the topics is ``mepo_stream.kafka`` too.

Example:
    >>> rec = parse_headers(record_headers(3, 10, 7, "cifar10/5-50-10/seed1", "cifar10"), n_classes=10)
    >>> rec.label, rec.sample_index, rec.stream_id
    (3, 10, 'cifar10/5-50-10/seed1')
    >>> later = parse_headers(record_headers(None, 11, 8, "s", "cifar10", id="s/11"), n_classes=10, ids=True)
    >>> later.label, later.id
    (None, 's/11')
    >>> parse_label(label_headers("s/11", 4), n_classes=10)
    ('s/11', 4)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mepo_stream.data import BUNDLED, DataConfig
from mepo_stream.sampler import SiBlurryConfig

SCHEMA = "mepo-image/1"
LABEL_SCHEMA = "mepo-label/1"
MAX_ID = 256
"""Longest id, in characters (ids are kept in memory and in the checkpoint until their label comes)."""
_SAMPLE_ID = re.compile(r"^[^/]+(?:/\d+pc)?/T\d+-N\d+-M\d+/seed-?\d+/(?P<file>.+)$")


def dataset_name(dataset: str) -> str:
    """A dataset as stream ids name it: a bundled one by its name, a folder by its own name, not its path (the path
    is one machine's; the folder's name is what its owner calls it)."""
    return dataset if dataset in BUNDLED else Path(dataset).expanduser().resolve().name


def stream_id(data: DataConfig, stream: SiBlurryConfig) -> str:
    """The id of one replay of a dataset: its name, the per-class cap, the sampler's settings and seed.

    Example:
        >>> stream_id(DataConfig("cifar10", train_per_class=50), SiBlurryConfig())
        'cifar10/50pc/T5-N50-M10/seed1'
    """
    per_class = f"/{data.train_per_class}pc" if data.train_per_class else ""
    return f"{dataset_name(data.dataset)}{per_class}/T{stream.n_tasks}-N{stream.n}-M{stream.m}/seed{stream.seed}"


def sample_id(stream_id: str, file: str) -> str:
    """The id of the image ``file`` (relative to its dataset's root) in the replay ``stream_id``; ``sample_file``
    reads the file back.

    Example:
        >>> id = sample_id("photos/T5-N50-M10/seed1", "train/cat/0001.jpg")
        >>> id, sample_file(id)
        ('photos/T5-N50-M10/seed1/train/cat/0001.jpg', 'train/cat/0001.jpg')
    """
    return f"{stream_id}/{file}"


def sample_file(id: str) -> str | None:
    """The file a replayed image's id names (``sample_id``); None for an id of another kind (an HTTP upload's)."""
    found = _SAMPLE_ID.match(id)
    return None if found is None else found.group("file")


class RecordError(ValueError):
    """A record that cannot be learned; ``reason`` is a short code for the dead-letter header."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class RecordMeta:
    label: int | None
    """None: the label comes later, on the labels topic."""
    sample_index: int
    stream_position: int
    stream_id: str
    id: str | None = None
    """The id a later label names (None on a labelled record without one)."""
    prediction: int | None = None
    """The prediction an HTTP upload was answered with (``upload_headers``): the one its later label scores."""


def record_headers(label: int | None, sample_index: int, position: int, stream_id: str, dataset: str,
                   content_type: str = "image/jpeg", id: str | None = None, file: str | None = None
                   ) -> list[tuple[str, bytes]]:
    """An image record's headers; ``label`` None (with an ``id``) for an image whose label comes later; ``file``: the
    image's file relative to the dataset's root."""
    values = {"schema": SCHEMA, "label": label, "id": id, "sample_index": sample_index, "stream_position": position,
              "stream_id": stream_id, "file": file, "dataset": dataset, "content-type": content_type}
    return [(k, str(v).encode()) for k, v in values.items() if v is not None]


def upload_headers(id: str, prediction: int | None, content_type: str) -> list[tuple[str, bytes]]:
    """An HTTP upload's headers on the image topic (``server.uploads``): an image without a label, with its ``id``
    and the ``prediction`` its answer gave (what its later label scores)."""
    headers = record_headers(None, 0, -1, "http", "upload", content_type, id=id)
    return headers + ([("prediction", str(prediction).encode())] if prediction is not None else [])


def label_headers(id: str, label: int) -> list[tuple[str, bytes]]:
    """A later label's headers (its record on the labels topic has an empty value)."""
    return [("schema", LABEL_SCHEMA.encode()), ("id", id.encode()), ("label", str(label).encode())]


def _id(headers: dict[str, bytes]) -> str | None:
    raw = headers.get("id")
    if raw is None:
        return None
    try:
        value = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError("bad_id", f"header 'id' is not UTF-8: {raw[:32]!r}") from e
    if not value or len(value) > MAX_ID:
        raise RecordError("bad_id", f"header 'id' must be 1 to {MAX_ID} characters, got {len(value)}")
    return value


def _label(headers: dict[str, bytes], n_classes: int) -> int:
    label = _int(headers, "label")
    if not 0 <= label < n_classes:
        raise RecordError("label_out_of_range", f"label {label} is outside 0..{n_classes - 1}")
    return label


def _int(headers: dict[str, bytes], name: str) -> int:
    if name not in headers:
        raise RecordError(f"missing_{name}", f"the record has no {name!r} header")
    try:
        return int(headers[name].decode("ascii"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RecordError(f"bad_{name}", f"header {name!r} is not an integer: {headers[name][:32]!r}") from e


def _table(headers: list[tuple[str, bytes]] | None) -> dict[str, bytes]:
    """The headers by name, bytes values only (a null value is dropped). Every record is read through it, so it is
    a plain loop: a comprehension testing each value against a union of types costs several times more."""
    table = {}
    for name, value in headers or ():
        if type(value) is bytes:
            table[name] = value
        elif isinstance(value, bytearray):
            table[name] = bytes(value)
    return table


def parse_headers(headers: list[tuple[str, bytes]] | None, n_classes: int, ids: bool = False) -> RecordMeta:
    """Validate an image record's headers against the label space ``0..n_classes-1``. With ``ids`` (labels may
    come later) a record without a label must carry an ``id`` (else ``missing_id``); without, it needs a label."""
    h = _table(headers)
    record_id = _id(h)
    if ids and "label" not in h:
        if record_id is None:
            raise RecordError("missing_id", "an image without a label needs an 'id' header for its later label")
        label = None
    else:
        label = _label(h, n_classes)
    index = -1 if label is None and "sample_index" not in h else _int(h, "sample_index")  # an id names it
    if index < 0 and label is not None:
        raise RecordError("bad_sample_index", f"sample_index {index} is negative")
    position = _int(h, "stream_position") if "stream_position" in h else -1
    stream_id = h.get("stream_id", b"").decode("utf-8", "replace") or "unknown"
    prediction = _int(h, "prediction") if "prediction" in h else None
    return RecordMeta(label, index, position, stream_id, record_id, prediction)


class KafkaRecord(Protocol):
    """What a dead letter keeps of a consumed record: kafka-python's ``ConsumerRecord`` (or a label the join kept)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> list[tuple[str, bytes]] | None: ...


def record_id(key: bytes | None) -> str:
    """The id a tombstone deletes: its record key, checked as an ``id`` header is."""
    if key is None:
        raise RecordError("missing_id", "a tombstone (a record with a null value) needs the id it deletes as its key")
    found = _id({"id": key})
    assert found is not None
    return found


def parse_label(headers: list[tuple[str, bytes]] | None, n_classes: int) -> tuple[str, int]:
    """A labels-topic record's (id, label), validated like an image record's."""
    h = _table(headers)
    record_id = _id(h)
    if record_id is None:
        raise RecordError("missing_id", "a label record needs an 'id' header naming its image")
    return record_id, _label(h, n_classes)
