"""The one thread that runs the model and owns the learner's state: building it, booking records, learning steps,
snapshots, evaluations, partition changes and predictions, taken one at a time from one queue.

Why one thread: PyTorch's CPU kernels run each parallel region in an OpenMP team that belongs to the calling
thread, and GNU OpenMP stops spinning between regions (its workers sleep and are woken for every region) as soon
as its threads outnumber the CPUs. A learner thread and request threads that each run the model, each with a
team of its own, therefore slow every operator down, predictions and learning steps alike (docs/performance.md).
One thread has one team. And state that one thread writes needs no lock to stay consistent.

The order it gives is the order work is handed in: a prediction asked for during a learning turn runs right after
it. Work that already runs in the model thread calls what it needs directly: handing work to the queue from the
model thread itself would wait for itself, so ``run`` refuses it, and ``check`` lets an owner's method refuse a
call from any other thread.

Example:
    >>> worker = ModelThread()
    >>> worker.run(lambda: threading.current_thread().name)
    'mepo-model'
    >>> worker.run(worker.check)  # in the model thread: passes
    >>> worker.check()
    Traceback (most recent call last):
    ...
    server.model_thread.WrongThread: called from MainThread; only mepo-model may call this
    >>> worker.shutdown()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class WrongThread(RuntimeError):
    """State that one thread owns was touched from another: a bug in the caller, never a runtime condition."""


class ModelThread:
    """Runs callables one at a time in a single thread named ``name``, and hands back their results."""

    def __init__(self, name: str = "mepo-model"):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._remember)
        self.name = name
        self._ident: int | None = None

    def _remember(self) -> None:
        threading.current_thread().name = self.name
        self._ident = threading.get_ident()

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` in the model thread: its result, or its exception raised here."""
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> Future[T]:
        """``fn(*args, **kwargs)`` queued for the model thread without waiting for it: its future."""
        if self.owns():
            raise WrongThread(f"{self.name} handed work to its own queue, which would wait for itself: call it "
                              f"directly")
        return self._pool.submit(fn, *args, **kwargs)

    def owns(self) -> bool:
        """Whether the calling thread is the model thread."""
        return threading.get_ident() == self._ident

    def check(self) -> None:
        """Refuse a caller outside the model thread: what it is about to touch belongs to the model thread."""
        if not self.owns():
            raise WrongThread(f"called from {threading.current_thread().name}; only {self.name} may call this")

    def shutdown(self) -> None:
        """Finish the work handed in, then end the thread."""
        self._pool.shutdown(wait=True)
