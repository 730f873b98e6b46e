"""The one thread that runs the model and owns the learner's state (building it, booking records, learning steps,
snapshots, evaluations, partition changes, predictions), taking its work one piece at a time from one queue.

One thread, because several threads running the model slow every operator down (PyTorch's OpenMP teams sleep once
threads outnumber the CPUs: docs/performance.md), and state one thread writes needs no lock. Work runs in the order
handed in, but for ``run_first`` (a prediction), at the next pause of the work in progress. Work in the thread calls
what it needs directly (the queue would wait for itself); ``check`` refuses a call from any other thread.

Example:
    >>> worker = ModelThread()
    >>> worker.run(lambda: threading.current_thread().name)
    'mepo-model'
    >>> worker.run(worker.check)  # in the model thread: passes
    >>> worker.run_first(lambda: 2 + 2)  # ahead of the queue
    4
    >>> worker.check()
    Traceback (most recent call last):
    ...
    server.model_thread.WrongThread: called from MainThread; only mepo-model may call this
    >>> worker.shutdown()
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class WrongThread(RuntimeError):
    """State that one thread owns was touched from another: a bug in the caller, never a runtime condition."""


class ModelThread:
    def __init__(self, name: str = "mepo-model"):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._remember)
        self.name = name
        self._ident: int | None = None
        self._first: deque[tuple[Callable, tuple, Future]] = deque()  # handed to ``run_first``, not begun
        self._first_lock = threading.Lock()
        self._answering = False  # in ``answer_waiting`` (the model thread's own flag)

    def _remember(self) -> None:
        threading.current_thread().name = self.name
        self._ident = threading.get_ident()

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """``fn(*args, **kwargs)`` in the model thread: its result, or its exception raised here."""
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> Future[T]:
        """``fn(*args, **kwargs)`` queued for the model thread without waiting for it: its future."""
        self._not_from_itself()
        return self._pool.submit(fn, *args, **kwargs)

    def _not_from_itself(self) -> None:
        if self.owns():
            raise WrongThread(f"{self.name} handed work to its own queue, which would wait for itself: call it "
                              f"directly")

    def run_first(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` in the model thread ahead of the queue, at the next ``answer_waiting`` or once it is free."""
        self._not_from_itself()
        future: Future[T] = Future()
        with self._first_lock:
            self._first.append((fn, args, future))
        self._pool.submit(self.answer_waiting)  # the thread free: at once
        return future.result()

    def answer_waiting(self) -> None:
        """Run what waits from ``run_first``; long work calls this at its pauses (not reentrant: a forward pauses)."""
        self.check()
        if self._answering:
            return
        self._answering = True
        try:
            while True:
                with self._first_lock:
                    if not self._first:
                        return
                    fn, args, future = self._first.popleft()
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to whoever waits for it
                    future.set_exception(e)
        finally:
            self._answering = False

    def owns(self) -> bool:
        return threading.get_ident() == self._ident

    def check(self) -> None:
        if not self.owns():
            raise WrongThread(f"called from {threading.current_thread().name}; only {self.name} may call this")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
