"""One running learner: its state, its loop, the prediction batcher and the snapshot publisher."""

from __future__ import annotations

from dataclasses import dataclass

from mepo_stream.records import sample_file
from server.batching import MicroBatcher
from server.config import ServeConfig
from server.learner.partitioned import open_group_learner
from server.learner.publisher import SnapshotPublisher
from server.learner.reporter import StateReporter
from server.learner.state import LearnerState, open_learner
from server.learner.stream import LearnerLoop
from server.metrics import ServerMetrics
from server.model_thread import ModelThread
from server.serving import CorrectionsOff, Serving
from server.status import HeldSample, LearnerReadiness, LearnerStatus


@dataclass
class Service(Serving):
    """The learner: its ``ServingModel`` for the routers is ``Serving``'s, over its state, loop and batcher."""

    state: LearnerState
    loop: LearnerLoop
    batcher: MicroBatcher
    publisher: SnapshotPublisher | None = None

    @classmethod
    def start(cls, settings: ServeConfig, metrics: ServerMetrics) -> Service:
        """Load the model (or restore its checkpoint, or a group's states), start publishing and learning."""
        model_thread = ModelThread()
        opened = open_group_learner if settings.kafka.state_topic is not None else open_learner
        state = opened(settings, metrics, model_thread)
        batcher = MicroBatcher(run=model_thread.run_first)  # a prediction waits for a block of a step, not the whole
        service = cls(state, LearnerLoop(state), batcher, SnapshotPublisher.create(state))
        state.start_following(service.loop.lag)
        if service.publisher is not None:
            state.on_learned = service.publisher.notify
            service.publisher.start()  # it publishes the model as it starts (restored, or empty) first
        service.loop.start()
        return service

    def stop(self) -> None:
        """Learn the records in hand, checkpoint and commit, then stop learning; publish the last snapshot."""
        self.loop.stop()
        self.state.membership.stop_following()
        if self.publisher is not None:
            self.publisher.stop()
        self.state.model_thread.shutdown()
        if (corrections := self.state.intake.corrections) is not None:
            corrections.close()
        self._close_uploads()

    @property
    def reporter(self) -> StateReporter:
        return self.state.reporter

    def status(self) -> LearnerStatus:
        return self.reporter.status(self.loop.health())

    def request_checkpoint(self) -> None:
        self.loop.request_checkpoint()

    def sample(self, id: str) -> HeldSample | None:
        """What the sample table holds of ``id`` (None: unknown), read in the model thread, which owns the table."""
        corrections = self.state.intake.corrections
        if corrections is None:
            raise CorrectionsOff("the learner keeps no sample table: start it with --corrections.enabled")
        if (entry := self.state.model_thread.run(corrections.held, id)) is None:
            return None
        return HeldSample(id=id, label=entry.label, class_name=self.class_names.get(entry.label, str(entry.label)),
                          time=entry.time, file=sample_file(id))

    def readiness(self) -> LearnerReadiness:
        """``/readyz``'s checks: a stopped publisher is not ready (replicas would serve an ever older model)."""
        health = self.loop.health()
        publisher_error = None if self.publisher is None else self.publisher.error
        checks = {"model_loaded": True, "kafka_connected": health.kafka_connected, "learner_running": health.running,
                  "publisher_running": publisher_error is None}
        return LearnerReadiness(checks=checks, learner_error=health.error, publisher_error=publisher_error)
