"""SIGTERM stops every long-running command as SIGINT does: a real signal to a real ``mepo`` process mid-run.

``docker stop``, systemd and Kubernetes send SIGTERM, whose default action ends a Python process at once: no
``finally`` runs, so the demo left its embedded broker (``tansu``) behind, with no summary. Each test starts the
command as its own process, sends SIGTERM while it works, and checks its exit code, its last words, what it wrote,
and that no process it started is left (its children, read from ``/proc`` while it ran).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import httpx
import pytest
from kafka import KafkaConsumer, TopicPartition

from mepo_stream.anytime import ProtocolConfig
from mepo_stream.checkpoint import load_checkpoint
from mepo_stream.cli import config_options
from mepo_stream.sampler import SiBlurryConfig
from mepo_stream.shutdown import Stopped, deferred_stop, stop_process
from offline.refine import checkpoint_path
from producers.siblurry import ReplayConfig, produce
from server.broker import EmbeddedBroker
from server.config import DemoConfig, ServeConfig
from server.learner.state import CHECKPOINT
from tests.helpers import DATA, NO_BROKER, ROOT, checkpoint, http_client, serve_process, settings, wait_for

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
TINY_ARGS = ["--backbone.name", "test_vit", "--backbone.weights", "null", "--backbone.img_size", "32"]


class Command(subprocess.Popen):
    """``mepo ARGS`` as its own process, stdout and stderr into ``log``."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        with open(log, "ab") as out:
            super().__init__([sys.executable, "-m", "mepo_stream.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                             env=ENV)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def running(self) -> bool:
        if self.poll() is not None:
            raise AssertionError(f"exited with {self.returncode}:\n{self.output()[-3000:]}")
        return True

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 90) -> int:
        """Send ``sig``; its exit code once it has exited."""
        self.send_signal(sig)
        return self.wait(timeout)


def children(pid: int) -> set[int]:
    """The processes ``pid`` started that still run (every thread's ``/proc/.../children``)."""
    return {int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()}


def alive(pid: int) -> bool:
    """Running, or stopped but not reaped (a zombie counts as gone: it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


@pytest.fixture
def reap():
    """Processes to kill at teardown if a test left them (a failing test must not leave a broker running)."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_stop_process_kills_a_child_that_ignores_sigterm():
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", ignore], stdout=subprocess.PIPE)
    child.stdout.readline()  # its handler is set
    stop_process(child, timeout=0.5)
    assert child.returncode == -signal.SIGKILL


def test_a_deferred_stop_waits_for_its_safe_point_and_a_second_signal_stops_at_once():
    with pytest.raises(Stopped) as raised, deferred_stop() as signalled:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signalled.requested  # held for the safe point, not raised
        os.kill(os.getpid(), signal.SIGINT)
        pytest.fail("a second signal did not stop at once")
    assert raised.value.signum == signal.SIGINT
    with pytest.raises(Stopped), deferred_stop():
        os.kill(os.getpid(), signal.SIGTERM)  # after the last check: raised as the block ends


def test_a_broker_interrupted_while_it_starts_is_stopped(monkeypatch):
    """``__exit__`` never runs when ``__enter__`` raises: a stop signal while the broker starts must stop it."""
    def interrupted(*args, **kwargs):
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr("server.broker.socket.create_connection", interrupted)
    broker = EmbeddedBroker()
    with pytest.raises(Stopped):
        broker.start()
    assert broker.process is None


def demo_args(tmp_path: Path) -> list[str]:
    """``mepo demo`` on the tiny ViT: a 50-record stream at 2 records/s (the producer still runs when the signal
    comes), no periodic checkpoint (only the one written at the stop), no evaluation."""
    base = settings(NO_BROKER, tmp_path, checkpoint_every=100_000, protocol=ProtocolConfig(eval_period=0))
    cfg = DemoConfig(**{f.name: getattr(base, f.name) for f in fields(ServeConfig)})
    cfg = replace(cfg, kafka=replace(cfg.kafka, bootstrap_servers="127.0.0.1:0"))  # the embedded broker: a free port
    return ["demo", *config_options(replace(cfg, data=replace(DATA, train_per_class=5, test_per_class=1),
                                            replay=ReplayConfig(rate=2.0)))]


def samples_seen(http: httpx.Client) -> int:
    return http.get("/v1/status").json()["samples_seen"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_demo_stopped_by_a_signal_prints_its_summary_checkpoints_and_stops_broker_and_producer(tmp_path, reap, sig):
    """The issue: SIGINT stopped the demo cleanly, SIGTERM left its broker running. Now both take the same path."""
    args = demo_args(tmp_path)
    port = int(args[args.index("--port") + 1])
    demo = Command(args, tmp_path / "demo.log")
    reap.add(demo.pid)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        wait_for(lambda: demo.running() and samples_seen(http) > 0, 120, "a first sample learned",
                 ignore=(httpx.TransportError,))
    started = children(demo.pid)
    reap.update(started)
    assert {"tansu", "produce"} <= {word for pid in started for word in ("tansu", "produce")
                                    if word in command_line(pid)}, [command_line(pid) for pid in started]

    code = demo.stop(sig)
    assert not [command_line(pid) for pid in started if alive(pid)]  # no broker, no producer left behind
    out = demo.output()
    assert code == 0, out[-3000:]
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["samples_seen"] > 0
    assert all(round(v, 3) == v for v in summary.values() if isinstance(v, float)), summary  # no 0.7400000095
    state = load_checkpoint(tmp_path / "ckpt" / CHECKPOINT)  # written at the stop: it holds what was learned
    assert int(state["learner"]["samples_seen"]) == summary["samples_seen"]
    assert f"server.serve: stopped by {sig.name}" in out
    assert "stopped by SIGTERM: sent" in out  # the producer, which the demo stops with SIGTERM


def test_serve_on_sigterm_checkpoints_and_exits_0(broker, tmp_path, reap):
    cfg = settings(broker, tmp_path, checkpoint_every=100_000)
    produce(DATA, SiBlurryConfig(seed=1), cfg.kafka, ReplayConfig(limit=48))
    learner = serve_process(cfg, tmp_path / "serve.log")
    reap.add(learner.pid)
    with http_client(cfg) as http:
        wait_for(lambda: learner.running() and samples_seen(http) > 0, 120, "a first sample learned",
                 ignore=(httpx.TransportError,))
    started = children(learner.pid)
    learner.send_signal(signal.SIGTERM)
    assert learner.wait(90) == 0, learner.log.read_text()[-3000:]
    assert not [command_line(pid) for pid in started if alive(pid)]
    assert checkpoint(cfg)["learner"]["samples_seen"] > 0


def end_offset(bootstrap: str, topic: str) -> int:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    try:
        tp = TopicPartition(topic, 0)
        return consumer.end_offsets([tp])[tp]
    finally:
        consumer.close()


def test_produce_on_sigterm_flushes_what_it_sent_says_how_many_and_exits_143(broker, tmp_path):
    cfg = settings(broker, tmp_path)
    producer = Command(["produce", *config_options(DATA, "--data."), *config_options(cfg.kafka, "--kafka."),
                        "--replay.rate", "10"], tmp_path / "produce.log")
    wait_for(lambda: producer.running() and end_offset(broker.bootstrap, cfg.kafka.topic) >= 5, 60,
             "the first records in the topic", ignore=(Exception,))
    assert producer.stop() == 128 + signal.SIGTERM, producer.output()[-3000:]
    line = [ln for ln in producer.output().splitlines() if "stopped by SIGTERM: sent" in ln][-1]
    sent, total = (int(w) for w in line.split("sent ")[1].split(" records")[0].split(" of "))
    assert 5 <= sent < total == 200
    assert end_offset(broker.bootstrap, cfg.kafka.topic) == sent  # every record it counted is in the topic
    assert "mepo: stopped by SIGTERM" in producer.output()


REFINE_ARGS = [*TINY_ARGS, "--data.train_per_class", "4", "--tasks.classes_per_group", "20", "--tasks.n_tasks", "4",
               "--tasks.samples_per_class", "4", "--tasks.val_ratio", "0.25", "--loop.inner_epochs", "1",
               "--loop.batch_size", "16", "--loop.precision", "fp32", "--cov.skip", "true", "--adapt.skip", "true",
               "--guard.skip", "true"]


def test_a_crash_in_native_code_leaves_every_threads_python_stack_in_the_log(broker, tmp_path):
    """A segfault or an abort in a C extension (a binding's race, a driver) ends the process before any Python
    handler runs; the entry point's fault handler still writes where each thread was, so the log says which code
    crashed. A SIGSEGV sent mid-run stands in for the crash."""
    cfg = settings(broker, tmp_path)
    producer = Command(["produce", *config_options(DATA, "--data."), *config_options(cfg.kafka, "--kafka."),
                        "--replay.rate", "10"], tmp_path / "produce.log")
    wait_for(lambda: producer.running() and end_offset(broker.bootstrap, cfg.kafka.topic) >= 2, 60,
             "the first records in the topic", ignore=(Exception,))
    assert producer.stop(signal.SIGSEGV) == -signal.SIGSEGV
    out = producer.output()
    assert "Fatal Python error: Segmentation fault" in out, out[-3000:]
    assert "most recent call first" in out and "producers/siblurry.py" in out  # where the main thread was


def test_refine_on_sigterm_checkpoints_its_meta_epoch_and_resume_continues(tmp_path):
    out = tmp_path / "refined"
    run = Command(["refine", "--out", str(out), "--loop.meta_epochs", "1000", *REFINE_ARGS], tmp_path / "refine.log")
    wait_for(lambda: run.running() and "meta-epoch 1/1000" in run.output(), 120, "a first meta-epoch")
    assert run.stop() == 128 + signal.SIGTERM, run.output()[-3000:]
    done = load_checkpoint(checkpoint_path(out))["meta_epoch"]
    assert f"stopped after meta-epoch {done}/1000" in run.output() and not (out / "manifest.json").exists()

    resumed = Command(["refine", "--out", str(out), "--loop.meta_epochs", str(done + 1), "--resume", "true",
                       *REFINE_ARGS], tmp_path / "resume.log")
    assert resumed.wait(120) == 0, resumed.output()[-3000:]
    assert f"resuming after meta-epoch {done}" in resumed.output()
    assert json.loads((out / "manifest.json").read_text())["meta_epochs_completed"] == done + 1
