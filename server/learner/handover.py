"""Decoding between steps: the model thread books each poll itself, then goes straight on to the next step.

Beside a CPU model (no decode pool) a poll's images are decoded between two learning steps,
since decoding beside a CPU forward costs it more than the decoding's own time (docs/performance.md). Had the loop
thread booked them, each turn would pass the model thread's work to the loop and back: two thread wake-ups and the
loop's own checks between every two steps. Instead ``Handover.turn`` hands the poll to the model thread, which books
it (``Intake.accept``: claims, decodes, books) right after the step in flight and, once a mini-batch is full, learns
it in the same turn. The loop waits only for the booking, sends what it returns, and reads the next poll while that
step runs.

Reading with librdkafka, ``backlog`` goes further: while records come, the loop's turns (learn, poll without
waiting, book) run one after another in the model thread, with nothing passed between threads at all; the loop
thread takes over to wait for the topic when it goes quiet, and for anything that may wait for the broker or the
disk (a checkpoint, a commit, the broker probe). kafka-python cannot: its rebalance callbacks run on its IO thread
and hand work to the model thread, which would be waiting inside the poll. Those turns are the loop's own, in its
order, so its guarantees hold as they do in the loop thread; a prediction handed in meanwhile runs after the turn
in flight.

What keeps the guarantees of ``server.learner.stream``:

* the records are booked in offset order, in the one thread that learns, so a step learns only what was booked
  before it, as when the loop booked them;
* the loop sends the dead letters and predictions of a booking before it does anything else, so every one of them
  is sent before the loop's next checkpoint, which the model thread captures after the step in flight;
* ``settle`` waits for that step before anything that must not run beside it (a reconnect forgetting the pending
  records), and a step that failed raises in the loop at the next turn.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait

from server.learner.intake import Outgoing
from server.learner.state import LearnerState
from server.model_thread import ModelThread

Poll = Callable[[int, int], list]
"""The loop's poll: ``(wait_ms, max_records)`` to the records read, in offset order."""


class Handover:
    """The loop's turns where decoding runs between steps, over the model thread's turn in flight."""

    def __init__(self, state: LearnerState, checkpoint_due: Callable[[], bool]):
        self.state, self.checkpoint_due = state, checkpoint_due
        """``checkpoint_due``: the loop will checkpoint once this turn's poll is booked (asked in the model thread
        while the loop waits for the booking)."""
        self.stepping: Future | None = None
        """The model thread's last turn (booking a poll, then learning once a mini-batch is full); None: settled."""
        self.learns = False
        """Whether that turn goes on from its booking to a step (which learns everything pending)."""
        self.step_limit = 0
        """The size of the mini-batch the last turn began to learn: the next poll's, as the loop's was."""

    def turn(self, poll: Poll, fill_wait_ms: Callable[[], int]) -> tuple[list, list[Outgoing]]:
        """Read a poll while the model thread learns, and have it book the records and learn what is then due; the
        records read and, once booked, what the loop must send.

        The poll is sized as the loop sized it before: while a step runs, the size of its mini-batch (it learns
        everything pending), else what fills the pending one, waiting ``fill_wait_ms()`` for it. A poll that comes
        back empty learns what is pending (the topic went quiet), or, while a step runs, waits for that step."""
        try:
            learning = self.learns and self.stepping is not None and not self.stepping.done()
            if not learning:
                self.settle(raises=True)
            pending = 0 if learning else sum(self.state.intake.waiting().values())
            limit = self.step_limit if learning else self.state.batch_limit
            room = limit - pending  # none: a full mini-batch waits (after a pause), learned now
            records = poll(0 if learning else fill_wait_ms(), room) if room > 0 else []
            if not records and (learning or not pending):
                self.settle(raises=True)
                return records, []
            booked: Future[tuple[list[Outgoing], bool]] = Future()
            self.stepping = self.state.model_thread.submit(self._book_then_learn, records, booked)
            outgoing, self.learns = booked.result()
            return records, outgoing
        except BaseException:
            self.settle(raises=False)
            raise

    def _book_then_learn(self, records: list, booked: Future[tuple[list[Outgoing], bool]]) -> None:
        """In the model thread: book ``records`` (handing back what to send and whether a step follows), then learn
        what is pending if a mini-batch is full or no records came. A full one waits for the next turn where the loop
        checkpoints at this one: its capture then holds what was learned before this poll, without waiting for
        another step."""
        try:
            outgoing = self.state.intake.accept(records)
            pending, self.step_limit = sum(self.state.intake.waiting().values()), self.state.batch_limit
            learns = (pending >= self.step_limit and not self.checkpoint_due()) or bool(pending and not records)
        except BaseException as e:
            booked.set_exception(e)
            raise
        booked.set_result((outgoing, learns))
        if learns:
            self.state.learn_pending()

    def settle(self, raises: bool) -> None:
        """Wait for the model thread's turn in flight; ``raises``: its error, if it failed (a step's error, since its
        booking's is raised where it is handed back)."""
        stepping, self.stepping = self.stepping, None
        if stepping is None:
            return
        wait([stepping])
        if raises and (error := stepping.exception()) is not None:
            raise error


def backlog(turn: Callable[[bool], bool], model: ModelThread, steered: Callable[[], bool]) -> bool:
    """In the model thread: the loop's turns (``turn(waits=False)``: learn, poll without waiting, book), one after
    another while records come, so no work passes between threads between two steps. Returns whether to go on: True
    once work handed to the model thread from elsewhere waits (a prediction runs after the turn in flight, as it
    would after a step); False once a poll comes back empty, or once ``steered`` (stop, pause, a checkpoint asked
    for or due, a write on disk to commit): the loop thread's own turn then waits for records, or does what may
    wait for the broker or the disk, so the model thread, which answers predictions, never waits on either."""
    while not steered():
        if not turn(False):
            return False
        if model.others_waiting():
            return True
    return False
