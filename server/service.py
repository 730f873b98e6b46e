"""One running service: the model state, the learner loop that feeds it, and the batcher predictions go through.

The FastAPI lifespan starts it and stops it; routers reach it through ``server.dependencies.get_service``.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.batching import MicroBatcher
from server.config import ServeConfig
from server.metrics import ServerMetrics
from server.state import ServiceState
from server.stream import LearnerLoop


@dataclass
class Service:
    state: ServiceState
    loop: LearnerLoop
    batcher: MicroBatcher

    @classmethod
    def start(cls, settings: ServeConfig, metrics: ServerMetrics) -> Service:
        """Load the model (or restore its checkpoint) and start learning from Kafka in the loop's thread."""
        state = ServiceState(settings, metrics)
        service = cls(state, LearnerLoop(state), MicroBatcher())
        service.loop.start()
        return service

    def stop(self) -> None:
        """Learn the records in hand, checkpoint and commit, then stop learning."""
        self.loop.stop()
