"""The one thread that runs the model and owns the learner's state: building it, booking records, learning steps,
snapshots, evaluations, partition changes and predictions, taken one at a time from one queue.

Why one thread: PyTorch's CPU kernels run each parallel region in an OpenMP team that belongs to the calling
thread, and GNU OpenMP stops spinning between regions (its workers sleep and are woken for every region) as soon
as its threads outnumber the CPUs. A learner thread and request threads that each run the model, each with a
team of its own, therefore slow every operator down, predictions and learning steps alike (docs/performance.md).
One thread has one team. And state that one thread writes needs no lock to stay consistent.

Work runs in the order it is handed in, but for what is handed to ``run_first`` (a prediction): the model thread
runs that at the next pause of the work in progress (``answer_waiting``: a learning step pauses after each block of
its forward), or as soon as it is free. Work that already runs in the model thread calls what it needs directly:
handing work to the queue from the model thread itself would wait for itself, so ``run`` refuses it, and ``check``
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
    """Runs callables one at a time in a single thread named ``name``, and hands back their results."""

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
        if self.owns():
            raise WrongThread(f"{self.name} handed work to its own queue, which would wait for itself: call it "
                              f"directly")
        return self._pool.submit(fn, *args, **kwargs)

    def run_first(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` in the model thread ahead of the work queued: at the next pause of the work in progress
        (``answer_waiting``), or as soon as the thread is free; its result, or its exception raised here."""
        if self.owns():
            raise WrongThread(f"{self.name} handed work to itself, which would wait for itself: call it directly")
        future: Future[T] = Future()
        with self._first_lock:
            self._first.append((fn, args, future))
        self._pool.submit(self.answer_waiting)  # the thread free: at once
        return future.result()

    def answer_waiting(self) -> None:
        """In the model thread: run what was handed to ``run_first`` and waits; a long piece of work calls this at
        each of its pauses, so that what waits for it waits for a part of it, not the whole. Not from within what it
        runs (a prediction's forward pauses too, where it shares the learner's backbone)."""
        self.check()
        if self._answering:
            return
        self._answering = True
        try:
            self._answer()
        finally:
            self._answering = False

    def _answer(self) -> None:
        while True:
            with self._first_lock:
                if not self._first:
                    return
                fn, args, future = self._first.popleft()
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to whoever waits for it
                future.set_exception(e)

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
