"""Snapshots on the wire: what the learner publishes to the compacted snapshot topic and replicas load.

A snapshot is one safetensors blob (``encode``: tensors and string metadata, nothing unpickled on a replica), sent as
records of at most ``chunk_bytes`` keyed ``<model>/<part>`` (``to_records``) with headers ``format``, ``model``,
``version``, ``part`` (``"i/n"``) and the blob's ``sha256``. :class:`Assembler` puts the parts back together, grouped
by version *and* digest so that publications never mix, and checks the sha256 before anything is decoded.

Example:
    >>> origin = Origin("mepo", "frozen", ("cat", "dog"), "ab" * 32, None)
    >>> blob = encode({"classifier.counts": torch.tensor([3.0, 1.0])}, origin, version=7, samples_seen=4,
    ...               exposed=(1, 0), published_at=0.0)
    >>> records = to_records(blob, "mepo", 7, chunk_bytes=64)  # a tiny limit: several parts
    >>> len(records) > 1, records[0][0]
    (True, b'mepo/0')
    >>> assembler = Assembler("mepo")
    >>> [assembler.add(key, value, headers) for key, value, headers in records][-1] == blob
    True
    >>> message = decode(blob)
    >>> message.version, message.exposed, message.origin == origin, message.tensors["classifier.counts"].tolist()
    (7, (1, 0), True, [3.0, 1.0])
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from mepo_stream.kafka import KafkaConfig, ensure_topics, open_producer
from mepo_stream.novelty import NoveltyScore, check_score

if TYPE_CHECKING:
    from kafka import KafkaProducer

log = logging.getLogger(__name__)

FORMAT = "mepo-snapshot/1"
Record = tuple[bytes, bytes, list[tuple[str, bytes]]]  # key, value, headers


def snapshot_key(model: str, part: int) -> bytes:
    """The key of a snapshot's part: a compacted topic keeps the newest record of every key, so of every part."""
    return f"{model}/{part}".encode()


SNAPSHOT_TOPIC_CONFIGS = {"cleanup.policy": "compact"}
"""Topic configuration of the snapshot topic: Kafka keeps the newest record per key (Tansu accepts the setting but
keeps every record, in memory)."""


def ensure_snapshot_topic(kafka: KafkaConfig) -> None:
    """Create the compacted snapshot topic (one partition: every part of a snapshot in publication order)."""
    if kafka.snapshot_topic is None:
        raise ValueError("no snapshot topic is configured (--kafka.snapshot_topic)")
    ensure_topics(kafka, kafka.snapshot_topic, configs=SNAPSHOT_TOPIC_CONFIGS)


def open_parts_producer(kafka: KafkaConfig, ack_timeout_s: float) -> KafkaProducer:
    """A producer of snapshot and partition-state parts that waits at most ``ack_timeout_s`` for buffer room."""
    return open_producer(kafka, max_request_size=kafka.snapshot_chunk_bytes + 65536,
                         max_block_ms=int(ack_timeout_s * 1000))


def close_quietly(producer: KafkaProducer | None, what: str) -> None:
    """Close a producer; an error (after a broker failure) is logged, never raised over the failure itself."""
    if producer is None:
        return
    try:
        producer.close(timeout=2)
    except Exception:
        log.exception("error while closing the %s producer", what)


class CorruptSnapshot(ValueError):
    """A snapshot record or blob that cannot be what a learner published: never loaded."""


@dataclass(frozen=True)
class Origin:
    """What a learner's snapshots share and a replica must match for their tensors to mean the same thing."""

    model: str  # the served model name (--model_name)
    model_config: str  # the learner's ModelConfig as JSON: what a replica builds the model from
    class_names: tuple[str, ...]  # name of each original label
    backbone_sha256: str | None  # weights_sha256 of the backbone as built, before any learning
    bundle_sha256: str | None  # BundleParts.sha256 of the model's MePo parts


@dataclass(frozen=True)
class SnapshotMessage:
    """One decoded snapshot: the method's trainable tensors and what a replica needs to serve them."""

    tensors: dict[str, torch.Tensor]
    origin: Origin
    version: int
    samples_seen: int
    exposed: tuple[int, ...]  # original label of head output k
    published_at: float  # Unix time
    novelty_score: NoveltyScore | None = None  # the score the learner's answers carry
    novelty_threshold: float = math.inf  # the learner's calibrated threshold at this version


def encode(tensors: dict[str, torch.Tensor], origin: Origin, version: int, samples_seen: int,
           exposed: tuple[int, ...], published_at: float, novelty_score: NoveltyScore | None = None,
           novelty_threshold: float = math.inf) -> bytes:
    """The safetensors blob of one snapshot (tensors copied to the CPU; safetensors refuses shared storage)."""
    meta = {"format": FORMAT, **{k: json.dumps(v) for k, v in asdict(origin).items()}, "version": str(version),
            "samples_seen": str(samples_seen), "exposed": json.dumps(list(exposed)), "published_at": repr(published_at),
            "novelty_score": json.dumps(novelty_score), "novelty_threshold": repr(novelty_threshold)}
    return save_tensors({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, metadata=meta)


def blob_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (8-byte little-endian header length, then the JSON header)."""
    (length,) = struct.unpack("<Q", blob[:8])
    if length > len(blob) - 8:
        raise CorruptSnapshot(f"header of {length} bytes in a {len(blob)}-byte blob")
    return json.loads(blob[8:8 + length])["__metadata__"]


def decode(blob: bytes) -> SnapshotMessage:
    """Parse a blob; any defect raises :class:`CorruptSnapshot` naming it."""
    try:
        meta = blob_metadata(blob)
        if meta.get("format") != FORMAT:
            raise CorruptSnapshot(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        fields = {k: json.loads(meta[k]) for k in Origin.__dataclass_fields__}
        origin = Origin(**{**fields, "class_names": tuple(fields["class_names"])})
        score = json.loads(meta.get("novelty_score", "null"))  # a learner before novelty scored none
        return SnapshotMessage(load_tensors(blob), origin, int(meta["version"]), int(meta["samples_seen"]),
                               tuple(int(y) for y in json.loads(meta["exposed"])), float(meta["published_at"]),
                               None if score is None else check_score(score),
                               float(meta.get("novelty_threshold", "inf")))
    except CorruptSnapshot:
        raise
    except Exception as e:  # struct, JSON, safetensors, missing keys, wrong types: all mean a blob we cannot trust
        raise CorruptSnapshot(f"not a readable snapshot: {type(e).__name__}: {e}") from e


def to_records(blob: bytes, model: str, version: int, chunk_bytes: int, fmt: str = FORMAT) -> list[Record]:
    """The Kafka records of one blob: parts of at most ``chunk_bytes`` bytes, in order, headed with its ``fmt``."""
    n = max(1, math.ceil(len(blob) / chunk_bytes))
    digest = hashlib.sha256(blob).hexdigest().encode()
    return [(snapshot_key(model, i), blob[i * chunk_bytes:(i + 1) * chunk_bytes],
             [("format", fmt.encode()), ("model", model.encode()), ("version", str(version).encode()),
              ("part", f"{i}/{n}".encode()), ("sha256", digest)]) for i in range(n)]


class Assembler:
    """Puts one model's snapshot records back together, holding at most ``keep`` incomplete snapshots."""

    def __init__(self, model: str, keep: int = 4, fmt: str = FORMAT):
        self.model, self.keep, self.fmt = model, keep, fmt
        self.newest_version: int | None = None  # the last record's, whole or not: a replica's lag counts from it
        self._pending: dict[tuple[int, str], tuple[int, dict[int, bytes]]] = {}  # (version, sha256) -> (count, parts)

    def add(self, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | None) -> bytes | None:
        """The whole blob once its last part arrives (sha256 checked), else None; a record of another model is
        ignored (None); a malformed record or a blob whose digest differs raises :class:`CorruptSnapshot`."""
        head = _headers(headers)
        if "model" in head and head["model"] != self.model:
            return None
        version, part, count, digest = _identity(head, self.fmt)
        if key != snapshot_key(self.model, part) or value is None:
            raise CorruptSnapshot(f"part {part} of version {version} has key {key!r} or no value")
        self.newest_version = version
        announced, chunks = self._pending.setdefault((version, digest), (count, {}))
        if announced != count:
            raise CorruptSnapshot(f"version {version} announced {announced} parts, then {count}")
        chunks[part] = value
        while len(self._pending) > self.keep:  # the first to arrive go first
            del self._pending[next(iter(self._pending))]
        if len(chunks) < count:
            return None
        self._drop_until((version, digest))
        blob = b"".join(chunks[i] for i in range(count))
        if hashlib.sha256(blob).hexdigest() != digest:
            raise CorruptSnapshot(f"version {version}: the parts' sha256 does not match the announced {digest[:12]}…")
        return blob

    @property
    def incomplete(self) -> bool:
        """Parts are held that do not make a whole snapshot yet."""
        return bool(self._pending)

    def _drop_until(self, done: tuple[int, str]) -> None:
        """Forget the completed snapshot and every one that started arriving before it: they are older."""
        for key in list(self._pending):
            del self._pending[key]
            if key == done:
                return


def _headers(headers: list[tuple[str, bytes]] | None) -> dict[str, str]:
    try:
        return {k: v.decode() for k, v in headers or []}
    except (UnicodeDecodeError, AttributeError, ValueError) as e:
        raise CorruptSnapshot(f"unreadable headers: {e}") from e


def _identity(head: dict[str, str], fmt: str) -> tuple[int, int, int, str]:
    """(version, part, count, sha256) of a record's headers."""
    if head.get("format") != fmt:
        raise CorruptSnapshot(f"format {head.get('format')!r}, expected {fmt!r}")
    try:
        version = int(head["version"])
        part, count = (int(x) for x in head["part"].split("/"))
        digest = head["sha256"]
    except (KeyError, ValueError) as e:
        raise CorruptSnapshot(f"bad snapshot headers {head}: {e}") from e
    if not 0 <= part < count or len(digest) != 64:
        raise CorruptSnapshot(f"bad snapshot headers {head}")
    return version, part, count, digest
