"""The one thread that runs the model and owns the learner's state: building it, booking records, learning steps,
snapshots, evaluations, partition changes and predictions, taken one at a time from one queue.

Why one thread: PyTorch's CPU kernels run each parallel region in an OpenMP team of the calling thread, and GNU
OpenMP's workers sleep between regions once its threads outnumber the CPUs, so several threads that each run the
model slow every operator down (docs/performance.md). One thread has one team, and state that one thread writes
needs no lock.

Work runs in the order it is handed in, but for what is handed to ``run_first`` (a prediction): that runs at the
next pause of the work in progress (``answer_waiting``), or as soon as the thread is free. Work in the model thread
calls what it needs directly: handing it to the queue would wait for itself, so the queue refuses it, and ``check``
lets an owner's method refuse a call from any other thread.

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
        """``fn(*args)`` in the model thread ahead of the work queued: at the next pause of the work in progress
        (``answer_waiting``), or as soon as the thread is free; its result, or its exception raised here."""
        self._not_from_itself()
        future: Future[T] = Future()
        with self._first_lock:
            self._first.append((fn, args, future))
        self._pool.submit(self.answer_waiting)  # the thread free: at once
        return future.result()

    def answer_waiting(self) -> None:
        """In the model thread: run what waits from ``run_first``; a long piece of work calls this at each of its
        pauses. Not from within what it runs (a prediction's forward pauses too, where it shares the backbone)."""
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
        """Refuse a caller outside the model thread."""
        if not self.owns():
            raise WrongThread(f"called from {threading.current_thread().name}; only {self.name} may call this")

    def shutdown(self) -> None:
        """Finish the work handed in, then end the thread."""
        self._pool.shutdown(wait=True)
