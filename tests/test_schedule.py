"""The learner's one schedule: the loop thread polls, the model thread decodes, books and learns.

The learner loop of ``tests/test_exactly_once.py`` (a real ``LearnerState``, fake Kafka clients) runs streams of
good images, corrupt images, bad headers and replays; the interleavings that matter are forced.
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

import server.learner.stream as stream
from mepo_stream.images import ImageLimits, decode_image
from mepo_stream.records import record_headers
from server.batching import MicroBatcher
from server.learner.staging import stack_images
from server.model_thread import WrongThread
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


def run_stream(tmp_path, monkeypatch, **kw) -> dict:
    """Everything the loop decides for ``mixed_log``: learned ids and images in order, dead letters, offsets."""
    state, loop, learned = service(tmp_path, **kw)
    images: list[torch.Tensor] = []
    learn = state.learn

    def learn_and_keep(batch, key=None):
        images.extend(s.image for s in batch)
        learn(batch, key)

    state.learn = learn_and_keep
    consumer, producer = FakeConsumer(loop, mixed_log()), FakeProducer()
    monkeypatch.setattr(stream, "ensure_topics", lambda kafka, *topics: None)
    monkeypatch.setattr(stream, "open_producer", lambda kafka, **_: producer)  # kept: the loop drops it on closing
    monkeypatch.setattr(stream, "open_consumer", lambda *_: consumer)
    loop.run()
    assert loop.error is None
    letters = [(dict(m["headers"])["error"], dict(m["headers"])["source_offset"]) for m in producer.sent]
    book = state.intake.book
    return {"learned": learned, "images": torch.stack(images), "letters": letters, "consumed": book.offsets,
            "committed": consumer.committed, "skipped": book.replays_skipped, "dead": book.dead_lettered,
            "seen": state.learner.samples_seen}


def test_a_mixed_stream_learns_each_good_sample_once_in_order_and_dead_letters_the_rest(tmp_path, monkeypatch):
    out = run_stream(tmp_path, monkeypatch)
    assert out["learned"] == [(STREAM_ID, i) for i in list(range(8)) + [8, 9, 11] + list(range(12, 40)) + [40, 41]]
    assert out["letters"] == [(b"corrupt_image", b"9"), (b"not_an_image", b"11"), (b"label_out_of_range", b"12"),
                              (b"empty", b"13"), (b"corrupt_image", b"46")]
    assert (out["skipped"], out["dead"], out["seen"]) == (4, 5, 41)
    assert out["consumed"] == out["committed"] == {"images:0": 50}


def test_the_next_poll_is_read_while_the_model_thread_learns(tmp_path, monkeypatch):
    """The interleaving forced: the first learning step waits until the next poll is read. Reading after learning
    never gets there: the step gives up after 10 s. Every sample is still learned once, in order."""
    state, loop, learned = service(tmp_path)
    step_begun, next_poll, met = threading.Event(), threading.Event(), []
    learn, poll = state.learn, FakeConsumer.poll

    def poll_and_tell(consumer, wait_ms, max_records):
        records = poll(consumer, wait_ms, max_records)
        if consumer.pos > 16 and step_begun.wait(10):  # the second poll, read during the step
            next_poll.set()
        return records

    def step_once_the_next_poll_is_read(batch, key=None):
        if not learned:
            step_begun.set()
            met.append(next_poll.wait(10))
        learn(batch, key)

    monkeypatch.setattr(FakeConsumer, "poll", poll_and_tell)
    state.learn = step_once_the_next_poll_is_read
    consumer = run_loop(monkeypatch, loop, [sample(i, i) for i in range(32)])
    assert met == [True]
    assert learned == [(STREAM_ID, i) for i in range(32)] and consumer.committed == {"images:0": 32}


def test_a_partial_mini_batch_is_learned_once_the_topic_goes_quiet_not_at_stop(tmp_path, monkeypatch):
    """20 samples at batch size 16: the last 4 are learned at the first empty poll, while the loop still runs."""
    state, loop, learned = service(tmp_path)
    at_idle_polls, poll = [], FakeConsumer.poll

    def poll_and_count(consumer, wait_ms, max_records):
        records = poll(consumer, wait_ms, max_records)
        if not records:
            loop.settle(raises=True)
            at_idle_polls.append(len(learned))
        return records

    monkeypatch.setattr(FakeConsumer, "poll", poll_and_count)
    run_loop(monkeypatch, loop, [sample(i, i) for i in range(20)], idle_polls=2)
    assert at_idle_polls[-1] == 20 and learned == [(STREAM_ID, i) for i in range(20)]


def test_the_learner_state_refuses_a_call_from_outside_the_model_thread(tmp_path):
    """Booking, learning and capturing belong to the model thread: called from any other, they fail at once, before
    touching anything; handed to it (``LearnerState.book``, ``learn_pending``), they run."""
    state, loop, learned = service(tmp_path)
    with pytest.raises(WrongThread, match="only mepo-model may call this"):
        state.intake.accept([sample(0, 0)])
    assert state.intake.book.offsets == {} and not state.intake.book.pending
    with pytest.raises(WrongThread):
        state.learn([])
    loop.accept([sample(0, 0)])
    state.learn_pending()
    assert learned == [(STREAM_ID, 0)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decoding_each_poll_on_the_gpu_decides_exactly_as_inline_decoding(tmp_path, monkeypatch):
    """nvJPEG's batch per poll: the same samples, order, dead letters and offsets. (The pixels of these noise
    images differ where the decoders upsample chroma differently; a camera image's stay within a level:
    ``tests/test_images.py``.)"""
    inline = run_stream(tmp_path / "inline", monkeypatch, gpu_decode=False)
    gpu = run_stream(tmp_path / "gpu", monkeypatch, gpu_decode=True)
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
    state, loop, learned = service(tmp_path, backbone=backbone, limits=ImageLimits())
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


def test_a_decode_error_dead_letters_that_record_and_gives_back_its_claim(tmp_path):
    """So a good copy of the sample later in the same poll is learned, not skipped as a replay."""
    state, loop, _ = service(tmp_path)
    poll = [sample(0, 0), sample(1, 1), sample(2, 2, TRUNCATED), sample(3, 3), sample(4, 4, TRUNCATED), sample(5, 4)]
    loop.accept(poll)
    assert [(o, s.meta.sample_index) for _, o, s in state.intake.book.pending] == [(0, 0), (1, 1), (3, 3), (5, 4)]
    assert [dict(m["headers"])[k] for m in loop.producer.sent for k in ("error", "source_offset")] == \
        [b"corrupt_image", b"2", b"corrupt_image", b"4"]
    assert state.intake.book.offsets == {}  # nothing is handled before the pending record at offset 0
    assert state.intake.book.dead_lettered == 2 and state.intake.book.replays_skipped == 0


def test_a_batch_for_a_cpu_learner_is_an_ordinary_stack():
    images = [torch.full((3, 4, 4), i, dtype=torch.uint8) for i in range(3)]
    batch = stack_images(images, torch.device("cpu"))
    assert torch.equal(batch, torch.stack(images)) and not batch.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_a_batch_for_a_cuda_learner_is_pinned():
    images = [torch.full((3, 4, 4), i, dtype=torch.uint8) for i in range(3)]
    batch = stack_images(images, torch.device("cuda"))
    assert torch.equal(batch, torch.stack(images)) and batch.is_pinned()


def tensors_of(state) -> list:
    """Every tensor of a nested state dict, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in tensors_of(state[key])]
    if isinstance(state, list | tuple):
        return [t for item in state for t in tensors_of(item)]
    return []


def test_a_prediction_during_a_learning_step_is_answered_between_its_blocks_and_changes_nothing_learned(tmp_path):
    """Forced: the second step's forward, after its first transformer block, waits until a prediction is handed in
    from another thread. The prediction is answered before the step's next block, from the model before the step,
    and the model learned is bit-identical to one learned with no prediction at all."""
    log = [sample(i, i) for i in range(32)]
    quiet, quiet_loop, _ = service(tmp_path / "quiet")
    busy, busy_loop, _ = service(tmp_path / "busy")
    for state, loop in ((quiet, quiet_loop), (busy, busy_loop)):
        loop.accept(log[:16])
        state.learn_pending()
    batcher = MicroBatcher(run=busy.model_thread.run_first)
    blocks, answered, handed = [], [], threading.Event()
    image = decode_image(noisy_jpeg(99), busy.intake.limits)

    def predict() -> None:
        handed.set()
        batcher.run(lambda: answered.append((len(blocks), busy.version)) or busy.snapshot, [image])

    def hand_in_a_prediction_after_the_first_block(module, args, output) -> None:
        blocks.append(module)
        if len(blocks) == 1:
            threading.Thread(target=predict).start()
            assert handed.wait(10)
            time.sleep(0.1)  # the prediction is now handed in, waiting for the model thread

    backbone = busy.learner.method.backbone
    hooks = [block.register_forward_hook(hand_in_a_prediction_after_the_first_block) for block in backbone.blocks]
    version = busy.version
    busy_loop.accept(log[16:])
    busy.learn_pending()
    for hook in hooks:
        hook.remove()
    quiet_loop.accept(log[16:])
    quiet.learn_pending()
    assert len(blocks) >= len(backbone.blocks) > 1 and answered == [(1, version)]  # after block 1, the model before
    learned, alone = tensors_of(busy.learner.state_dict()), tensors_of(quiet.learner.state_dict())
    assert len(learned) == len(alone) and all(torch.equal(a, b) for a, b in zip(learned, alone, strict=True))
