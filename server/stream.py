"""The learner loop: consume the labelled image topic in one pass, learn in stream order, checkpoint, commit.

* One consumer in a group, ``enable_auto_commit=False``. On partition assignment the consumer seeks to the
  offsets stored in the learner checkpoint (the source of truth); Kafka's committed offsets are only written
  *after* the checkpoint holding them is on disk, for lag monitoring and tools. A crash therefore rolls model
  and offsets back together: records after the checkpoint are learned again once, none is lost or learned
  twice.
* A record that cannot be decoded or validated goes to the dead-letter topic with headers ``error``,
  ``error_message``, ``source_topic``, ``source_partition`` and ``source_offset``; it is counted, and the loop
  moves on. A replayed sample (already learned, or still waiting in a mini-batch) is skipped and counted
  (unless ``learn_replays``): every sample id is claimed in ``StreamBook`` when its record is accepted.
* Mini-batches are assembled in offset order; a partial batch is learned when the topic goes idle.
* Keeping the GPU fed: the images of one poll are decoded and validated in a thread pool
  (``decode_workers``), between claims made and results applied in offset order, so the outcome is the
  inline one. ``ServiceState.learn`` stacks the batch into pinned memory on a CUDA learner
  (``server.staging``), the learner copies it with ``non_blocking=True`` and augments it batch-wise on the
  device; predictions are micro-batched (``server.batching``) into one forward on the snapshot's device.
* The broker being unreachable makes the loop wait and retry (``mepo_learner_up`` 0, not ready) without
  losing anything.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from mepo_stream.images import ImageError, decode_image
from mepo_stream.kafka import ensure_topics, open_producer
from mepo_stream.records import RecordError, RecordMeta, parse_headers
from server.state import Sample, ServiceState

log = logging.getLogger(__name__)


def tp_key(tp: TopicPartition) -> str:
    return f"{tp.topic}:{tp.partition}"


def parse_tp(key: str) -> TopicPartition:
    topic, partition = key.rsplit(":", 1)
    return TopicPartition(topic, int(partition))


PROBE_EVERY_S = 5.0


def broker_answers(consumer: KafkaConsumer) -> bool:
    """Partitions assigned and the broker answering a small request within 2 s.

    A stopped or partitioned broker keeps its TCP connections open, so a connection check would still say
    yes; an actual round trip does not. (The offsets it returns are not used: Tansu's end offsets are off.)
    """
    assignment = consumer.assignment()
    if not assignment:
        return False
    try:
        consumer.beginning_offsets(list(assignment), timeout_ms=2000)
        return True
    except KafkaError:
        return False


class InlineExecutor(Executor):
    """Runs each task as it is submitted, in the caller's thread: ``decode_workers`` 0."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to whoever reads the result, as a pool would
            future.set_exception(e)
        return future


def decode_executor(workers: int) -> Executor:
    """A pool of ``workers`` decode threads; none (decode in the learner thread) for 0."""
    return ThreadPoolExecutor(workers, thread_name_prefix="mepo-decode") if workers > 0 else InlineExecutor()


@dataclass
class _Claimed:
    """A record whose sample id is claimed and whose image is being decoded."""

    meta: RecordMeta
    image: Future  # of a uint8 [3, S, S] tensor, or an ImageError (the claim is then given back)


class _SeekToHandled(ConsumerRebalanceListener):
    def __init__(self, loop: LearnerLoop):
        self.loop = loop

    def on_partitions_revoked(self, revoked):
        self.loop.flush_on_revoke()

    def on_partitions_assigned(self, assigned):
        for tp in assigned:  # where this process's model stands: the checkpoint's offsets, or later ones
            offset = self.loop.consumed.get(tp_key(tp))
            if offset is not None:
                self.loop.consumer.seek(tp, offset)
        log.info("assigned %s", [tp_key(tp) for tp in assigned])


class LearnerLoop:
    """Runs in a thread next to the HTTP server and writes only through ``ServiceState``."""

    def __init__(self, state: ServiceState):
        self.state, self.cfg = state, state.cfg
        self.stop_event, self.paused = threading.Event(), threading.Event()
        self.connected, self._probed_at = False, 0.0
        self.error: str | None = None
        self.consumer: KafkaConsumer | None = None
        self.producer: KafkaProducer | None = None
        self.pending: list[tuple[TopicPartition, int, Sample]] = []
        self.consumed: dict[str, int] = dict(state.book.offsets)  # next offset per partition, all handled
        self.read_upto: dict[str, int] = {}  # next offset per partition, read (handled or pending)
        self.lag: dict[str, int] = {}
        self.decoder = decode_executor(self.cfg.decode_workers)
        self.thread = threading.Thread(target=self._run, name="mepo-learner", daemon=True)
        self._checkpoint_request = threading.Event()

    # --- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the current batch, checkpoint, commit and close."""
        self.stop_event.set()
        self.thread.join(timeout)

    def request_checkpoint(self) -> None:
        self._checkpoint_request.set()

    def _connect(self) -> None:
        k = self.cfg.kafka
        self.pending.clear()  # after a reconnect, unlearned records are read again from self.consumed
        self.state.book.release_in_flight()  # ... and claimed again
        self.read_upto = dict(self.consumed)
        ensure_topics(k)
        self.producer = open_producer(k, linger_ms=5)
        self.consumer = KafkaConsumer(
            **k.client_options(), group_id=k.group_id, enable_auto_commit=False, auto_offset_reset="earliest",
            session_timeout_ms=6000, heartbeat_interval_ms=2000, max_poll_interval_ms=600_000,
            max_poll_records=self.cfg.learner.batch_size, fetch_max_bytes=16 * 1024 * 1024,
        )
        self.consumer.subscribe([k.topic], listener=_SeekToHandled(self))

    def _close(self) -> None:
        for client in (self.consumer, self.producer):
            if client is not None:
                try:
                    client.close()
                except Exception:  # closing after a broker failure must not mask the original error
                    log.exception("error while closing a Kafka client")
        self.consumer = self.producer = None
        self.connected = False
        self.state.metrics.learner_up.set(0)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._connect()
                self._consume()
                break
            except KafkaError as e:
                log.warning("Kafka unavailable (%s); retrying in 2 s", e)
                self._close()
                self.stop_event.wait(2.0)
            except Exception as e:  # a bug, not a broker problem: stop learning, report it, keep serving
                log.exception("the learner loop failed")
                self.error = f"{type(e).__name__}: {e}"
                break
        self._close()
        self.decoder.shutdown()

    # --- the loop -------------------------------------------------------------------------------------------
    def _consume(self) -> None:
        assert self.consumer is not None
        batch_size = self.cfg.learner.batch_size
        while not self.stop_event.is_set():
            if self._checkpoint_request.is_set():
                self._checkpoint_request.clear()
                self._learn_pending()
                self.checkpoint()
            if self.paused.is_set():
                self.stop_event.wait(0.2)
                continue
            polled = self.consumer.poll(timeout_ms=500, max_records=batch_size - len(self.pending))
            if time.monotonic() - self._probed_at > PROBE_EVERY_S or not self.connected:
                self.connected, self._probed_at = broker_answers(self.consumer), time.monotonic()
                self.state.metrics.learner_up.set(int(self.connected))
            records = sorted((r for rs in polled.values() for r in rs), key=lambda r: (r.partition, r.offset))
            self._accept_poll(records)
            if len(self.pending) >= batch_size or (self.pending and not records):
                self._learn_pending()
            if not records and not self.pending:
                self._on_idle()
            if self.state.checkpoint_due:
                self.checkpoint()
            self._update_lag()
        self._learn_pending()
        self.checkpoint()

    def _accept(self, record) -> None:
        """One record, as a poll of its own."""
        self._accept_poll([record])

    def _accept_poll(self, records: list) -> None:
        """Claim in offset order, decode concurrently, apply the results in offset order.

        Every decode has finished before this returns, even on an error, so no late claim release can race a
        reconnect's ``release_in_flight``.
        """
        decoding: dict[tuple[str, int], Future] = {}
        try:
            claimed = [self._claim(record, decoding) for record in records]
            for record, outcome in zip(records, claimed, strict=True):
                self._apply(record, outcome)
        finally:
            wait(decoding.values())

    def _claim(self, record, decoding: dict[tuple[str, int], Future]) -> _Claimed | RecordError | None:
        """Parse the headers and claim the sample id before decoding (None: a replay).

        An earlier copy of the same sample in this poll is waited for first: if its image is bad it has given
        the claim back by then, and this copy is learned, as when records are decoded one at a time.
        """
        try:
            meta = parse_headers(record.headers, self.state.n_classes)
        except RecordError as e:
            return e
        sample_id = (meta.stream_id, meta.sample_index)
        if sample_id in decoding:
            wait([decoding[sample_id]])
        if not self.state.book.claim(*sample_id):  # learned or in flight: a replay
            return None
        decoding[sample_id] = self.decoder.submit(self._decode, record, meta)
        return _Claimed(meta, decoding[sample_id])

    def _apply(self, record, outcome: _Claimed | RecordError | None) -> None:
        """Book one record, in offset order: pending, a skipped replay, or a dead letter with its reason."""
        tp = TopicPartition(record.topic, record.partition)
        self.read_upto[tp_key(tp)] = record.offset + 1
        self.state.metrics.records_consumed.inc()
        if outcome is None:
            self.state.metrics.replays_skipped.inc()
            self._done(tp, record.offset)
            return
        try:
            if isinstance(outcome, RecordError):
                raise outcome
            image = outcome.image.result()
        except (RecordError, ImageError) as e:
            self._dead_letter(record, e.reason, e.message)
            self._done(tp, record.offset)
            return
        self.pending.append((tp, record.offset, Sample(image, outcome.meta)))

    def _decode(self, record, meta: RecordMeta) -> torch.Tensor:
        """The record's image; a bad one gives its claim back, so a good copy of the sample is still learned."""
        try:
            return decode_image(record.value or b"", self.cfg.limits)
        except ImageError:
            self.state.book.release(meta.stream_id, meta.sample_index)
            raise

    def _done(self, tp: TopicPartition, offset: int) -> None:
        """A record needs no more work; its offset is safe to store once nothing before it is pending."""
        if not any(p_tp == tp for p_tp, _, _ in self.pending):
            self.consumed[tp_key(tp)] = offset + 1

    def _learn_pending(self) -> None:
        """Learn the pending records; any accepted while the step runs stay pending and hold their offset back."""
        if not self.pending:
            return
        batch = list(self.pending)  # pending until learned, so _done cannot move an offset past them meanwhile
        self.state.learn([s for _, _, s in batch])
        del self.pending[: len(batch)]
        for key, upto in self.read_upto.items():  # every record read is handled, up to the first still pending
            self.consumed[key] = min((o for tp, o, _ in self.pending if tp_key(tp) == key), default=upto)

    def _dead_letter(self, record, reason: str, message: str) -> None:
        headers = [("error", reason.encode()), ("error_message", message[:500].encode("utf-8", "replace")),
                   ("source_topic", record.topic.encode()), ("source_partition", str(record.partition).encode()),
                   ("source_offset", str(record.offset).encode()), *(record.headers or [])]
        assert self.producer is not None
        self.producer.send(self.cfg.kafka.dead_letter_topic, value=record.value, key=record.key, headers=headers)
        self.state.book.dead_letter()
        self.state.metrics.dead_lettered.labels(reason).inc()
        log.info("dead-lettered %s:%d@%d: %s", record.topic, record.partition, record.offset, reason)

    def _on_idle(self) -> None:
        """The topic is drained: record the accuracy at this point (A_last of the stream so far)."""
        if self.state.idle_evaluation_due:
            self.state.evaluate(final=True)
        if self.state.unsaved or self.consumed != self.state.book.offsets:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Checkpoint, then commit the same offsets to Kafka (never before they are on disk)."""
        if self.producer is not None:
            self.producer.flush()  # dead letters are durable before their offsets are
        self.state.save(self.consumed)
        if self.consumer is not None and self.consumed:
            offsets = {parse_tp(k): OffsetAndMetadata(v, "", -1) for k, v in self.consumed.items()}
            try:
                self.consumer.commit(offsets, timeout_ms=5000)  # never hang on a stalled broker
            except KafkaError as e:  # the checkpoint is the source of truth; the commit is informational
                log.warning("offset commit failed (the checkpoint holds them): %s", e)

    def flush_on_revoke(self) -> None:
        """Runs on kafka-python's IO thread: learn and checkpoint, but no blocking consumer call (no commit)."""
        self._learn_pending()
        if self.state.unsaved or self.consumed != self.state.book.offsets:
            self.state.save(self.consumed)

    def _update_lag(self) -> None:
        assert self.consumer is not None
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is not None:
                try:
                    position = self.consumer.position(tp, timeout_ms=1000)
                except KafkaError:  # no position yet, or the broker is stalled: keep the last lag
                    continue
                self.lag[tp_key(tp)] = max(0, high - position)
                self.state.metrics.lag.labels(str(tp.partition)).set(self.lag[tp_key(tp)])
