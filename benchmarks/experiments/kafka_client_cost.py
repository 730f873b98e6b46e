"""What the Kafka client costs the learner beside a nearly free model: kafka-python against librdkafka.

The learner reads with kafka-python, which parses every record in Python, under the GIL the model thread also
needs between its operators. This measures, on the embedded broker and the stream ``mepo produce`` writes (one
JPEG and eight headers a record):

* ``consume_us_per_record``: one client alone reading the topic, 32 records a call, each record's headers and
  value touched;
* ``intake_records_per_s``: the same plus what the learner's intake does to each record (``parse_headers``,
  ``decode_image``), alone;
* ``model_samples_per_s``: the nearly free model of ``make bench``'s ``learner_overhead`` rows (``test_vit`` at
  32 px, frozen + streaming LDA, learning only: the bare loop's learner) alone, then beside that intake running
  flat out in a second thread (``beside``): how much of its rate the model keeps, and what the intake still reads.

librdkafka (``pip install confluent-kafka``) is measured where it is installed.

Usage:
    python -m benchmarks.experiments.kafka_client_cost
Writes ``benchmarks/results/kafka_client_cost.json``.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.rows.learner_throughput import decoded, stream_batches
from benchmarks.tools.service import ServiceSpec, bare_learner, write_result
from mepo_stream.data import DataConfig
from mepo_stream.images import ImageLimits, decode_image
from mepo_stream.kafka import KafkaConfig
from mepo_stream.records import parse_headers
from producers.siblurry import produce
from server.broker import EmbeddedBroker

FREE_MODEL = ServiceSpec(dataset="cifar10", model="test_vit", weights=None, img_size=32, mepo=None, method="frozen")
POLL = 32  # records a call: the learner's --learner.batch_size
HEADERS = 8  # of each record mepo produce writes (mepo_stream.records.record_headers)

Reader = Callable[[], list[tuple[list, bytes]]]
"""One call of a client: the (headers, value) of up to ``POLL`` records."""


@contextmanager
def kafka_python(bootstrap: str, topic: str, group: str) -> Iterator[Reader]:
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                             auto_offset_reset="earliest", max_poll_records=POLL, fetch_max_bytes=16 * 2**20,
                             fetch_max_wait_ms=100)  # the learner's settings (server.learner.stream)
    try:
        yield lambda: [(r.headers, r.value) for rs in consumer.poll(timeout_ms=1000).values() for r in rs]
    finally:
        consumer.close()


@contextmanager
def librdkafka(bootstrap: str, topic: str, group: str) -> Iterator[Reader]:
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    try:
        yield lambda: [(m.headers(), m.value()) for m in consumer.consume(POLL, 1.0) if m.error() is None]
    finally:
        consumer.close()


CLIENTS = {"kafka-python": kafka_python, "confluent-kafka": librdkafka}


def installed() -> list[str]:
    return ["kafka-python"] + (["confluent-kafka"] if importlib.util.find_spec("confluent_kafka") else [])


def read(reader: Reader, n: int, work: Callable[[list, bytes], object], started: threading.Event | None = None
         ) -> tuple[int, float]:
    """Records read (and ``work`` done on each) from the first non-empty call until ``n``, and the seconds it
    took."""
    got, t0 = 0, None
    while got < n:
        records = reader()
        if records and t0 is None:
            t0 = time.perf_counter()
            if started is not None:
                started.set()
        for headers, value in records:
            work(headers, value)
        got += len(records)
    assert t0 is not None, "the topic gave no record"
    return got, time.perf_counter() - t0


def model_rate(batches: int) -> Callable[[threading.Event | None], float]:
    """The nearly free model's bare learning loop: samples/s over ``batches`` mini-batches (three learned before),
    or, given an event, over as many as it learns until the event is set (from the first batch again if need be)."""
    learner = bare_learner(FREE_MODEL, 10)
    drawn = [(decoded(FREE_MODEL, images, learner.device), labels)
             for images, labels in stream_batches(FREE_MODEL, batches + 3, learner.device)]
    for images, labels in drawn[:3]:
        learner.observe(images, labels)

    def run(until: threading.Event | None = None) -> float:
        t0, learned = time.perf_counter(), 0
        while until is None and learned < batches or until is not None and not until.is_set():
            images, labels = drawn[3 + learned % batches]
            learner.observe(images, labels)
            learned += 1
        return learned * POLL / (time.perf_counter() - t0)

    return run


def main(records: int = 20_000, model_batches: int = 400, switch_interval_ms: float | None = None,
         out: Path = Path("benchmarks/results/kafka_client_cost.json")) -> dict:
    """Measure each installed client's read and intake cost, and the nearly free model's rate beside its intake.

    Args:
        records: CIFAR-10 records in the topic (the first ``records / 10`` training images of each class).
        model_batches: Timed mini-batches of each model run.
        switch_interval_ms: The interpreter's GIL switch interval (``sys.setswitchinterval``; null: Python's 5 ms).
        out: JSON result path.
    """
    torch.manual_seed(0)
    if switch_interval_ms is not None:
        sys.setswitchinterval(switch_interval_ms / 1000)
    limits = ImageLimits().at(FREE_MODEL.img_size)

    def intake(headers: list, value: bytes) -> None:  # what the learner does to each record it claims
        parse_headers(headers, 10)
        decode_image(value, limits)

    model = model_rate(model_batches)
    alone = [model(None)]
    with EmbeddedBroker() as broker:
        kafka = KafkaConfig(bootstrap_servers=broker.bootstrap)
        produce(data=DataConfig(dataset="cifar10", train_per_class=records // 10), kafka=kafka)
        clients = {name: client_cost(CLIENTS[name], broker.bootstrap, kafka.topic, records, intake, model)
                   for name in installed()}
    alone.append(model(None))
    for cost in clients.values():
        cost["model_kept"] = cost["model_beside_samples_per_s"] / (sum(alone) / 2)
    return write_result({"benchmark": "kafka_client_cost", "records": records, "headers_per_record": HEADERS,
                         "switch_interval_ms": sys.getswitchinterval() * 1000, "model_alone_samples_per_s": alone,
                         **clients}, out, *FREE_MODEL.placement())


def client_cost(client, bootstrap: str, topic: str, records: int, intake: Callable[[list, bytes], None],
                model: Callable[[threading.Event | None], float]) -> dict:
    """One client's read cost alone, its intake's rate alone, and both rates with the model beside it (each in a
    consumer group of its own, so each reads the whole topic)."""
    groups = iter(f"{client.__name__}-{i}" for i in range(3))
    with client(bootstrap, topic, next(groups)) as reader:
        n, s = read(reader, records, lambda headers, value: len(headers) == HEADERS or _fail(len(headers)))
    with client(bootstrap, topic, next(groups)) as reader:
        n_intake, s_intake = read(reader, records, intake)
    return {"consume_us_per_record": s / n * 1e6, "intake_records_per_s": n_intake / s_intake,
            **model_beside(client, bootstrap, topic, next(groups), records, intake, model)}


def _fail(headers: int) -> bool:
    raise AssertionError(f"a record with {headers} headers: mepo produce writes {HEADERS}")


def model_beside(client, bootstrap: str, topic: str, group: str, records: int,
                 intake: Callable[[list, bytes], None], model: Callable[[threading.Event | None], float]) -> dict:
    """The model's rate while the client's intake reads the whole topic flat out in another thread, and the
    intake's rate meanwhile."""
    started, finished, done = threading.Event(), threading.Event(), {}

    def reading() -> None:
        with client(bootstrap, topic, group) as reader:
            done["read"] = read(reader, records, intake, started)
        finished.set()

    thread = threading.Thread(target=reading)
    thread.start()
    started.wait()
    rate = model(finished)
    thread.join()
    n, s = done["read"]
    return {"model_beside_samples_per_s": rate, "intake_beside_records_per_s": n / s}


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
