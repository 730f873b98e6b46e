"""What the web layer needs from a running service, whichever its role: the ``ServingModel`` protocol.

The learner's ``server.learner.service.Service`` and a replica's ``server.replica.follower.ReplicaService`` both
implement it (``Serving`` holds what they share); the routers and ``server.web.prediction`` use nothing else, so
neither role's loop, state or book reaches the HTTP layer. What only a learner does is a protocol of its own
(``Checkpointing``), and each role answers ``status`` and ``readiness`` in a type of its own (``server.status``).
It lives beside the roles and the web layer, not in either: the roles implement it without importing the web
layer, and the web layer reads it without importing a role.
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
    """A service that keeps a checkpoint (a learner; a replica's source of truth is the learner's): the checkpoint
    route asks for one, and answers 409 ``not_a_learner`` to a service that is not one."""

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
    """The ``ServingModel`` members both roles share, over their ``state`` (snapshot, class names, metrics),
    ``loop`` (the Kafka thread and its controls) and ``batcher``; each role adds ``status`` and ``readiness``."""

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
        """Write an upload answered with ``prediction`` to the image topic, where its label, when it comes on the
        labels topic, teaches the learner with it (``server.uploads``)."""
        self._forwarder().send(id, image, content_type, prediction)

    def write_label(self, id: str, label: int | None) -> RecordMetadata:
        """Write a label for ``id`` (None: its deletion) to the labels topic (with labels inline and corrections on:
        the image topic), acknowledged (``server.uploads``)."""
        return self._forwarder().send_label(id, label, inline=self.state.cfg.corrections.enabled)

    def _forwarder(self) -> UploadForwarder:
        with _UPLOADS_LOCK:
            if getattr(self, "_uploads", None) is None:
                self._uploads = UploadForwarder(self.state.cfg.kafka)
        return self._uploads

    def _close_uploads(self) -> None:
        if getattr(self, "_uploads", None) is not None:
            self._uploads.close()
