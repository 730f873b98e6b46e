"""``mepo evaluate``'s any-time evaluation run inside the stream, plus the accuracy when the stream goes idle (without
a test set, ``--protocol.eval_period 0``, a no-op)."""

from __future__ import annotations

from mepo_stream.alignment import AlignMode
from mepo_stream.anytime import AnytimeCurve, AnytimeEvaluation
from mepo_stream.learner import OnlineLearner


class Evaluator:
    """The any-time curve of one learner and the latest per-class accuracy; read through ``LearnerView``."""

    def __init__(self, evaluation: AnytimeEvaluation | None, mode: AlignMode):
        self.evaluation, self.mode = evaluation, mode
        self.class_accuracy: dict[int, float] = {}  # per class id, of the latest evaluation
        self.idle_evaluated_at = -1  # samples seen at the last evaluation where the stream went idle

    @property
    def curve(self) -> AnytimeCurve:
        return AnytimeCurve() if self.evaluation is None else self.evaluation.curves[self.mode]

    def room(self, learner: OnlineLearner, batch_size: int) -> int:
        """``batch_size``, cut so that an evaluation runs exactly at its scheduled sample count."""
        return batch_size if self.evaluation is None else self.evaluation.room(learner, batch_size)

    def after_batch(self, learner: OnlineLearner) -> int:
        """Run the evaluations now due; returns how many ran."""
        ran = 0
        while self.evaluation is not None and (results := self.evaluation.after_batch(learner)):
            self.class_accuracy, ran = results[self.mode][1], ran + 1
        return ran

    def idle_due(self, learner: OnlineLearner) -> bool:
        """The stream went idle after new learning: measure the accuracy there (A_last of the stream so far)."""
        return self.evaluation is not None and bool(learner.exposed) and self.idle_evaluated_at != learner.samples_seen

    def evaluate_idle(self, learner: OnlineLearner) -> None:
        assert self.evaluation is not None  # idle_due says there is one
        self.class_accuracy = self.evaluation.end_of_task(learner)[self.mode][1]
        self.idle_evaluated_at = learner.samples_seen

    def state_dict(self) -> dict | None:
        return None if self.evaluation is None else self.evaluation.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        """Back to a checkpoint's curve; the per-class accuracy is its last end-of-task one."""
        if self.evaluation is not None and state is not None:
            self.evaluation.load_state_dict(state)
            self.class_accuracy = dict(next(reversed(self.curve.task_class_accuracy), {}))
