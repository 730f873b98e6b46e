"""The prediction micro-batcher with the interleavings forced: requests queued while a forward runs share the next.

A fake snapshot stands in for the model: its "probabilities" of an image are the image's id (its first pixel), and so
is its novelty score, so every answer shows which rows a request got, and a gate holds a forward open while other
requests queue up.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

import pytest
import torch

from server.batching import MicroBatcher
from server.snapshot import Answers
from tests.helpers import wait_for


def images(*ids: int) -> torch.Tensor:
    """uint8 images [n, 3, 2, 2] whose pixels are their id."""
    return torch.tensor(ids, dtype=torch.uint8)[:, None, None, None].expand(-1, 3, 2, 2).contiguous()


@dataclass
class FakeSnapshot:
    """Records every forward's image ids; the first ``hold`` forwards wait at the gate once inside."""

    version: int = 1
    hold: int = 0
    fail: bool = False
    forwards: list[list[int]] = field(default_factory=list)
    inside: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)

    def answer(self, batch: torch.Tensor) -> Answers:
        self.forwards.append(batch[:, 0, 0, 0].tolist())
        if len(self.forwards) <= self.hold:
            self.inside.set()
            assert self.gate.wait(30), "the test never opened the gate"
        if self.fail:
            raise RuntimeError("the forward failed")
        probs = batch[:, 0, 0, :1].float() + self.version / 10  # [n, 1]: id + version / 10
        return Answers(self, probs, batch[:, 0, 0, 0].float())  # type: ignore[arg-type]  # novelty [n]: the id


class Requests:
    """Requests run in threads; ``results[name]`` is the (snapshot version, ids) or the error a request got.
    ``published[-1]`` is the snapshot the service publishes now."""

    def __init__(self, batcher: MicroBatcher, snapshot: FakeSnapshot):
        self.batcher, self.published = batcher, [snapshot]
        self.results: dict[str, object] = {}
        self.threads: list[threading.Thread] = []

    def start(self, name: str, batch: torch.Tensor) -> None:
        def run() -> None:
            try:
                answers = self.batcher.run(lambda: self.published[-1], batch)
                assert answers.novelty is not None and torch.equal(answers.novelty, batch[:, 0, 0, 0].float())
                self.results[name] = (answers.snapshot.version, [round(p, 1) for p in answers.probs[:, 0].tolist()])
            except Exception as e:
                self.results[name] = e

        self.threads.append(threading.Thread(target=run, name=name))
        self.threads[-1].start()

    def join(self) -> dict[str, object]:
        for t in self.threads:
            t.join(30)
            assert not t.is_alive(), f"request {t.name} hangs"
        return self.results


def queued(batcher: MicroBatcher, n: int):
    return wait_for(lambda: batcher.queued == n, 30, f"{n} requests queued behind the running forward")


def test_a_lone_request_runs_at_once_and_gets_its_own_rows():
    snap = FakeSnapshot()
    batcher = MicroBatcher()
    answers = batcher.run(lambda: snap, images(3, 4))
    assert answers.snapshot is snap and answers.probs[:, 0].tolist() == pytest.approx([3.1, 4.1])
    assert answers.novelty is not None and answers.novelty.tolist() == [3, 4] and snap.forwards == [[3, 4]]
    assert batcher.queued == 0


def test_requests_queued_during_a_forward_share_the_next_one_and_each_gets_its_rows():
    snap = FakeSnapshot(hold=1)
    batcher = MicroBatcher(max_batch=64)
    requests = Requests(batcher, snap)
    requests.start("a", images(1))
    assert snap.inside.wait(30)  # a's forward is running
    requests.start("b", images(2, 3))
    queued(batcher, 1)
    requests.start("c", images(4))
    queued(batcher, 2)
    requests.published.append(replace(snap, version=2))  # the learner publishes: the next forward uses it
    snap.gate.set()
    results = requests.join()
    assert snap.forwards == [[1], [2, 3, 4]]  # b and c: one forward, in arrival order
    assert results == {"a": (1, [1.1]), "b": (2, [2.2, 3.2]), "c": (2, [4.2])}


def test_a_forward_takes_at_most_max_batch_images_in_arrival_order():
    snap = FakeSnapshot(hold=1)
    batcher = MicroBatcher(max_batch=4)
    requests = Requests(batcher, snap)
    requests.start("first", images(0))
    assert snap.inside.wait(30)
    for i, ids in enumerate([(1, 2), (3,), (4, 5), (6, 7, 8, 9, 10), (11,)]):  # 11 images behind the gate
        requests.start(f"r{i}", images(*ids))
        queued(batcher, i + 1)
    snap.gate.set()
    results = requests.join()
    # (1, 2) + (3) fit, (4, 5) would make 5; a request larger than max_batch still runs, alone
    assert snap.forwards == [[0], [1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]
    assert results["r3"] == (1, [6.1, 7.1, 8.1, 9.1, 10.1]) and results["r4"] == (1, [11.1])


def test_an_error_reaches_every_request_of_its_forward_and_the_next_forward_works():
    snap = FakeSnapshot(hold=1)
    batcher = MicroBatcher()
    requests = Requests(batcher, snap)
    requests.start("a", images(1))
    assert snap.inside.wait(30)
    requests.start("b", images(2))
    queued(batcher, 1)
    requests.start("c", images(3))
    queued(batcher, 2)
    snap.fail = True
    snap.gate.set()
    results = requests.join()
    assert all(isinstance(results[name], RuntimeError) for name in "abc"), results
    assert snap.forwards == [[1], [2, 3]]
    snap.fail = False
    assert batcher.run(lambda: snap, images(5)).probs[:, 0].tolist() == pytest.approx([5.1])  # nothing stuck
