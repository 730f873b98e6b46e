"""Small file utilities shared by artifacts, checkpoints and caches: hashing and atomic writes."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(final: str | Path, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; on success fsync it and rename it into place.

    Works for a file or a folder written at the temporary path. A crash leaves ``final`` either absent or
    complete, never half-written. With ``replace=False`` an existing ``final`` wins (for caches that several
    processes may fill at once: the first complete copy stays, later ones are dropped).
    """
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    try:
        yield tmp
        for f in [tmp] if tmp.is_file() else [p for p in tmp.rglob("*") if p.is_file()]:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists() and not replace:
            return
        if final.is_dir():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
