"""The learner loop: consume the labelled image topic in one pass, learn in stream order, checkpoint, commit.

The loop speaks Kafka and tells ``ServiceState`` what became of each record; the state owns the model and the
``StreamBook`` (``server.learner.book``), which decides which samples are learned and where the offsets stand.

* One consumer in a group, ``enable_auto_commit=False``. On partition assignment the consumer seeks to the
  book's offsets (after a restart, those of the learner checkpoint, the source of truth). Offsets reach Kafka
  only through ``persist``: checkpoint first, then commit the same offsets, for lag monitoring and tools. A
  crash therefore rolls model and offsets back together: records after the checkpoint are learned again once,
  none is lost or learned twice.
* A record that cannot be decoded or validated goes to the dead-letter topic with headers ``error``,
  ``error_message``, ``source_topic``, ``source_partition`` and ``source_offset``; it is counted, and the loop
  moves on. A replayed sample (already learned, or still waiting in a mini-batch) is skipped and counted
  (unless ``learn_replays``): every sample id is claimed in the book before its image is decoded.
* Mini-batches are assembled in offset order, cut short where an any-time evaluation is scheduled
  (``ServiceState.batch_limit``); a partial batch is learned when the topic goes idle.
* Keeping the GPU fed: the images of one poll are decoded and validated in a thread pool
  (``decode_workers``), between claims made and results applied in offset order, so the outcome is the
  inline one. ``ServiceState.learn`` stacks the batch into pinned memory on a CUDA learner
  (``server.learner.staging``) for an asynchronous copy to the device; predictions are micro-batched
  (``server.batching``) into one forward on the snapshot's device.
* The broker being unreachable makes the loop wait and retry (``mepo_learner_up`` 0, not ready) without
  losing anything.
* The API steers the loop through ``pause``, ``resume`` and ``request_checkpoint`` and reads ``health``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
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
from server.consumer import PROBE_EVERY_S, ConsumerThread, broker_answers
from server.learner.book import Sample
from server.learner.state import ServiceState

log = logging.getLogger(__name__)


def tp_key(tp: TopicPartition) -> str:
    """The book's name of a partition (of a ``TopicPartition`` or a record): ``"topic:partition"``."""
    return f"{tp.topic}:{tp.partition}"


def parse_tp(key: str) -> TopicPartition:
    topic, partition = key.rsplit(":", 1)
    return TopicPartition(topic, int(partition))


class InlineExecutor(Executor):
    """Runs each task as it is submitted, in the caller's thread: ``decode_workers`` 0."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # handed to whoever reads the result, as a pool would
            future.set_exception(e)
        return future


def _log_failed_commit(offsets: dict, result: object) -> None:
    """``commit_async``'s callback (kafka-python passes the offsets and the response or the error): a failed
    commit is only logged, the checkpoint holds the offsets."""
    if isinstance(result, Exception):
        log.warning("offset commit failed (the checkpoint holds them): %s", result)


def decode_executor(workers: int | None, dev: torch.device) -> Executor:
    """A pool of ``workers`` decode threads; for 0, an ``InlineExecutor`` that decodes in the learner thread;
    for None, a pool of 4 beside a GPU model and inline beside a CPU one (whose forward uses every core)."""
    if workers is None:
        workers = 4 if dev.type == "cuda" else 0
    return ThreadPoolExecutor(workers, thread_name_prefix="mepo-decode") if workers > 0 else InlineExecutor()


@dataclass
class _Claimed:
    """A record whose sample id is claimed and whose image is being decoded."""

    meta: RecordMeta
    image: Future  # of a uint8 [3, S, S] tensor, or an ImageError (the claim is then given back)


class _SeekToHandled(ConsumerRebalanceListener):
    """Runs on kafka-python's IO thread while the learner thread waits inside ``poll()`` or ``close()``."""

    def __init__(self, loop: LearnerLoop):
        self.loop = loop

    def on_partitions_revoked(self, revoked):
        """Learn what is pending and checkpoint before another consumer takes the partitions over, then let them
        go; no commit here, a blocking consumer call would stall the very thread that serves it."""
        self.loop.learn_pending()
        self.loop.persist(commit=False)
        self.loop.state.revoke_partitions([tp_key(tp) for tp in revoked])

    def on_partitions_assigned(self, assigned):
        self.loop.take_over(assigned)


class LearnerLoop(ConsumerThread):
    """Runs in a thread next to the HTTP server; it reads Kafka, reports every record to ``ServiceState`` (which
    books it) and learns through it. Stopping learns the records in hand, checkpoints, commits and closes."""

    stop_timeout = 60.0

    def __init__(self, state: ServiceState):
        self.state, self.cfg = state, state.cfg
        self._checkpoint_request = threading.Event()
        self.consumer: KafkaConsumer | None = None
        self.producer: KafkaProducer | None = None
        self.decoder = decode_executor(self.cfg.decode_workers, state.learner.device)
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="mepo-checkpoint")
        self._writing: Future | None = None  # the checkpoint being written, to its offsets
        self.refusal: str | None = None  # why learning must stop (set in a rebalance callback)
        self._broken: KafkaError | None = None  # a broker error in a rebalance callback: reconnect
        super().__init__("mepo-learner")

    def request_checkpoint(self) -> None:
        """Learn the records in hand and persist at the loop's next turn (in its own thread, like every write)."""
        self._checkpoint_request.set()

    def _connect(self) -> None:
        k = self.cfg.kafka
        self.state.reread()  # records read but not learned are read, and claimed, again from the book's offsets
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

    def take_over(self, assigned) -> None:
        """On assignment: restore the partitions' state (a learner in a group), or check that this learner has
        the whole topic (one learning alone: a second one in its group would split the stream between two models
        that nothing adds up), then seek."""
        try:
            self.state.assign_partitions([tp_key(tp) for tp in assigned])
        except ValueError as e:
            self.refusal = str(e)
        except KafkaError as e:  # the partitions' states could not be read: reconnect, and be assigned again
            self._broken = e
        if self.refusal is None and not self.state.scales_out and self.consumer is not None:
            everything = self.consumer.partitions_for_topic(self.cfg.kafka.topic)  # None: not known yet
            if everything and {tp.partition for tp in assigned} != everything:
                self.refusal = (f"another learner joined consumer group {self.cfg.kafka.group_id!r} and took some "
                                f"of {self.cfg.kafka.topic}'s partitions: each would learn a part of the stream "
                                f"into a model of its own. Learning in several processes needs "
                                f"--kafka.state_topic (docs: Scale-out), and a model whose sums add up")
        self.seek_to_handled(assigned)

    def seek_to_handled(self, assigned) -> None:
        """On assignment: seek each partition to the offset where this process's model stands (the book's)."""
        assert self.consumer is not None
        offsets = self.state.offsets
        for tp in assigned:
            if tp_key(tp) in offsets:
                self.consumer.seek(tp, offsets[tp_key(tp)])
        log.info("assigned %s", [tp_key(tp) for tp in assigned])

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
        self.writer.shutdown()

    # --- the loop -----------------------------------------------------------------------------------------------
    def _consume(self) -> None:
        assert self.consumer is not None
        while not self.stop_event.is_set():
            self._check_rebalance()
            if self._checkpoint_request.is_set():
                self._checkpoint_request.clear()
                self.learn_pending()
                self.persist(wait=False)
            if self._paused.is_set():
                self.stop_event.wait(0.2)
                continue
            pending, limit = len(self.state.pending), self.state.batch_limit
            due = pending >= limit  # a whole mini-batch is waiting: learn it while the next poll decodes
            polled = self.consumer.poll(timeout_ms=0 if due else 500, max_records=limit if due else limit - pending)
            self._check_rebalance()  # before a record of a partition whose state is not restored is accepted
            self._probe()
            records = sorted((r for rs in polled.values() for r in rs), key=lambda r: (r.partition, r.offset))
            self._accept_poll(records, meanwhile=self.learn_pending if due or (pending and not records) else None)
            if not records and not self.state.pending:
                self._on_idle()
            self._finish_write(block=False)
            if self.state.checkpoint_due:
                self.persist(wait=False)
            self._update_lag()
        self.learn_pending()
        self.persist()

    def _check_rebalance(self) -> None:
        """Stop on a refusal (a rebalance callback or the state's), reconnect on a broker error in a callback."""
        if (refusal := self.refusal or self.state.refusal) is not None:
            raise RuntimeError(refusal)
        if self._broken is not None:
            broken, self._broken = self._broken, None
            raise broken

    def _probe(self) -> None:
        """Every few seconds (and while disconnected), check that the broker still answers."""
        if time.monotonic() - self._probed_at > PROBE_EVERY_S or not self.connected:
            self.connected, self._probed_at = broker_answers(self.consumer), time.monotonic()
            self.state.metrics.learner_up.set(int(self.connected))

    def _accept(self, record) -> None:
        """One record, as a poll of its own."""
        self._accept_poll([record])

    def _accept_poll(self, records: list, meanwhile: Callable[[], None] | None = None) -> None:
        """Claim in offset order, decode concurrently, apply the results in offset order.

        ``meanwhile`` (learning the pending mini-batch) runs while the pool decodes: the images of the next
        mini-batch are ready when the step ends. It learns only samples applied before this poll, so the order,
        the claims and the offsets are those of decoding first and learning after. Every decode has finished
        before this returns, even on an error, so no late claim release can race a reconnect's ``reread``.
        """
        decoding: dict[tuple[str, int], Future] = {}
        try:
            claimed = [self._claim(record, decoding) for record in records]
            if meanwhile is not None:
                meanwhile()
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
        if not self.state.claim(sample_id):  # learned or in flight: a replay
            return None
        decoding[sample_id] = self.decoder.submit(self._decode, record, meta)
        return _Claimed(meta, decoding[sample_id])

    def _apply(self, record, outcome: _Claimed | RecordError | None) -> None:
        """Book one record, in offset order: pending, a skipped replay, or a dead letter with its reason."""
        key = tp_key(record)
        self.state.metrics.records_consumed.inc()
        if outcome is None:
            self.state.metrics.replays_skipped.inc()
            self.state.skip(key, record.offset)
            return
        try:
            if isinstance(outcome, RecordError):
                raise outcome
            image = outcome.image.result()
        except (RecordError, ImageError) as e:
            self._dead_letter(record, e.reason, e.message)
            self.state.dead_letter(key, record.offset)
            return
        self.state.add_pending(key, record.offset, Sample(image, outcome.meta))

    def _decode(self, record, meta: RecordMeta) -> torch.Tensor:
        """The record's image; a bad one gives its claim back, so a good copy of the sample is still learned."""
        try:
            return decode_image(record.value or b"", self.cfg.limits)
        except ImageError:
            self.state.release((meta.stream_id, meta.sample_index))
            raise

    def learn_pending(self) -> None:
        """Learn the pending records in mini-batches of at most ``batch_limit`` (cut at a scheduled evaluation);
        records accepted while a step runs stay pending."""
        for group in self.state.groups(self.state.pending):
            waiting = [p.sample for p in group]
            while waiting:
                limit = self.state.batch_limit
                batch, waiting = waiting[:limit], waiting[limit:]
                self.state.learn(batch)

    def _dead_letter(self, record, reason: str, message: str) -> None:
        headers = [("error", reason.encode()), ("error_message", message[:500].encode("utf-8", "replace")),
                   ("source_topic", record.topic.encode()), ("source_partition", str(record.partition).encode()),
                   ("source_offset", str(record.offset).encode()), *(record.headers or [])]
        assert self.producer is not None
        self.producer.send(self.cfg.kafka.dead_letter_topic, value=record.value, key=record.key, headers=headers)
        self.state.metrics.dead_lettered.labels(reason).inc()
        log.info("dead-lettered %s:%d@%d: %s", record.topic, record.partition, record.offset, reason)

    def _on_idle(self) -> None:
        """The topic is drained: snapshot the newest version (requests then never wait for the evaluation), record
        the accuracy at this point (A_last of the stream so far) and persist."""
        self.state.fresh_snapshot()
        if self.state.idle_evaluation_due:
            self.state.evaluate_now()
        self.persist()

    def persist(self, commit: bool = True, wait: bool = True) -> None:
        """The one way offsets leave the loop: checkpoint model and offsets together, then commit the same offsets.

        Nothing is written when nothing changed since the last checkpoint. Dead letters are flushed first, so
        they are durable before the offsets that skip them. The commit never precedes the checkpoint, and its
        failure is only logged: the checkpoint is the source of truth, Kafka's offsets inform lag monitoring.
        Without ``wait`` (the periodic checkpoint) the file is written in the checkpoint thread while the loop
        learns on, and its offsets are committed at the loop's first turn after it is on disk: writing and syncing
        4 MB on the loop's own time cost the learner 5 % of its speed. One write is in flight at a time.
        """
        self._finish_write(commit)
        if not self.state.unsaved:
            return
        if self.producer is not None:
            self.producer.flush()
        self._writing = self.writer.submit(self.state.write, self.state.capture())
        if wait:
            self._finish_write(commit)

    def _finish_write(self, commit: bool = True, block: bool = True) -> None:
        """Once the checkpoint in flight is on disk (waiting for it if ``block``), commit its offsets; a failed
        write raises here, in the loop. The loop's own turns (``block=False``) commit asynchronously: the
        checkpoint already holds the offsets, so the loop need not wait a broker round trip for them."""
        if self._writing is None or not (block or self._writing.done()):
            return
        offsets, self._writing = self._writing.result(), None
        if not (commit and self.consumer is not None and offsets):
            return
        to_commit = {parse_tp(k): OffsetAndMetadata(v, "", -1) for k, v in offsets.items()}
        try:
            if block:
                self.consumer.commit(to_commit, timeout_ms=5000)  # never hang on a stalled broker
            else:
                self.consumer.commit_async(to_commit, callback=_log_failed_commit)
        except KafkaError as e:
            _log_failed_commit(to_commit, e)

    def _update_lag(self) -> None:
        """Records not yet learned per partition: those behind the high watermark and those read but waiting in
        the mini-batch."""
        assert self.consumer is not None
        waiting = Counter(p.key for p in self.state.pending)
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is not None:
                try:
                    position = self.consumer.position(tp, timeout_ms=1000)
                except KafkaError:  # no position yet, or the broker is stalled: keep the last lag
                    continue
                self.lag[tp_key(tp)] = max(0, high - position) + waiting[tp_key(tp)]
                self.state.metrics.lag.labels(str(tp.partition)).set(self.lag[tp_key(tp)])
