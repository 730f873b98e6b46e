"""The learner loop: read the labelled image topic, hand each poll to the model thread, send the dead letters and
predictions it hands back, checkpoint and commit (docs/architecture.md: the threads, what each owns).

Offsets reach Kafka only through ``persist``: checkpoint first, then commit the same offsets, so a crash rolls model
and offsets back together: none is lost or learned twice. An unreachable broker makes the loop wait and retry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from enum import Enum

from kafka import KafkaProducer
from kafka.errors import KafkaError

from mepo_stream.errors import StateRefused
from mepo_stream.kafka import KafkaConfig, ensure_topics, open_producer
from server.consumer import PROBE_EVERY_S, ConsumerThread
from server.learner.arrival import Prediction, Retraction
from server.learner.consumer import TIMING, Assigned, BrokerUnavailable, Consumer, PartitionKey, Rebalance, Record
from server.learner.intake import Outgoing
from server.learner.kafka_python import KafkaPythonConsumer
from server.learner.librdkafka import LibrdkafkaConsumer, check_available
from server.learner.state import Booked, LearnerState, StateWriteFailed
from server.metrics import ServerMetrics

log = logging.getLogger(__name__)


def send(producer: KafkaProducer | None, kafka: KafkaConfig, metrics: ServerMetrics, outgoing: list[Outgoing]) -> None:
    """Send what a booking returned: dead letters, and predictions (or retractions) to the predictions topic."""
    for out in outgoing:
        assert producer is not None
        if isinstance(out, Prediction | Retraction):
            producer.send(kafka.predictions_topic, value=out.value(), key=out.id.encode())
            metrics.predictions_published.inc(isinstance(out, Prediction))
            if isinstance(out, Prediction) and out.novel and kafka.novel_topic is not None:
                producer.send(kafka.novel_topic, value=out.value(), key=out.id.encode())
            continue
        record = out.record
        headers = [("error", out.reason.encode()), ("error_message", out.message[:500].encode("utf-8", "replace")),
                   ("source_topic", record.topic.encode()), ("source_partition", str(record.partition).encode()),
                   ("source_offset", str(record.offset).encode()), *(record.headers or [])]
        producer.send(kafka.dead_letter_topic, value=record.value, key=record.key, headers=headers)
        metrics.dead_lettered.labels(out.reason).inc()
        log.info("dead-lettered %s:%d@%d: %s", record.topic, record.partition, record.offset, out.reason)


def fill_wait_ms(consumer: Consumer, labels_topic: str | None, changes_waiting: bool) -> int:
    """500 ms to fill a partial mini-batch, but 20 where a change waits (its user does) and nothing is left to read."""
    return 20 if changes_waiting and not any(unread(consumer, labels_topic, Counter()).values()) else 500


def unread(consumer: Consumer, labels_topic: str | None, waiting: Counter[str]) -> dict[str, int]:
    """Per image partition with a position and a high watermark: records behind it plus those ``waiting``."""
    lags = {}
    for key in consumer.assignment():
        if key.topic != labels_topic and (behind := consumer.unread(key)) is not None:
            lags[str(key)] = behind + waiting[str(key)]
    return lags


def open_consumer(client: str, kafka: KafkaConfig, max_records: int) -> Consumer:
    if client == "librdkafka":
        return LibrdkafkaConsumer(kafka, **TIMING)
    return KafkaPythonConsumer(kafka, max_records, **TIMING)


BROKER_ERRORS = (KafkaError, BrokerUnavailable)  # a broker that cannot be reached: the consumer's, kafka-python's


class Persist(Enum):
    """The loop's occasions to write its state, each with whether it waits for the write and commits after."""

    NOW = "now"  # idle or stopping: write, wait for it, commit its offsets
    BEFORE_REVOKE = "before_revoke"  # write and wait, commit nothing (a blocking call would stall the rebalance)
    ASKED = "asked"  # an admin's: written while the loop learns on, committed at the first turn after it is on disk
    IF_DUE = "if_due"  # the periodic write: as ``ASKED``, once ``checkpoint_due`` and no write is in flight

    @property
    def waits(self) -> bool:
        return self in (Persist.NOW, Persist.BEFORE_REVOKE)

    @property
    def commits(self) -> bool:
        return self is not Persist.BEFORE_REVOKE


class LearnerLoop(ConsumerThread):
    """The ``mepo-learner`` thread. Stopping learns the records in hand, checkpoints, commits and closes."""

    stop_timeout = 60.0

    def __init__(self, state: LearnerState):
        self.state, self.cfg = state, state.cfg
        self._checkpoint_request = threading.Event()
        self.consumer: Consumer | None = None
        self.producer: KafkaProducer | None = None
        if self.cfg.consumer == "librdkafka":
            check_available()
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="mepo-checkpoint")
        self.writing: Future | None = None  # the checkpoint being written, to its offsets
        self.stepping: Future | None = None  # the model thread's turn in flight (a booking, then maybe a step)
        self.booked = Booked([], False, Counter(), state.cfg.learner.batch_size, False, False)  # what it steers by
        self.refusal: StateRefused | None = None  # why learning must stop (set in a rebalance callback)
        self.failure: StateWriteFailed | None = None  # a failed state write: learning stops, nothing more is written
        self._broken: Exception | None = None  # a broker error in a rebalance callback: reconnect
        super().__init__("mepo-learner")

    def request_checkpoint(self) -> None:
        """Learn the records in hand and persist at the loop's next turn (in its own thread, like every write)."""
        self._checkpoint_request.set()

    def _connect(self) -> None:
        k = self.cfg.kafka
        self.state.reread()  # records read but not learned are read, and claimed, again from the book's offsets
        self.booked = self.state.accept([])
        ensure_topics(k)
        if k.labels_topic is not None:
            ensure_topics(k, k.labels_topic, k.predictions_topic, *([k.novel_topic] if k.novel_topic else []))
        self.producer = open_producer(k, linger_ms=5)
        self.consumer = open_consumer(self.cfg.consumer, k, self.cfg.learner.batch_size)
        topics = [k.topic] if k.labels_topic is None else [k.topic, k.labels_topic]
        self.consumer.subscribe(topics, self.on_rebalance)

    def _close(self) -> None:
        self.settle(raises=False)  # its step ends first: a reconnect forgets what is pending
        try:  # closing after a broker failure must not mask the original error; the producer serves a last revocation
            if self.consumer is not None:
                self.consumer.close(timeout_s=5)  # waits for the commits in flight
            if self.producer is not None:
                self.producer.close()
        except Exception:
            log.exception("error while closing a Kafka client")
        self.consumer = self.producer = None
        self.connected = False
        self.state.metrics.learner_up.set(0)

    def on_rebalance(self, event: Rebalance) -> dict[PartitionKey, int] | None:
        if isinstance(event, Assigned):
            return self.take_over(event.keys)
        self.let_go([str(key) for key in event.keys])
        return None

    def take_over(self, assigned: tuple[PartitionKey, ...]) -> dict[PartitionKey, int]:
        """On assignment: restore the partitions' state, or check that a learner alone has the whole topic."""
        keys = [str(key) for key in assigned]
        try:
            self.state.assign(keys)
        except StateRefused as e:
            self.refusal = e
        except BROKER_ERRORS as e:  # the partitions' states could not be read: reconnect, and be assigned again
            self._broken = e
        if self.refusal is None and self.consumer is not None:
            everything = self.consumer.partitions_of(self.cfg.kafka.topic)  # None: not known yet
            images = {key.partition for key in assigned if key.topic != self.cfg.kafka.labels_topic}
            self.refusal = self.state.membership.check_assignment(images, everything)
        log.info("assigned %s", keys)
        return {PartitionKey.parse(key): offset for key, offset in self.state.positions(keys).items()}

    def let_go(self, keys: list[str]) -> None:
        """On revocation: learn what is pending and persist, then let the partitions go whatever happened; nothing
        raises (``poll`` would, and the loop reconnect forever)."""
        try:
            if self.failure is None:  # after a failed write (the consumer closing), nothing more is written
                self.learn_pending()
                self.persist(Persist.BEFORE_REVOKE)
        except BROKER_ERRORS as e:  # the dead letters could not be flushed: nothing was captured
            self._broken = e
        except StateWriteFailed as e:
            log.error("%s; letting %s go", e, keys)
        finally:
            self.state.revoke(keys)

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self._connect()
                self._consume()
                break
            except BROKER_ERRORS as e:
                log.warning("Kafka unavailable (%s); retrying in 2 s", e)
                self._close()
                self.stop_event.wait(2.0)
            except StateRefused as e:  # a state these options cannot take: learning stops, serving goes on
                log.error("learning stopped: %s", e)
                self.error = str(e)
                break
            except Exception as e:  # a bug, not a broker problem: stop learning, report it, keep serving
                log.exception("the learner loop failed")
                self.error = f"{type(e).__name__}: {e}"
                break
        self._close()
        self.writer.shutdown()

    def _consume(self) -> None:
        assert self.consumer is not None
        while not self.stop_event.is_set():
            self._turn()
        self.learn_pending()
        self.persist()

    def _turn(self) -> None:
        """A checkpoint asked for, or (unless paused) a poll; then what may wait for the broker or the disk."""
        self._check_rebalance()
        if self._checkpoint_request.is_set():
            self._checkpoint_request.clear()
            self.learn_pending()
            self.persist(Persist.ASKED)
        if self._paused.is_set():
            self.stop_event.wait(0.2)
            return
        records = self._read_while_learning()
        if not records and not self.booked.waiting:
            self.state.on_idle()
            self.persist()
        if self.writing is not None and self.writing.done():
            self._finish_write(commit=True)
        if self.booked.checkpoint_due:
            self.booked = replace(self.booked, checkpoint_due=False)  # the next booking tells again
            self.persist(Persist.IF_DUE)
        self.update_lag()

    def _read_while_learning(self) -> list:
        """Poll while the model thread learns (waiting only to fill a mini-batch), then have it book and learn."""
        assert self.consumer is not None
        try:
            learning = self.booked.learns and self.stepping is not None and not self.stepping.done()
            if not learning:
                self.settle(raises=True)
            pending = 0 if learning else sum(self.booked.waiting.values())
            room = self.booked.limit - pending  # none: a full mini-batch waits (after a checkpoint), learned now
            wait_ms = 0 if learning else fill_wait_ms(self.consumer, self.cfg.kafka.labels_topic,
                                                      self.booked.changes_waiting)
            records = self._poll(wait_ms, room) if room > 0 else []
            if not records and (learning or not pending):
                self.settle(raises=True)
                return records
            booked: Future[Booked] = Future()
            writer_idle = self.writing is None or self.writing.done()
            self.stepping = self.state.model_thread.submit(self.state.accept_then_learn, records, booked, writer_idle)
            self.booked = booked.result()
            send(self.producer, self.cfg.kafka, self.state.metrics, self.booked.outgoing)
            return records
        except BaseException:
            self.settle(raises=False)
            raise

    def settle(self, raises: bool) -> None:
        """Wait for the model thread's turn in flight; ``raises``: its step's error, if it failed."""
        stepping, self.stepping = self.stepping, None
        if stepping is None:
            return
        error = stepping.exception()  # waits for it
        if self.booked.learns:
            self.booked = replace(self.booked, learns=False, waiting=Counter())
        if raises and error is not None:
            raise error

    def learn_pending(self) -> None:
        """Learn everything pending, after the turn in flight: nothing waits for a mini-batch after it."""
        self.settle(raises=True)
        self.state.learn_pending()
        self.booked = replace(self.booked, waiting=Counter())

    def _poll(self, wait_ms: int, max_records: int) -> list[Record]:
        """Up to ``max_records`` records, images first (by partition and offset), then labels."""
        assert self.consumer is not None
        polled = self.consumer.poll(wait_ms, max_records)
        self._check_rebalance()
        if time.monotonic() - self._probed_at > PROBE_EVERY_S or not self.connected:
            self.connected, self._probed_at = self.consumer.probe(timeout_s=2.0), time.monotonic()
            self.state.metrics.learner_up.set(int(self.connected))
        return sorted(polled, key=lambda r: (r.topic == self.cfg.kafka.labels_topic, r.partition, r.offset))

    def _check_rebalance(self) -> None:
        """Stop on a failed state write or a refusal, reconnect on a broker error in a rebalance handler."""
        if self.failure is not None:
            raise self.failure
        if (refusal := self.refusal or self.state.refusal) is not None:
            raise refusal
        if self._broken is not None:
            broken, self._broken = self._broken, None
            raise broken

    def accept(self, records: list) -> None:
        """Have the model thread book one poll's records, learning nothing, and send what it hands back."""
        self.booked = self.state.accept(records)
        send(self.producer, self.cfg.kafka, self.state.metrics, self.booked.outgoing)

    def persist(self, when: Persist = Persist.NOW) -> None:
        """The one way offsets leave the loop: flush the dead letters, checkpoint, then commit the same offsets (a
        failed commit is only logged: the checkpoint is the truth). One write is in flight at a time."""
        if when is Persist.IF_DUE and self.writing is not None and not self.writing.done():
            return  # the next turn asks again
        self._finish_write(when.commits)
        if self.producer is not None:
            self.producer.flush()
        if (captured := self.state.capture()) is None:
            return
        self.writing = self.writer.submit(self.state.write, captured)
        if when.waits:
            self._finish_write(when.commits)

    def _finish_write(self, commit: bool) -> None:
        """Wait for the write in flight, then commit its offsets if ``commit``; a failure is kept in ``failure``."""
        if self.writing is None:
            return
        writing, self.writing = self.writing, None
        try:
            offsets = writing.result()
        except StateWriteFailed as e:
            self.failure = e
            raise
        if commit and offsets and self.consumer is not None:
            self.consumer.commit({PartitionKey.parse(key): offset for key, offset in offsets.items()})

    def update_lag(self) -> None:
        assert self.consumer is not None
        for key, lag in unread(self.consumer, self.cfg.kafka.labels_topic, self.booked.waiting).items():
            self.lag[key] = lag
            self.state.metrics.lag.labels(PartitionKey.parse(key).partition).set(lag)
