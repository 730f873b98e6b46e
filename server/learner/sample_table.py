"""The table of learned samples: per id, the feature it was learned from, its label and its record time, in LMDB.

A streaming-LDA model is a sum over its samples, so a sample is deleted or relabelled exactly by subtracting what it
added (``OnlineLearner.forget_features``): the table keeps that on disk (a KTable: the latest label of each id).

``commit(g)`` writes the changes with their undo records, and the checkpoint that follows records ``g``; a restart's
``restore`` undoes every later generation, so a kill -9 between the two neither loses nor doubles a change. Ids past
``retention_s`` are dropped (still in the model, no longer correctable); a settle at most ``compact_every_s`` after a
deletion swaps in a compacted copy, without the deleted entries' bytes.

Key layout (four named databases): ``samples``: the id's 16-byte hash -> entry (the id is in the entry);
``by_time``: 8-byte big-endian milliseconds + hash -> b""; ``undo``: 8-byte generation + hash -> b"\\x00" (absent
before) or b"\\x01" + entry; ``meta``: ``generation`` and ``settled``.
"""

from __future__ import annotations

import gc
import hashlib
import shutil
import struct
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import lmdb
import torch

from mepo_stream.errors import StateRefused

MAP_SIZE = 1 << 40  # LMDB's address-space reservation (a sparse file: disk is used only as entries are written)
# the tables open in this process, by resolved path: LMDB allows one environment per file per process (a second one
# shares the first's lock table, and py-lmdb warns it may crash the interpreter)
_OPEN: weakref.WeakValueDictionary[Path, SampleTable] = weakref.WeakValueDictionary()
_HEAD = struct.Struct("<idH")  # label (int32), record time (float64 s), the id's length in bytes (uint16)


@dataclass(frozen=True)
class Entry:
    """What a learned sample added to the model, and when it came."""

    label: int
    time: float  # its record's time (s): what retention measures
    feature: torch.Tensor  # [D] float32: ``OnlineLearner.forget_features``'s input
    id: str = ""  # the sample's id (the table sets it)

    def encode(self) -> bytes:
        id = self.id.encode()
        return (_HEAD.pack(self.label, self.time, len(id)) + id
                + self.feature.to(torch.float32).contiguous().numpy().tobytes())

    @classmethod
    def decode(cls, data: bytes) -> Entry:
        label, at, n = _HEAD.unpack_from(data)
        feature = torch.frombuffer(bytearray(data[_HEAD.size + n:]), dtype=torch.float32)
        return cls(label, at, feature, data[_HEAD.size:_HEAD.size + n].decode())


def _key(id: str) -> bytes:
    """An id's key: a hash, so a key left in a B+tree's branch pages after a deletion names no one."""
    return hashlib.blake2b(id.encode(), digest_size=16).digest()


def _time_key(at: float, id: bytes) -> bytes:
    return struct.pack(">Q", max(0, int(at * 1000))) + id


def _int(data: bytes | None) -> int:
    """A number the meta database keeps (0: none yet)."""
    return 0 if data is None else int(data)


class SampleTable:
    """Learned samples by id; changed in memory by the learning step, committed with each checkpoint."""

    def __init__(self, path: Path, retention_s: float, compact_every_s: float = 3600.0):
        self.path, self.retention_s, self.compact_every_s = path, retention_s, compact_every_s
        self._env_lock = threading.RLock()  # held by every transaction, and by a compaction's swap of the files
        self._open()
        self._changed: dict[bytes, Entry | None] = {}  # since the last commit (None: deleted)
        self._lock = threading.Lock()  # the learning step changes, the loop's intake reads
        self._count = self._committed_count()  # ids now, kept as they are put and deleted
        self._deleted = False  # a commit deleted an id since the last compaction
        self._compacted_at = time.monotonic()

    def _open(self) -> None:
        """Open the environment, first finishing a compaction's swap that a crash cut short."""
        _claim(self)
        copy, old = self.path.with_name(self.path.name + ".compact"), self.path.with_name(self.path.name + ".old")
        if copy.is_dir() and not self.path.is_dir():  # the copy was whole: only then is the table moved away
            copy.rename(self.path)
        for leftover in (copy, old):
            if leftover.is_dir():
                shutil.rmtree(leftover)
        self.path.mkdir(parents=True, exist_ok=True)
        self.closed = False
        self.env = lmdb.open(str(self.path), map_size=MAP_SIZE, max_dbs=4, metasync=True, sync=True, readahead=False)
        self._samples, self._by_time, self._undo, self._meta = (self.env.open_db(name) for name in
                                                                (b"samples", b"by_time", b"undo", b"meta"))

    def _replace(self, txn, key: bytes, value: Entry | None) -> bytes | None:
        """Replace ``key``'s entry and its time index key by ``value`` (None: delete); returns the entry before."""
        before = txn.get(key, db=self._samples)
        if before is not None:
            before = bytes(before)
            txn.delete(_time_key(Entry.decode(before).time, key), db=self._by_time)
        if value is None:
            txn.delete(key, db=self._samples)
        else:
            txn.put(key, value.encode(), db=self._samples)
            txn.put(_time_key(value.time, key), b"", db=self._by_time)
        return before

    @contextmanager
    def _txn(self, write: bool = False, db: str | None = None) -> Iterator:
        """A transaction on database ``db`` (an attribute's name, read under the lock: a reopen changes handles)."""
        with self._env_lock, self.env.begin(write=write, db=None if db is None else getattr(self, db)) as txn:
            yield txn

    def get(self, id: str) -> Entry | None:
        key = _key(id)
        with self._lock:
            if key in self._changed:
                return self._changed[key]
        return self._committed(key)

    def _committed(self, key: bytes) -> Entry | None:
        with self._txn(db="_samples") as txn:
            data = txn.get(key)
        return None if data is None else Entry.decode(bytes(data))

    @property
    def generation(self) -> int:
        """The last commit's."""
        with self._txn(db="_meta") as txn:
            return _int(txn.get(b"generation"))

    def __len__(self) -> int:
        """Ids in the table now (committed, with the changes since)."""
        return self._count

    def _committed_count(self) -> int:
        with self._txn(db="_samples") as txn:
            return txn.stat(self._samples)["entries"]

    def bytes_on_disk(self) -> int:
        """The pages in use (the data file is sparse beyond them); 0 once closed (a group's partition let go)."""
        with self._env_lock:
            if self.closed:
                return 0
            info, stat = self.env.info(), self.env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]

    def put(self, id: str, entry: Entry) -> None:
        self._change(_key(id), replace(entry, id=id))

    def delete(self, id: str) -> None:
        self._change(_key(id), None)

    def _change(self, key: bytes, value: Entry | None) -> None:
        with self._lock:
            had = self._changed[key] is not None if key in self._changed else None
        if had is None:
            had = self._committed(key) is not None
        with self._lock:
            self._changed[key] = value
            self._count += (value is not None) - had

    def expire(self, now: float) -> int:
        """Drop the ids whose record time is more than ``retention_s`` before ``now``; returns how many."""
        cutoff = _time_key(now - self.retention_s, b"")
        old: list[bytes] = []
        with self._txn(db="_by_time") as txn:
            cursor = txn.cursor()
            if cursor.first():
                for key in cursor.iternext(values=False):
                    if key >= cutoff:
                        break
                    old.append(bytes(key[8:]))
        with self._lock:
            old = [k for k in old if k not in self._changed]  # changed since: its new time decides
            old += [k for k, v in self._changed.items() if v is not None and v.time < now - self.retention_s]
            for key in old:
                self._changed[key] = None
            self._count -= len(old)
        return len(old)

    def commit(self, generation: int) -> dict[bytes, Entry | None]:
        """Write the changes since the last commit as ``generation``, with undo records; returns them (None: gone)."""
        with self._lock:
            changes = dict(self._changed)
        prefix = struct.pack(">Q", generation)
        with self._txn(write=True) as txn:
            for key, value in changes.items():
                before = self._replace(txn, key, value)
                self._deleted |= value is None and before is not None
                txn.put(prefix + key, b"\x00" if before is None else b"\x01" + before, db=self._undo,
                        overwrite=False)  # the first change of a generation keeps the value before it
            txn.put(b"generation", str(generation).encode(), db=self._meta)
        with self._lock:
            for key, value in changes.items():
                if self._changed.get(key, ...) is value:
                    del self._changed[key]
        return changes

    def rebuild(self, records: Iterable[list[tuple[bytes, Entry | None, bool]]]) -> int:
        """Fill this (empty) table from batches of changelog records (key, entry or None, applied); returns how many
        keys were not applied: they are written out again at the next commit."""
        skipped: set[bytes] = set()
        for batch in records:
            with self._txn(write=True) as txn:
                for key, value, applied in batch:
                    if not applied:
                        skipped.add(key)
                        continue
                    before = self._replace(txn, key, value)
                    self._deleted |= value is None and before is not None
        self._count = self._committed_count()
        if self._deleted:
            self._reopen(compact=True)
        with self._lock:
            self._changed.update({key: self._committed(key) for key in skipped})
        return len(skipped)

    def settle(self, generation: int) -> None:
        """Checkpoint ``generation`` is on disk: no restart goes back before it, so its undo records go."""
        limit = struct.pack(">Q", generation + 1)
        with self._txn(write=True, db="_undo") as txn:
            cursor = txn.cursor()
            while cursor.first() and bytes(cursor.key()) < limit:
                cursor.delete()
            txn.put(b"settled", str(generation).encode(), db=self._meta)
        self._reopen(compact=self._deleted and time.monotonic() - self._compacted_at >= self.compact_every_s)

    def _reopen(self, compact: bool = False) -> None:
        """Reopen the environment, so its mapped pages leave the RSS; ``compact``: first swap in a compacted copy."""
        copy, old = self.path.with_name(self.path.name + ".compact"), self.path.with_name(self.path.name + ".old")
        with self._env_lock:
            if compact:
                if copy.is_dir():
                    shutil.rmtree(copy)
                copy.mkdir()
                self.env.copy(str(copy), compact=True)
            self.env.close()
            if compact:
                self.path.rename(old)
                copy.rename(self.path)
                shutil.rmtree(old)
            self._open()
        if compact:
            self._deleted, self._compacted_at = False, time.monotonic()

    def restore(self, generation: int) -> None:
        """Back to the table checkpoint ``generation`` saw: forget the changes in memory, undo later commits."""
        with self._lock:
            self._changed.clear()
        with self._txn(db="_meta") as txn:
            at, settled = _int(txn.get(b"generation")), _int(txn.get(b"settled"))
        if at < generation or settled > generation:
            raise StateRefused(f"the sample table {self.path} is at generation {at} (settled at {settled}), not one "
                               f"that goes back to the checkpoint's {generation}: it is not the table this checkpoint "
                               f"was written with (move both away to learn from scratch)")
        with self._txn(write=True) as txn:
            cursor = txn.cursor(db=self._undo)
            later = [(bytes(k), bytes(v)) for k, v in cursor.iternext()
                     if struct.unpack(">Q", bytes(k[:8]))[0] > generation]
            for key, value in sorted(later, reverse=True):  # the newest generation first
                self._replace(txn, key[8:], None if value == b"\x00" else Entry.decode(value[1:]))
                txn.delete(key, db=self._undo)
            txn.put(b"generation", str(generation).encode(), db=self._meta)
        self._count = self._committed_count()

    def ids(self) -> list[str]:
        """Every id in the table now (for tests and the admin's inspection)."""
        with self._txn(db="_samples") as txn:
            committed = {bytes(k): Entry.decode(bytes(v)).id for k, v in txn.cursor().iternext()}
        with self._lock:
            for key, value in self._changed.items():
                if value is None:
                    committed.pop(key, None)
                else:
                    committed[key] = value.id
        return sorted(committed.values())

    def close(self) -> None:
        with self._env_lock:
            self.closed = True
            self.env.close()


def _claim(table: SampleTable) -> None:
    """Record ``table`` as its path's one open environment here; refuse one another live table holds (after a gc)."""
    key = table.path.resolve()
    if _held_elsewhere(key, table):
        gc.collect()
        if _held_elsewhere(key, table):
            raise StateRefused(f"the sample table {table.path} is already open in this process: LMDB allows one "
                               f"environment per file per process (close the other table first)")
    _OPEN[key] = table


def _held_elsewhere(key: Path, table: SampleTable) -> bool:
    other = _OPEN.get(key)
    return other is not None and other is not table and not other.closed
