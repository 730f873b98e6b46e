"""Decoding a poll's images in a thread pool changes nothing but speed: same samples, order, dead letters, offsets.

The learner loop of ``tests/test_exactly_once.py`` (a real ``LearnerState``, fake Kafka clients) runs one stream
of good images, corrupt images, bad headers and replays with ``decode_workers`` 0 (inline) and 4 (a pool).
"""

from __future__ import annotations

import io
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

import server.learner.intake as intake
import server.learner.stream as stream
from mepo_stream.images import ImageLimits, decode_image
from mepo_stream.kafka import KafkaConfig
from mepo_stream.records import record_headers
from server.learner.staging import stack_images
from tests.fakes import STREAM_ID, FakeConsumer, FakeProducer, FakeRecord, jpeg, record, run_loop, service
from tests.helpers import TINY
from tests.test_images import camera_jpeg

TRUNCATED = jpeg("red")[:60]  # a valid header, then the image breaks off


def noisy_jpeg(index: int) -> bytes:
    """An image of its own per sample (one plain colour per class would give the LDA no within-class spread)."""
    pixels = np.random.default_rng(index).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return buf.getvalue()


def sample(offset: int, index: int, value: bytes | None = None) -> FakeRecord:
    return record(offset, index, value=noisy_jpeg(index) if value is None else value)


def mixed_log() -> list[FakeRecord]:
    """Offsets are list indices. Within single polls (batch size 16): a replay of a pending sample, a bad copy of
    a sample then a good one (learned: the bad copy gave its claim back), a bad header; later polls replay
    learned samples, one of them as a corrupt copy (a skipped replay, not a dead letter)."""
    spec: list[tuple[int, bytes | None]] = [(i, None) for i in range(8)]
    spec += [(3, None), (8, TRUNCATED), (8, None), (9, b"NOTANIMG"), (99, None), (10, b""), (9, None), (11, None)]
    spec += [(i, None) for i in range(12, 40)]
    spec += [(2, None), (5, TRUNCATED), (40, TRUNCATED), (40, None), (41, None), (0, None)]
    log = [sample(offset, index, value) for offset, (index, value) in enumerate(spec)]
    log[12].headers = record_headers(99, 99, 99, STREAM_ID, "cifar10")  # outside the label space
    return log


def run_stream(tmp_path, monkeypatch, workers: int, **kw) -> dict:
    """Everything the loop decides for ``mixed_log``: learned ids and images in order, dead letters, offsets."""
    state, loop, learned = service(tmp_path, decode_workers=workers, **kw)
    images: list[torch.Tensor] = []
    learn = state.learn

    def learn_and_keep(batch, key=None):
        images.extend(s.image for s in batch)
        learn(batch, key)

    state.learn = learn_and_keep
    consumer, producer = FakeConsumer(loop, mixed_log()), FakeProducer()
    monkeypatch.setattr(stream, "ensure_topics", lambda kafka, *topics: None)
    monkeypatch.setattr(stream, "open_producer", lambda kafka, **_: producer)  # kept: the loop drops it on closing
    monkeypatch.setattr(stream, "KafkaConsumer", lambda **_: consumer)
    loop.run()
    assert loop.error is None
    letters = [(dict(m["headers"])["error"], dict(m["headers"])["source_offset"]) for m in producer.sent]
    book = state.intake.book
    return {"learned": learned, "images": torch.stack(images), "letters": letters, "consumed": book.offsets,
            "committed": consumer.committed, "skipped": book.replays_skipped, "dead": book.dead_lettered,
            "seen": state.learner.samples_seen}


def test_the_pool_decides_exactly_as_inline_decoding(tmp_path, monkeypatch):
    inline = run_stream(tmp_path / "inline", monkeypatch, workers=0)
    pooled = run_stream(tmp_path / "pool", monkeypatch, workers=4)
    assert inline["learned"] == [(STREAM_ID, i) for i in list(range(8)) + [8, 9, 11] + list(range(12, 40)) + [40, 41]]
    assert inline["letters"] == [(b"corrupt_image", b"9"), (b"not_an_image", b"11"), (b"label_out_of_range", b"12"),
                                 (b"empty", b"13"), (b"corrupt_image", b"46")]
    assert (inline["skipped"], inline["dead"], inline["seen"]) == (4, 5, 41)
    assert inline["consumed"] == inline["committed"] == {"images:0": 50}
    assert torch.equal(pooled.pop("images"), inline.pop("images"))
    assert pooled == inline


@pytest.mark.parametrize("workers", [0, 4])
def test_the_next_poll_is_read_while_the_model_thread_learns_and_decoded_beside_it_only_by_a_pool(
        tmp_path, monkeypatch, workers):
    """The interleaving forced: the first learning step waits until the next poll is read (a pool: until its first
    image is being decoded, and that decode waits until the step has begun). Reading after learning, as the loop
    did, never gets there: the step gives up after 10 s. Decoding inline comes after the step, beside a CPU
    forward it would slow. Every sample is still learned once, in order."""
    state, loop, learned = service(tmp_path, decode_workers=workers)
    step_begun, step_done, next_poll, met = threading.Event(), threading.Event(), threading.Event(), []
    decode, learn, poll = intake.decode_image, state.learn, FakeConsumer.poll

    def poll_and_tell(consumer, timeout_ms, max_records):
        records = poll(consumer, timeout_ms, max_records)
        if consumer.pos > 16 and not workers and step_begun.wait(10):  # the second poll, read during the step
            next_poll.set()
        return records

    def decode_and_tell(data, limits):
        if data == noisy_jpeg(16) and workers:  # the first image of the second poll (batch size 16)
            next_poll.set()
            met.append(("decoded beside the step", step_begun.wait(10) and not step_done.is_set()))
        elif data == noisy_jpeg(16):
            met.append(("decoded after the step", step_done.is_set()))
        return decode(data, limits)

    def step_once_the_next_poll_is_read(batch, key=None):
        if not learned:
            step_begun.set()
            met.append(("step waited", next_poll.wait(10)))
        learn(batch, key)
        step_done.set()

    monkeypatch.setattr(FakeConsumer, "poll", poll_and_tell)
    monkeypatch.setattr(intake, "decode_image", decode_and_tell)
    state.learn = step_once_the_next_poll_is_read
    consumer = run_loop(monkeypatch, loop, [sample(i, i) for i in range(32)])
    assert sorted(met) == [(f"decoded {'beside' if workers else 'after'} the step", True), ("step waited", True)]
    assert learned == [(STREAM_ID, i) for i in range(32)] and consumer.committed == {"images:0": 32}


def test_decoding_between_steps_the_model_thread_books_each_poll_and_starts_the_next_step_itself(
        tmp_path, monkeypatch):
    """Without a decode pool (a CPU learner) the model thread decodes and books each poll right after the step in
    flight and, a mini-batch being full, learns it in the same turn: nothing passes between threads between two
    steps. Forced: once the second poll is booked, the loop thread is held (its lag check waits) until the second
    step has begun; a loop that hands each step to the model thread itself never gets there (it gives up after
    10 s). Every sample is still learned once, in order."""
    state, loop, learned = service(tmp_path, decode_workers=0)
    decoders, steps, held, second_step = set(), [], [], threading.Event()
    decode, learn, position = intake.decode_image, state.learn, FakeConsumer.position

    def decode_and_tell(data, limits):
        decoders.add(threading.current_thread().name)
        return decode(data, limits)

    def learn_and_tell(batch, key=None):
        steps.append(threading.current_thread().name)
        if len(steps) == 2:
            second_step.set()
        learn(batch, key)

    def position_once_the_second_step_began(consumer, tp, timeout_ms):
        if consumer.pos == 32 and not held:  # the loop's turn after the second poll was booked
            held.append(second_step.wait(10))
        return position(consumer, tp, timeout_ms)

    monkeypatch.setattr(intake, "decode_image", decode_and_tell)
    monkeypatch.setattr(FakeConsumer, "position", position_once_the_second_step_began)
    state.learn = learn_and_tell
    consumer = run_loop(monkeypatch, loop, [sample(i, i) for i in range(32)])
    assert held == [True]
    assert decoders == set(steps) == {"mepo-model"}
    assert learned == [(STREAM_ID, i) for i in range(32)] and consumer.committed == {"images:0": 32}


def test_a_backlog_is_learned_turn_after_turn_in_the_model_thread_and_a_prediction_waits_one_turn(
        tmp_path, monkeypatch):
    """With librdkafka and no decode pool, while records come the loop's turns run in the model thread (learn, poll
    without waiting, book), with no thread handing work to another between two steps. Work handed to the model thread
    from elsewhere (a prediction) runs after the turn in flight, not after the backlog: forced, during the second poll
    another thread hands the model thread a task, which must run before the third poll. What may wait for the broker
    or the disk (checkpoints every 32 samples here, their commits, the broker probe) stays in the loop thread, and so
    does the wait for records once the topic is quiet. Every sample is still learned once, in order."""
    state, loop, learned = service(tmp_path, decode_workers=0, consumer="librdkafka")
    polls, events, waits_on_broker = [], [], []
    poll, commit, probe = FakeConsumer.poll, FakeConsumer.commit, FakeConsumer.beginning_offsets

    def poll_and_hand_over_a_task(consumer, timeout_ms, max_records):
        polls.append((threading.current_thread().name, timeout_ms, consumer.pos))
        events.append(("poll", consumer.pos))
        if consumer.pos == 16:
            elsewhere = threading.Thread(target=lambda: state.model_thread.submit(events.append, ("task", None)))
            elsewhere.start()
            elsewhere.join()
        return poll(consumer, timeout_ms, max_records)

    def told(method):
        return lambda consumer, *a, **kw: waits_on_broker.append(threading.current_thread().name) or method(
            consumer, *a, **kw)

    monkeypatch.setattr(FakeConsumer, "poll", poll_and_hand_over_a_task)
    monkeypatch.setattr(FakeConsumer, "commit", told(commit))
    monkeypatch.setattr(FakeConsumer, "beginning_offsets", told(probe))
    consumer = run_loop(monkeypatch, loop, [sample(i, i) for i in range(64)])
    task = events.index(("task", None))
    assert events[task - 1] == ("poll", 16) and events[task + 1][0] == "poll"
    assert [name for name, _, _ in polls[:2]] == ["mepo-model"] * 2
    assert all(wait == 0 for name, wait, _ in polls if name == "mepo-model")
    assert waits_on_broker and "mepo-model" not in waits_on_broker
    assert any(e[1]["images:0"] < 64 for e in consumer.events if e[0] == "commit")  # checkpoints as it learns
    assert polls[-1][:2] == (threading.current_thread().name, 500)  # the topic quiet: the loop waits for records
    assert learned == [(STREAM_ID, i) for i in range(64)] and consumer.committed == {"images:0": 64}


def test_in_a_group_librdkafka_is_polled_by_the_loop_thread_never_the_model_thread(tmp_path, monkeypatch):
    """librdkafka runs the rebalance listener inside the poll, and in a group (``--kafka.state_topic``) the listener
    writes the partitions' states and waits for the broker: so there the loop thread polls, as with kafka-python,
    and the model thread, which answers predictions, runs no backlog. Every sample is still learned once, in order."""
    kafka = KafkaConfig(bootstrap_servers="127.0.0.1:9", state_topic="states")  # no broker is used
    state, loop, learned = service(tmp_path, decode_workers=0, consumer="librdkafka", kafka=kafka)
    pollers = []
    poll = FakeConsumer.poll
    monkeypatch.setattr(FakeConsumer, "poll", lambda consumer, timeout_ms, max_records: pollers.append(
        threading.current_thread().name) or poll(consumer, timeout_ms, max_records))
    run_loop(monkeypatch, loop, [sample(i, i) for i in range(64)])
    assert set(pollers) == {threading.current_thread().name}
    assert learned == [(STREAM_ID, i) for i in range(64)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decoding_each_poll_on_the_gpu_decides_exactly_as_inline_decoding(tmp_path, monkeypatch):
    """nvJPEG's batch per poll: the same samples, order, dead letters and offsets. (The pixels of these noise
    images differ where the decoders upsample chroma differently; a camera image's stay within a level:
    ``tests/test_images.py``.)"""
    inline = run_stream(tmp_path / "inline", monkeypatch, workers=0, gpu_decode=False)
    gpu = run_stream(tmp_path / "gpu", monkeypatch, workers=0, gpu_decode=True)
    assert gpu.pop("images").shape == inline.pop("images").shape
    assert gpu == inline


@pytest.mark.skipif(torch.cuda.is_available(), reason="the model runs on the GPU here")
def test_gpu_decode_without_a_gpu_model_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="--gpu_decode true needs the model on a CUDA GPU"):
        service(tmp_path, gpu_decode=True)


@pytest.mark.parametrize("size", [48, 224])
def test_a_camera_record_reaches_the_backbone_decoded_from_the_source_at_the_backbones_size(tmp_path, monkeypatch,
                                                                                            size):
    """A 1280x960 JPEG, with the default --limits.size, is learned at the backbone's own resolution, as the
    scaled decode of the source gives it at that size (1/8 for 48 px, 1/4 for 224), never through another size."""
    data = camera_jpeg(1280, 960)
    backbone = replace(TINY, img_size=size)
    state, loop, learned = service(tmp_path, backbone=backbone, limits=ImageLimits(), decode_workers=0)
    seen: list[torch.Tensor] = []
    hook = state.learner.method.backbone.patch_embed.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    images: list[torch.Tensor] = []
    learn = state.learn
    state.learn = lambda batch, key=None: images.extend(s.image for s in batch) or learn(batch, key)
    run_loop(monkeypatch, loop, [sample(i, i, data) for i in range(16)])
    hook.remove()
    expected = decode_image(data, ImageLimits(size=size))
    assert len(learned) == 16 and all(torch.equal(image, expected) for image in images)
    assert seen and all(x.shape[-2:] == (size, size) for x in seen)


@pytest.mark.parametrize("workers", [0, 4])
def test_a_decode_error_in_the_pool_dead_letters_that_record_and_gives_back_its_claim(tmp_path, monkeypatch, workers):
    """Also when a good copy of the sample follows in the same poll and the bad copy is slow to fail: the good
    copy's claim waits for the bad one's decode, so it is learned, not skipped as a replay."""
    state, loop, _ = service(tmp_path, decode_workers=workers)
    threads: set[str] = set()
    decode, slow = intake.decode_image, TRUNCATED + b"slow"

    def decode_and_note_thread(data, limits):
        threads.add(threading.current_thread().name)
        if data == slow:
            time.sleep(0.2)  # fails only after the next record's claim, unless that claim waits for it
        return decode(data, limits)

    monkeypatch.setattr(intake, "decode_image", decode_and_note_thread)
    poll = [sample(0, 0), sample(1, 1), sample(2, 2, TRUNCATED), sample(3, 3), sample(4, 4, slow), sample(5, 4)]
    loop.accept(poll)
    assert [(o, s.meta.sample_index) for _, o, s in state.intake.book.pending] == [(0, 0), (1, 1), (3, 3), (5, 4)]
    assert [dict(m["headers"])[k] for m in loop.producer.sent for k in ("error", "source_offset")] == \
        [b"corrupt_image", b"2", b"corrupt_image", b"4"]
    assert state.intake.book.offsets == {}  # nothing is handled before the pending record at offset 0
    assert state.intake.book.dead_lettered == 2 and state.intake.book.replays_skipped == 0
    book = state.intake.book
    assert book.claim(STREAM_ID, 2) and not book.claim(STREAM_ID, 4)  # 2 given back, 4 in flight
    decoded_by = {name.rsplit("_", 1)[0] for name in threads}  # a pool names its threads PREFIX_i
    assert decoded_by == ({"mepo-decode"} if workers else {threading.current_thread().name})
    if loop.decoder is not None:
        loop.decoder.shutdown()


def test_a_batch_for_a_cpu_learner_is_an_ordinary_stack():
    images = [torch.full((3, 4, 4), i, dtype=torch.uint8) for i in range(3)]
    batch = stack_images(images, torch.device("cpu"))
    assert torch.equal(batch, torch.stack(images)) and not batch.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_a_batch_for_a_cuda_learner_is_pinned():
    images = [torch.full((3, 4, 4), i, dtype=torch.uint8) for i in range(3)]
    batch = stack_images(images, torch.device("cuda"))
    assert torch.equal(batch, torch.stack(images)) and batch.is_pinned()


def test_learn_stacks_through_stack_images(tmp_path, monkeypatch):
    """``LearnerState.learn`` stages its batch with the learner's device (pinned there when it is CUDA)."""
    state, loop, learned = service(tmp_path)
    devices: list[torch.device] = []

    def stack_and_note(images, device):
        devices.append(device)
        return stack_images(images, device)

    monkeypatch.setattr("server.learner.state.stack_images", stack_and_note)
    loop.accept([sample(0, 0), sample(1, 1)])
    loop.state.learn_pending()
    assert devices == [state.learner.device] and len(learned) == 2


def test_by_default_a_cpu_model_decodes_inline_and_a_gpu_model_beside_a_pool():
    """A CPU forward fills every core, so decoding waits for the gap between steps; a GPU leaves the cores free."""
    def thread_names(pool) -> set[str]:
        barrier = threading.Barrier(4, timeout=10)  # four tasks at once: only four threads can hold them all

        def name_after_all_four_arrive(_) -> str:
            barrier.wait()
            return threading.current_thread().name

        names = set(pool.map(name_after_all_four_arrive, range(4)))
        pool.shutdown()
        return names

    cpu = stream.decode_executor(None, torch.device("cpu"))
    assert cpu is None  # no pool: the intake decodes in the thread that books
    cuda = thread_names(stream.decode_executor(None, torch.device("cuda")))
    assert len(cuda) == 4 and all(name.startswith("mepo-decode") for name in cuda)
    assert isinstance(stream.decode_executor(2, torch.device("cpu")), stream.ThreadPoolExecutor)
