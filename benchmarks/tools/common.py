"""Small helpers every kind of benchmark shares: a mean with its spread, and waiting until something is ready."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import httpx

T = TypeVar("T")


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value), as the docs' tables give them.

    Example:
        >>> mean_std([2.0, 4.0, 6.0])
        (4.0, 2.0)
        >>> mean_std([0.5])
        (0.5, 0.0)
    """
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def wait_until(ready: Callable[[], T], what: str, timeout: float = 600, poll: float = 0.5,
               processes: Sequence[subprocess.Popen] = (),
               transient: tuple[type[Exception], ...] = (httpx.TransportError,)) -> T:
    """Call ``ready`` every ``poll`` seconds until it returns something true, and return that.

    Raises ``RuntimeError`` as soon as one of ``processes`` (what ``ready`` waits on) has exited, and
    ``TimeoutError`` after ``timeout`` seconds; a ``transient`` error (by default: the server does not answer yet)
    counts as not ready.

    Example:
        >>> calls = iter([0, 0, 3])
        >>> wait_until(lambda: next(calls), "the third call", poll=0)
        3
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if exited := [p for p in processes if p.poll() is not None]:
            raise RuntimeError(f"waiting for {what}: {exited[0].args[:4]} exited with code {exited[0].returncode} "
                               "(its log is in the work folder)")
        try:
            if value := ready():
                return value
        except transient:
            pass
        time.sleep(poll)
    raise TimeoutError(f"timed out waiting for {what} ({timeout:g} s)")
