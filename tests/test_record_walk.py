"""One record's walk: the objects a record passes through from the consumer's poll to the model update (issue 43).

The learner loop's own ``_run`` (fake Kafka clients, a real tiny learner) consumes one mini-batch while a profiler
follows one marked record in every thread. An object is on the walk when one of its methods is handed the record, or
what it becomes (its meta, its decoded image, its sample, the mini-batch or stacked images holding it), or holds it
in a local variable: an object of the project (a class of ``server`` or ``mepo_stream``) or an executor. Plain
records of values that carry it (``Sample``, ``Pending``, ``RecordMeta``, ``_Claimed``: dataclasses of init fields,
tuples) are its envelopes, not stops; the model thread's own pool is the model thread. The walk ends at the learner
(``OnlineLearner``), whose method is the update.

The same tracer, run on commit 0c46a3d (before the walk was shortened), found 8 objects: LearnerLoop, Intake,
InlineExecutor (the decoder of ``decode_workers`` 0, which only called back into the intake), StreamBook,
LearnerState, ModelThread (handed each mini-batch), Alone (which only called the learner) and OnlineLearner.
"""

from __future__ import annotations

import dataclasses
import io
import sys
import threading
from concurrent.futures import Executor, Future
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from mepo_stream.anytime import ProtocolConfig
from mepo_stream.images import decode_image
from mepo_stream.learner import OnlineLearner
from mepo_stream.records import RecordMeta
from server.learner.changelog import Changelog
from server.learner.partitioned import open_group_learner
from server.learner.state import open_learner
from server.learner.stream import LearnerLoop
from server.metrics import ServerMetrics
from server.model_thread import ModelThread
from tests.fakes import STREAM_ID, FakeProducer, record, run_loop
from tests.helpers import settings

MARKED = 5  # the sample index (and offset) of the record followed
PROJECT = ("server.", "mepo_stream.")


def noisy_jpeg(index: int) -> bytes:
    """An image no other sample shares, so that a tensor holds the marked record only if it holds its image."""
    pixels = np.random.default_rng(index).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return buf.getvalue()


def is_envelope(value) -> bool:
    """A plain record of values (a dataclass instance whose fields are all given at construction)."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and all(
        f.init for f in dataclasses.fields(value))


class Walk:
    """A profile hook that collects, in the order first met, the objects the marked record passes through."""

    def __init__(self, marked, image: torch.Tensor):
        self.marked, self.image = marked, image  # the record, and its decoded image [3, S, S]
        self.objects: dict[int, object] = {}
        self.ended = False  # the learner was reached
        self.updating = threading.local()  # the learner's frame being run in this thread: not followed inside

    @property
    def names(self) -> list[str]:
        return [type(obj).__name__ for obj in self.objects.values()]

    def carries(self, value, depth: int = 0) -> bool:
        """``value`` is the marked record or holds it (or its meta, image, sample), in envelopes or containers."""
        if value is self.marked:
            return True
        if depth > 4 or isinstance(value, str | bytes | int | float | type(None)):
            return False
        if isinstance(value, RecordMeta):
            return value.stream_id == STREAM_ID and value.sample_index == MARKED
        if isinstance(value, torch.Tensor):
            return value.dtype == torch.uint8 and value.dim() in (3, 4) and value.shape[-3:] == self.image.shape \
                and any(torch.equal(v, self.image) for v in (value if value.dim() == 4 else [value]))
        if isinstance(value, Future):
            return value.done() and value.exception() is None and self.carries(value.result(), depth + 1)
        if isinstance(value, list | tuple | set | frozenset):
            return any(self.carries(v, depth + 1) for v in value)
        if isinstance(value, dict):
            return any(self.carries(v, depth + 1) for v in value.values())
        if is_envelope(value):
            return any(self.carries(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
        return False

    def stop(self, obj, frame) -> bool:
        """An object the walk can stop at: the project's, or an executor (not the model thread's own pool)."""
        if is_envelope(obj) or isinstance(obj, tuple):
            return False
        if isinstance(obj, Executor):
            caller = frame.f_back.f_locals.get("self") if frame.f_back is not None else None
            return not isinstance(caller, ModelThread)
        return type(obj).__module__.startswith(PROJECT)

    def __call__(self, frame, event, arg):
        if self.ended or event not in ("call", "return"):
            return
        if getattr(self.updating, "frame", None) is not None:
            if event == "return" and frame is self.updating.frame:
                self.updating.frame, self.ended = None, True
            return
        values = dict(frame.f_locals)
        obj = values.pop("self", None)
        if obj is None or not self.stop(obj, frame):
            return
        if not (self.carries(list(values.values())) or (event == "return" and self.carries(arg))):
            return
        self.objects.setdefault(id(obj), obj)
        if isinstance(obj, OnlineLearner) and event == "call":
            self.updating.frame = frame


def follow(monkeypatch, loop: LearnerLoop) -> Walk:
    """Run the loop over one mini-batch of records (batch size 16) and follow the marked one to the update."""
    log = [record(i, i, value=noisy_jpeg(i)) for i in range(16)]
    walk = Walk(log[MARKED], decode_image(log[MARKED].value, loop.cfg.limits))
    model_thread = loop.state.model_thread
    model_thread.run(sys.setprofile, walk)
    threading.setprofile(walk)  # the decode pool's threads, started as the first images are handed to it
    sys.setprofile(walk)
    try:
        run_loop(monkeypatch, loop, log)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        model_thread.run(sys.setprofile, None)
    assert loop.state.learner.samples_seen == 16 and walk.ended
    return walk


def learner_loop(tmp_path, **kw) -> LearnerLoop:
    cfg = settings(SimpleNamespace(bootstrap="127.0.0.1:9"), tmp_path, protocol=ProtocolConfig(eval_period=0), **kw)
    loop = LearnerLoop(open_learner(cfg, ServerMetrics()))
    loop.producer = FakeProducer()
    return loop


def test_a_record_passes_through_five_objects_from_the_poll_to_the_model_update(tmp_path, monkeypatch):
    """A learner alone, decoding inline (``decode_workers=0``, a CPU learner's default, pinned: a GPU's is a pool).
    Fewer than the 6 objects of the learner before it was split by concern (loop, ``ServiceState``, book, executor,
    model thread, learner), and the 8 right after: the intake decodes each image itself (no ``InlineExecutor``
    hop), the model thread runs the learning turn and takes its mini-batches from the book itself (no batch handed
    to it), and ``Alone`` is consulted, not traversed.
    """
    loop = learner_loop(tmp_path, decode_workers=0)
    walk = follow(monkeypatch, loop)
    loop.state.model_thread.shutdown()
    assert walk.names == ["LearnerLoop", "Intake", "StreamBook", "LearnerState", "OnlineLearner"]
    assert len(walk.names) <= 5


def test_a_decode_pool_is_the_one_extra_stop(tmp_path, monkeypatch):
    """With ``decode_workers`` (a GPU learner's default) the images are decoded in the pool's threads: the one stop
    that does work of its own (decoding in parallel), not only passing the record on."""
    loop = learner_loop(tmp_path, decode_workers=2)
    walk = follow(monkeypatch, loop)
    loop.state.model_thread.shutdown()
    assert walk.names == ["LearnerLoop", "Intake", "ThreadPoolExecutor", "StreamBook", "LearnerState",
                          "OnlineLearner"]


def test_in_a_group_the_membership_is_the_stop_that_keeps_the_partitions_sums(tmp_path, monkeypatch):
    """A learner in a group: ``InGroup.step`` adds the batch to its partition's sums (the group's state store)."""
    monkeypatch.setattr(Changelog, "read_all", lambda self, timeout_s=60.0: {})
    monkeypatch.setattr(Changelog, "write", lambda self, states: 0)
    cfg = settings(SimpleNamespace(bootstrap="127.0.0.1:9"), tmp_path, protocol=ProtocolConfig(eval_period=0),
                   decode_workers=0)
    cfg = dataclasses.replace(cfg, kafka=dataclasses.replace(cfg.kafka, state_topic="state"))
    loop = LearnerLoop(open_group_learner(cfg, ServerMetrics()))
    loop.producer = FakeProducer()
    walk = follow(monkeypatch, loop)
    loop.state.model_thread.shutdown()
    assert walk.names == ["LearnerLoop", "Intake", "StreamBook", "LearnerState", "InGroup", "OnlineLearner"]
