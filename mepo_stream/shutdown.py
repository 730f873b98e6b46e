"""How a long-running command stops: SIGTERM exactly as SIGINT (Ctrl-C), and no child process left behind.

Python turns SIGINT into ``KeyboardInterrupt``, so every ``finally`` and ``with`` block runs on the way out. SIGTERM,
what ``docker stop``, systemd and Kubernetes send, has no handler by default: it ends the process at once and runs
none of them, so the demo's embedded broker would outlive it. The ``mepo`` entry point runs every command inside
``stop_signals``: both signals raise ``Stopped``, a ``KeyboardInterrupt`` that names its signal, so one path serves
both. uvicorn, while it serves, handles both signals itself (a graceful shutdown), then puts our handler back and
raises the signal again: the ``Stopped`` comes out of ``uvicorn.Server.run`` once the service has stopped. A
``Stopped`` that reaches the entry point exits with the shell's code for a signal, 128 + its number.

Example (the handler raises where the main thread is; outside the block, the previous handlers are back):
    >>> import os, signal
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> with stop_signals():
    ...     try:
    ...         os.kill(os.getpid(), signal.SIGTERM)
    ...     except Stopped as stop:
    ...         print(stop.name, stop.exit_code)
    SIGTERM 143
    >>> signal.getsignal(signal.SIGTERM) is before
    True
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A stop signal, raised where the main thread was. A ``KeyboardInterrupt``, so what handles Ctrl-C (uvicorn's
    ``run``, a ``finally``) handles SIGTERM alike."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by a signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


@contextmanager
def _handling(handler: Callable) -> Iterator[None]:
    """``handler`` for both stop signals within the block (only the main thread may set handlers: elsewhere, a
    no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _raise(signum: int, frame) -> None:
    raise Stopped(signum)


def stop_signals():
    """Within the block, SIGINT and SIGTERM raise ``Stopped``: the entry point's, around every command."""
    return _handling(_raise)


class StopRequest:
    """A stop signal held until the work reaches a safe point (``deferred_stop``); a second one stops at once."""

    def __init__(self):
        self.signum: int | None = None

    def __call__(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise Stopped(signum)
        self.signum = signum
        log.warning("%s: stopping at the next safe point (send it again to stop at once)", signal.Signals(signum).name)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def raise_if_requested(self) -> None:
        """Call at a safe point: raise the held ``Stopped``, if a signal came."""
        if self.signum is not None:
            raise Stopped(self.signum)


@contextmanager
def deferred_stop() -> Iterator[StopRequest]:
    """Within the block, a stop signal is only recorded: the work checks ``requested`` (or calls
    ``raise_if_requested``) where it can stop consistently, for example after writing a checkpoint. One that came
    after the last check is raised when the block ends, never dropped."""
    request = StopRequest()
    with _handling(request):
        yield request
    request.raise_if_requested()


def stop_process(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """Terminate a child and wait for it, killing it after ``timeout`` seconds, or at once when another stop signal
    interrupts the wait: no child outlives the command that started it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop within %.0f s of SIGTERM: killed", process.args, timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@contextmanager
def child_process(args: Sequence[str], **popen) -> Iterator[subprocess.Popen]:
    """A child process (``subprocess.Popen(args, **popen)``) stopped by ``stop_process`` however the block ends."""
    process = subprocess.Popen(args, **popen)
    try:
        yield process
    finally:
        stop_process(process)
