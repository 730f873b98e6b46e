"""Dynamic micro-batching of concurrent prediction requests."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from server.snapshot import Answers, Snapshot


@dataclass
class _Request:
    images: Sequence[torch.Tensor]  # n uint8 images [3, S, S] (a list, or a tensor [n, 3, S, S])
    done: threading.Event = field(default_factory=threading.Event)
    result: Answers | None = None
    error: Exception | None = None


class MicroBatcher:
    """Requests that arrive during a forward are served together by the next one (up to ``max_batch`` images):
    more of the machine is left to the learner under load, and a request alone waits for nothing."""

    def __init__(self, max_batch: int = 64, run: Callable[..., None] = lambda fn, *args: fn(*args)):
        self.max_batch, self._run = max_batch, run  # run: where forwards run (the service's model thread)
        self._forward = threading.Lock()
        self._queue_lock = threading.Lock()
        self._queue: list[_Request] = []

    @property
    def queued(self) -> int:
        with self._queue_lock:
            return len(self._queue)

    def run(self, snapshot: Callable[[], Snapshot], images: Sequence[torch.Tensor]) -> Answers:
        """The answers of ``images`` (the snapshot used, class probabilities [n, n_seen], novelty [n])."""
        request = _Request(images)
        with self._queue_lock:
            self._queue.append(request)
        while not request.done.is_set():
            with self._forward:
                if request.done.is_set():
                    break
                with self._queue_lock:
                    batch: list[_Request] = []
                    size = 0
                    while self._queue and (not batch or size + len(self._queue[0].images) <= self.max_batch):
                        batch.append(self._queue.pop(0))
                        size += len(batch[-1].images)
                self._run(self._serve, snapshot, batch)
        if request.error is not None:
            raise request.error
        assert request.result is not None  # done without an error: answered
        return request.result

    @staticmethod
    def _serve(snapshot: Callable[[], Snapshot], batch: list[_Request]) -> None:
        try:
            answers = snapshot().answer(torch.stack([image for r in batch for image in r.images]))  # sum n images
            for r, part in zip(batch, answers.split([len(r.images) for r in batch]), strict=True):
                r.result = part
        except Exception as e:  # every waiting request gets the error, none hangs
            for r in batch:
                r.error = e
        for r in batch:
            r.done.set()
