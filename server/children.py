"""The processes a command starts (``mepo demo``'s producer and broker), watched: the first to exit with an error
(the producer with a code other than 0, the broker at all) is logged with its last words, named by ``/v1/status`` and
``/readyz``, and the command is told (``on_failure``); one stopped while the command itself stops is no failure.

Example (a child that fails at once):
    >>> import sys
    >>> child = subprocess.Popen([sys.executable, "-c", "raise SystemExit('error: no such option')"],
    ...                          stderr=subprocess.PIPE)
    >>> watch = Watch([Child("the producer", child, done_ok=True, last_words=Tail(child.stderr).last)],
    ...               stopping=lambda: False, period=0.05)
    >>> watch.start(); watch.join(10)
    >>> watch.failure
    'the producer exited with code 1: error: no such option'
"""

from __future__ import annotations

import collections
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from server.learner.service import Service
from server.status import LearnerReadiness, LearnerStatus

log = logging.getLogger(__name__)
GRACE_S = 1.0
"""How long a child's exit waits to be called a failure: for the command to see a stop signal that reached both."""


class Tail(threading.Thread):
    """Copies a child's stderr to ours as it comes, keeping its last lines, which can name why it stopped."""

    def __init__(self, pipe: IO[bytes] | None, out: IO[bytes] | None = None, keep: int = 20):
        super().__init__(name="mepo-child-stderr", daemon=True)
        self.pipe, self.out = pipe, out
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.start()

    def run(self) -> None:
        if self.pipe is None:
            return
        for line in self.pipe:
            if self.out is not None:
                self.out.write(line)
                self.out.flush()
            text = line.decode(errors="replace").rstrip().rsplit("\r", 1)[-1].strip()  # a progress bar's last state
            if text:
                self.lines.append(text)

    def last(self) -> str:
        """The last line written, once the pipe is read to its end."""
        self.join(2.0)
        return self.lines[-1] if self.lines else ""


@dataclass(frozen=True)
class Child:
    name: str
    """How the logs and the status call it: ``the producer (mepo produce)``."""
    process: subprocess.Popen
    done_ok: bool
    """An exit with code 0 is the child's work done (the producer's); False: any exit is a failure (a broker's)."""
    last_words: Callable[[], str]


def describe(child: Child, code: int) -> str:
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    words = child.last_words()
    return f"{child.name} {how}" + (f": {words}" if words else "")


class Watch(threading.Thread):
    """Watches ``children`` until stopped or one fails (``failure``), then calls ``on_failure`` with why."""

    def __init__(self, children: list[Child], stopping: Callable[[], bool],
                 on_failure: Callable[[str], None] = lambda failure: None, period: float = 0.5):
        super().__init__(name="mepo-children", daemon=True)
        self.children, self.stopping, self.on_failure, self.period = children, stopping, on_failure, period
        self.failure: str | None = None
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self.period):
            for child in self.children:
                code = child.process.poll()
                if code is None or (code == 0 and child.done_ok):
                    continue
                if self._stopped.wait(GRACE_S) or self.stopping():  # the command stops too: the child was told to
                    return
                self.failure = describe(child, code)
                log.error("%s", self.failure)
                self.on_failure(self.failure)
                return

    def stop(self) -> None:
        """The command stops its children now: their exits are no failures."""
        self._stopped.set()
        self.join()


def stderr_tail(process: subprocess.Popen) -> Tail:
    return Tail(process.stderr, sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None)


@dataclass
class Supervised(Service):
    """The demo's learner: ``/v1/status`` and ``/readyz`` also name a failed child (``/readyz`` then answers 503)."""

    watch: Watch | None = None

    def _failure(self) -> str | None:
        return None if self.watch is None else self.watch.failure

    def status(self) -> LearnerStatus:
        return super().status().model_copy(update={"child_error": self._failure()})

    def readiness(self) -> LearnerReadiness:
        ready, failure = super().readiness(), self._failure()
        return ready.model_copy(update={"checks": {**ready.checks, "children_running": failure is None},
                                        "child_error": failure})
