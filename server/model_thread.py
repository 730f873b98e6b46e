"""The one thread that runs the model: building it, learning steps, snapshots, evaluations and predictions.

Why one thread: PyTorch's CPU kernels run each parallel region in an OpenMP team that belongs to the calling
thread, and GNU OpenMP stops spinning between regions (its workers sleep and are woken for every region) as soon
as its threads outnumber the CPUs. A learner thread and request threads that each run the model, each with a
team of its own, therefore slow every operator down, predictions and learning steps alike (docs/performance.md).
One thread has one team.

The order it gives is the order work is handed in: a prediction asked for during a learning turn (the
mini-batches pending, most often one) runs right after it, before the learner's next one. Calls made from the
model thread itself run inline, so code that already runs there may call into code that hands work over.

Example:
    >>> worker = ModelThread()
    >>> worker.run(lambda: threading.current_thread().name)
    'mepo-model'
    >>> worker.run(lambda: worker.run(lambda: 2 + 2))  # from the model thread itself: inline, no deadlock
    4
    >>> worker.shutdown()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def finished(fn: Callable[..., T], *args, **kwargs) -> Future[T]:
    """``fn(*args, **kwargs)`` run here and now, as a finished future: its result, or the exception it raised."""
    future: Future[T] = Future()
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as e:  # handed to whoever reads the result, as a pool would
        future.set_exception(e)
    return future


class ModelThread:
    """Runs callables one at a time in a single thread named ``name``, and hands back their results."""

    def __init__(self, name: str = "mepo-model"):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._remember)
        self._name = name
        self._ident: int | None = None
        self._queued = 0  # handed in from other threads, not begun
        self._lock = threading.Lock()

    def _remember(self) -> None:
        threading.current_thread().name = self._name
        self._ident = threading.get_ident()

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` in the model thread: its result, or its exception raised here."""
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> Future[T]:
        """``fn(*args, **kwargs)`` handed to the model thread without waiting for it: its future (already finished
        when called from the model thread itself, which runs it inline)."""
        if threading.get_ident() != self._ident:
            with self._lock:
                self._queued += 1
            return self._pool.submit(self._begin, fn, *args, **kwargs)
        return finished(fn, *args, **kwargs)

    def _begin(self, fn: Callable[..., T], *args, **kwargs) -> T:
        with self._lock:
            self._queued -= 1
        return fn(*args, **kwargs)

    def others_waiting(self) -> bool:
        """Work handed in from other threads waits to begin: a long run of work in the model thread (the learner's
        turns while a backlog lasts) lets it in at its next turn, as a learning step would."""
        return self._queued > 0

    def shutdown(self) -> None:
        """Finish the work handed in, then end the thread."""
        self._pool.shutdown(wait=True)
