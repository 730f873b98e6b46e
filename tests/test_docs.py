"""The docs site (``mkdocs.yml``, ``docs/``) and the README: the site builds with ``--strict`` (a broken link, a
missing page or a stale API reference fails), its generated pages hold what the code has, and every ``mepo``
command in them parses against the CLI as it is. The HTTP clients' examples run against a live server in
``tests/test_http_api.py``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from mepo_stream.cli import parse
from tests.helpers import ROOT, code_blocks, mepo_commands

PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
USER_PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]  # docs/design/ holds the dated records
GENERATED_BLOCKS = re.compile(r"<!-- (benchmarks:start|frontier:begin|expect:start) -->.*?"
                              r"<!-- (benchmarks:end|frontier:end|expect:end) -->", re.S)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
TIME_OF_DAY = re.compile(r"(?<![\d.:])[0-2]\d:[0-5]\d(?![\d:])")


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
        wait_for(lambda: http.get("/v1/status").json()["checkpoint_age_seconds"] is not None, 60,
                 "a state written (the writer's thread starts with its first write)")
        assert grpcclient.InferenceServerClient(f"127.0.0.1:{cfg.grpc_port}").is_server_live()  # its pool's thread
        running = {re.sub(r"_\d+$", "", t.name) for t in threading.enumerate() if t.name.startswith("mepo-")}
    page = (ROOT / "docs" / "architecture.md").read_text()
    table = page[page.index("## Threads, and who owns what"):page.index("## Layout")]
    named = set(re.findall(r"`(mepo-[a-z-]+)`", table))
    assert {"mepo-learner", "mepo-model", "mepo-checkpoint", "mepo-publisher", "mepo-changelog", "mepo-grpc"} <= running
    assert running <= named, f"threads the page does not name: {running - named}"


def run_log(text: str) -> list[str]:
    """What makes a page a run log: dates and times of day outside the generated tables, runs made by hand."""
    text = GENERATED_BLOCKS.sub("", text)
    one_off = r"(?:once|passed|ran|measured),? by hand|by hand,? once|throwaway|sitting"
    return DATE.findall(text) + TIME_OF_DAY.findall(text) + re.findall(one_off, text)


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_no_user_page_is_a_run_log(page):
    """Dated runs, times of day and one-off runs belong in docs/design/'s records, not in the user pages."""
    assert not run_log(page.read_text()), f"{page.name}: move these to a design record: {run_log(page.read_text())}"


def test_the_run_log_check_finds_dates_and_times_and_spares_generated_tables():
    assert run_log("2026-11-29 at 09:52, measured by hand") == ["2026-11-29", "09:52", "measured by hand"]
    assert run_log("experiments, run by hand (hours)") == []
    assert run_log("<!-- benchmarks:start -->\nMeasured 2026-11-25T09:08:06Z\n<!-- benchmarks:end -->") == []
    assert run_log("kafka-1:9092, 127.0.0.1:8000, 1920x1080, 1e-04") == []


def test_the_readme_and_the_performance_page_are_short_and_every_page_is_in_the_navigation():
    import yaml

    assert len((ROOT / "README.md").read_text().splitlines()) <= 120
    performance = (ROOT / "docs" / "performance.md").read_text()
    assert len(performance.splitlines()) <= 250
    assert performance.index("<!-- benchmarks:start -->") < performance.index("\n## ", performance.index("\n## ") + 1)

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)  # the config's !!python tags
    nav = str(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"])
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert not [p for p in pages if f"'{p}'" not in nav], "pages missing from mkdocs.yml's nav"
