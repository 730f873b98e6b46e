"""What the web layer needs from a running service, whichever its role: the ``ServingModel`` protocol.

A learner's ``Service`` and a replica's ``ReplicaService`` implement it (``Serving`` holds what they share); what only
a learner does has protocols of its own (``Checkpointing``, ``HoldsSamples``). Apart, so roles and web share no import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from kafka.producer.future import RecordMetadata

from server.batching import MicroBatcher
from server.config import ServeConfig
from server.consumer import ConsumerThread
from server.metrics import ServerMetrics
from server.snapshot import Answers, Snapshot
from server.status import HeldSample, LearnerReadiness, LearnerStatus, ReplicaReadiness, ReplicaStatus
from server.uploads import UploadForwarder


class ServingModel(Protocol):
    """A running service as the routers see it, whichever its role."""

    @property
    def metrics(self) -> ServerMetrics: ...

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def class_names(self) -> dict[int, str]: ...

    def predict(self, images: Sequence[torch.Tensor]) -> Answers: ...

    def status(self) -> LearnerStatus | ReplicaStatus: ...

    def readiness(self) -> LearnerReadiness | ReplicaReadiness: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def keep_for_label(self, id: str, image: bytes, content_type: str, prediction: int | None) -> None: ...

    def write_label(self, id: str, label: int | None) -> RecordMetadata: ...

    def stop(self) -> None: ...


@runtime_checkable
class Checkpointing(Protocol):
    """A service that keeps a checkpoint (a learner): the checkpoint route answers 409 to any other."""

    def request_checkpoint(self) -> None: ...


class CorrectionsOff(LookupError):
    """The service keeps no sample table: corrections are off (or it is a replica)."""


@runtime_checkable
class HoldsSamples(Protocol):
    """A service that can say what it holds of a learned id (a learner): ``GET /v1/samples/{id}``."""

    def sample(self, id: str) -> HeldSample | None:
        """What is held of ``id`` (None: unknown); ``CorrectionsOff`` where no sample table is kept."""
        ...


Starter = Callable[[ServeConfig, ServerMetrics], ServingModel]
"""What the entry point hands the web app: load the model and start a role's service (``server.serve``)."""


_UPLOADS_LOCK = threading.Lock()


class RoleState(Protocol):
    """What ``Serving`` reads of a role's state (a learner's ``LearnerState``, a replica's ``ReplicaState``)."""

    cfg: ServeConfig
    metrics: ServerMetrics
    class_names: dict[int, str]

    @property
    def snapshot(self) -> Snapshot: ...


class Serving:
    """The ``ServingModel`` members both roles share; each role adds ``status``, ``readiness`` and ``stop``."""

    state: RoleState
    loop: ConsumerThread
    batcher: MicroBatcher

    @property
    def metrics(self) -> ServerMetrics:
        return self.state.metrics

    @property
    def snapshot(self) -> Snapshot:
        return self.state.snapshot

    @property
    def class_names(self) -> dict[int, str]:
        return self.state.class_names

    def predict(self, images: Sequence[torch.Tensor]) -> Answers:
        """The answers of uint8 images [3, S, S]: the snapshot that answered, class probabilities, novelty."""
        return self.batcher.run(lambda: self.state.snapshot, images)

    def pause(self) -> None:
        self.loop.pause()

    def resume(self) -> None:
        self.loop.resume()

    def keep_for_label(self, id: str, image: bytes, content_type: str, prediction: int | None) -> None:
        """Write an upload answered with ``prediction`` to the image topic, for its later label (``server.uploads``)."""
        self._forwarder().send(id, image, content_type, prediction)

    def write_label(self, id: str, label: int | None) -> RecordMetadata:
        """Write a label for ``id`` (None: its deletion), acknowledged (``server.uploads``)."""
        return self._forwarder().send_label(id, label, inline=self.state.cfg.corrections.enabled)

    def _forwarder(self) -> UploadForwarder:
        with _UPLOADS_LOCK:
            if getattr(self, "_uploads", None) is None:
                self._uploads = UploadForwarder(self.state.cfg.kafka)
        return self._uploads

    def _close_uploads(self) -> None:
        if getattr(self, "_uploads", None) is not None:
            self._uploads.close()
