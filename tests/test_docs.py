"""The docs site (``mkdocs.yml``, ``docs/``) and the README: the site builds with ``--strict`` (a broken link, a
missing page or a stale API reference fails), its generated pages hold what the code has, and every ``mepo``
command in them parses against the CLI as it is. The HTTP clients' examples run against a live server in
``tests/test_http_api.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mepo_stream.cli import parse
from tests.helpers import ROOT, code_blocks, mepo_commands

PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def test_mepo_commands_are_found_in_bash_blocks():
    page = "```bash\n.venv/bin/mepo serve --port 8000 \\\n  --mepo b  # comment\ncurl x\n" \
           "torchrun --standalone -m mepo_stream.cli refine --out r\n```\n```text\nmepo demo\n```\n"
    assert mepo_commands(page) == [["serve", "--port", "8000", "--mepo", "b"], ["refine", "--out", "r"]]
    assert code_blocks("```python\nx = 1\n```\n", "python") == ["x = 1\n"]


def test_the_site_builds_strict_with_its_generated_pages(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    cli = (site / "cli" / "index.html").read_text()
    assert "mepo serve" in cli and "--kafka.state_topic" in cli and "--replay.partition_by" in cli
    assert "/v2/models/{name}/infer" in (site / "http-api" / "index.html").read_text()
    assert "LabelStatistics" in (site / "api" / "index.html").read_text()


def without_config_files(argv: list[str]) -> list[str]:
    """``argv`` without ``--config FILE``: an example's recipe file is the reader's own."""
    out, skip = [], False
    for word in argv:
        if not skip and word != "--config":
            out.append(word)
        skip = word == "--config"
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_mepo_command_in_the_docs_parses(page):
    for argv in mepo_commands(page.read_text()):
        try:
            parse(without_config_files(argv))
        except (SystemExit, Exception) as e:  # the CLI printed why
            pytest.fail(f"{page.name}: `mepo {' '.join(argv)}` does not parse ({type(e).__name__}: {e})")


def test_the_architecture_page_names_every_thread_a_learner_starts(broker, tmp_path):
    """docs/architecture.md's thread table against the threads of a running learner with every optional part on:
    in a group, publishing snapshots, serving gRPC."""
    import re
    import threading
    from dataclasses import replace

    import tritonclient.grpc as grpcclient

    from mepo_stream.sampler import SiBlurryConfig
    from producers.siblurry import ReplayConfig, produce
    from server.broker import free_port
    from tests.helpers import DATA, LiveServer, settings, wait_for

    cfg = settings(broker, tmp_path, grpc_port=free_port())
    name = cfg.kafka.topic
    cfg = replace(cfg, kafka=replace(cfg.kafka, state_topic=f"state-{name}", snapshot_topic=f"snapshots-{name}"))
    produce(DATA, SiBlurryConfig(seed=1), cfg.kafka, ReplayConfig(limit=32))
    with LiveServer(cfg) as http:
        wait_for(lambda: http.get("/v1/status").json()["samples_seen"] >= 32, 180, "the stream learned")
        assert grpcclient.InferenceServerClient(f"127.0.0.1:{cfg.grpc_port}").is_server_live()  # its pool's thread
        running = {re.sub(r"_\d+$", "", t.name) for t in threading.enumerate() if t.name.startswith("mepo-")}
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page[page.index("## Threads, and who owns what"):page.index("## Layout")]
    named = set(re.findall(r"`(mepo-[a-z-]+)`", table))
    assert {"mepo-learner", "mepo-model", "mepo-checkpoint", "mepo-publisher", "mepo-changelog", "mepo-grpc"} <= running
    assert running <= named, f"threads the page does not name: {running - named}"
