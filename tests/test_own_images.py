"""A first-time user's own photos, end to end: an ImageFolder streamed whole by ``mepo demo`` as the docs write it,
predictions over ``/v1`` and ``/v2``, a correction and a deletion addressed by a photo's file, a clean stop; and what
made the first try fail silently: a child that dies, null options, the broker's port, ``/metrics`` behind
``/v1/status``."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from mepo_stream.cli import parse
from mepo_stream.errors import ConfigError
from mepo_stream.kafka import ReplayConfig
from producers.siblurry import produce
from server.broker import embedded_port, free_port
from server.config import CorrectionsConfig, DemoConfig
from server.serve import producer_command
from tests.helpers import DATA, ROOT, LiveServer, code_blocks, settings, wait_for
from tests.test_labels_later import STREAM
from tests.test_signals import TINY_ARGS, Command, alive, children, command_line, demo_args, reap  # noqa: F401

TOKEN = {"Authorization": "Bearer s3cret"}


def photo_folder(root: Path, train: int = 60, test: int = 8) -> Path:
    """``root/photos``: two classes of noisy JPEGs of mixed sizes, each class its own colour; ``train`` a class is
    more than the demo's cap for a bundled dataset."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("test", test)):
        for name, colour in (("cat", (200, 40, 40)), ("dog", (40, 40, 200))):
            folder = root / "photos" / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                h, w = rng.integers(24, 97, size=2)
                pixels = np.clip(np.array(colour) + rng.integers(-40, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:04d}.jpg", quality=90)
    return root / "photos"


def test_null_passed_to_the_demo_reaches_its_producer_as_null():
    """Every option the demo passes on to ``mepo produce``, set to null, parses back as null there (it reached the
    producer as the string "None", which it refused, and died)."""
    data = replace(DemoConfig().data, train_per_class=None, test_per_class=None, num_classes=None, load_size=None)
    replay = ReplayConfig(rate=None, limit=None, label_delay=None)
    cfg = replace(DemoConfig(), data=data, replay=replay)
    parsed = parse(producer_command(cfg)[3:])
    nulls = {"data.train_per_class", "data.test_per_class", "data.num_classes", "data.load_size", "data.data_dir",
             "kafka.labels_topic", "replay.rate", "replay.limit", "replay.label_delay", "replay.label_delay_max"}
    assert {name: parsed.produce[name] for name in nulls} == dict.fromkeys(nulls)
    named = replace(cfg, kafka=replace(cfg.kafka, labels_topic="mepo.labels"), replay=ReplayConfig(label_delay=5))
    assert parse(producer_command(named)[3:]).produce["kafka.labels_topic"] == "mepo.labels"  # a value as itself


def test_the_embedded_broker_takes_the_port_it_is_given_or_says_why_not():
    assert embedded_port("127.0.0.1:0") is None  # 0: a free port
    port = free_port()
    assert embedded_port(f"127.0.0.1:{port}") == port
    for address, why in (("kafka.example:9092", "loopback"), ("127.0.0.1:1,127.0.0.1:2", "loopback")):
        with pytest.raises(ConfigError, match=why):
            embedded_port(address)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match="in use"):
            embedded_port(f"127.0.0.1:{taken.getsockname()[1]}")


def test_a_port_a_stopped_broker_left_in_time_wait_is_free_again():
    """A demo started again right after Ctrl-C: the stopped broker closed its end of a connection first, which
    leaves that connection in TIME_WAIT on the broker's port for a minute; the broker can bind it, so can the demo."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a broker listens
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the broker's side closes first: its end goes to TIME_WAIT
        client.close()
    assert embedded_port(f"127.0.0.1:{port}") == port


def test_metrics_and_status_agree_right_after_a_deletion_refused_on_an_idle_stream(broker, tmp_path):
    cfg = replace(settings(broker, tmp_path), corrections=CorrectionsConfig(enabled=True), admin_token="s3cret")
    n = produce(DATA, STREAM, cfg.kafka, ReplayConfig(limit=16))
    with LiveServer(cfg) as http:
        wait_for(lambda: http.get("/v1/status").json()["samples_seen"] >= n, what="the stream learned")
        assert http.delete("/v1/samples/never-sent", headers=TOKEN).status_code == 202
        wait_for(lambda: http.get("/v1/status").json()["corrections"]["deletions_refused"] == 1, 60, "refused")
        status, metrics = http.get("/v1/status").json()["corrections"], http.get("/metrics").text
    exported = {f"{kind}_{outcome}": float(value) for kind, outcome, value in re.findall(
        r'mepo_sample_changes_total\{kind="(\w+)",outcome="(\w+)"\} (\S+)', metrics)}
    assert exported == {k: status[k] for k in exported} and len(exported) == 4, (exported, status)


@pytest.mark.parametrize("until_done", [True, False], ids=["until_done", "serving"])
def test_a_demo_whose_producer_dies_says_so(tmp_path, reap, until_done):  # noqa: F811
    """Its producer killed: with --until_done the demo exits non-zero within 10 s naming why; else /readyz is 503
    and /v1/status names it, and a stop exits non-zero with nothing left running."""
    args = [*demo_args(tmp_path), "--until_done", json.dumps(until_done)]
    port = int(args[args.index("--port") + 1])
    demo = Command(args, tmp_path / "demo.log")
    reap.add(demo.pid)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        wait_for(lambda: demo.running() and http.get("/v1/status").json()["samples_seen"] > 0, 120,
                 "a first sample learned", ignore=(httpx.TransportError,))
        started = children(demo.pid)
        reap.update(started)
        os.kill(next(pid for pid in started if "produce" in command_line(pid)), signal.SIGKILL)
        killed_at = time.monotonic()
        why = "the producer (mepo produce) was killed by SIGKILL"
        if until_done:
            code = demo.wait(10)
            assert time.monotonic() - killed_at < 10 and code != 0, demo.output()[-3000:]
        else:
            ready = wait_for(lambda: (r := http.get("/readyz")).status_code == 503 and r.json(), 10, "not ready")
            assert ready["child_error"].startswith(why) and not ready["checks"]["children_running"]
            assert http.get("/v1/status").json()["child_error"].startswith(why)
            code = demo.stop()
            assert code != 0
    assert why in demo.output()
    assert not [command_line(pid) for pid in started if alive(pid)]


def docs_commands() -> list[str]:
    """The "Your own images" section's bash block, as the getting-started page writes it."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    section = page.split("## Your own images", 1)[1].split("\n## ", 1)[0]
    return [line for line in code_blocks(section, "bash")[0].splitlines() if line and not line.startswith("#")]


def test_your_own_images_as_the_docs_write_it(tmp_path, reap):  # noqa: F811
    """A folder of 136 JPEGs of mixed sizes, streamed whole; /v1 and /v2 predict; a photo looked up, relabelled and
    another deleted by their files; SIGTERM stops the demo, its producer and broker."""
    home = tmp_path / "home"
    photos = photo_folder(home)
    port = free_port()
    demo_line, *curls = [line.replace("~/photos", str(photos)).replace("$HOME", str(home))
                         .replace("127.0.0.1:8000", f"127.0.0.1:{port}") for line in docs_commands()]
    argv = shlex.split(demo_line)
    assert argv[0].endswith("/mepo") and argv[1] == "demo"
    demo = Command([*argv[1:], *TINY_ARGS, "--port", str(port), "--checkpoint_dir", str(tmp_path / "ckpt"),
                    "--protocol.eval_period", "0", "--kafka.bootstrap_servers", "127.0.0.1:0"], tmp_path / "demo.log")
    reap.add(demo.pid)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        learned = wait_for(lambda: demo.running() and (s := http.get("/v1/status").json())["samples_seen"] == 120
                           and s, 180, "the whole folder learned", ignore=(httpx.TransportError,))
        started = children(demo.pid)
        reap.update(started)
        assert learned["classes_seen"] == 2
        assert "streaming 120 training images of" in demo.output() and "(all of it)" in demo.output()

        def curl(line: str) -> dict:
            done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=30, check=True)
            return json.loads(done.stdout)

        v1, v2, held, relabel, delete = (curl(line) for line in curls)
        assert v1["predictions"][0]["top_k"][0]["name"] == "cat" and v1["samples_seen"] == 120
        assert [o["name"] for o in v2["outputs"]] == ["label", "probability", "novelty", "novel"]
        assert held == {"id": "photos/T5-N50-M10/seed1/train/cat/0001.jpg", "label": 0, "class_name": "cat",
                        "time": held["time"], "file": "train/cat/0001.jpg"}
        assert relabel["id"] == held["id"] and delete["id"].endswith("train/cat/0002.jpg")
        wait_for(lambda: (c := http.get("/v1/status").json()["corrections"])["corrections_applied"] == 1
                 and c["deletions_applied"] == 1, 60, "the correction and the deletion applied")
        assert http.get(f"/v1/samples/{held['id']}", headers=TOKEN).json()["label"] == 1
        gone = http.get(f"/v1/samples/{delete['id']}", headers=TOKEN)
        assert gone.status_code == 404 and gone.json()["reason"] == "unknown_id"
    assert demo.stop() == 0, demo.output()[-3000:]
    assert not [command_line(pid) for pid in started if alive(pid)]
    assert "blocking the event loop" not in demo.output()
