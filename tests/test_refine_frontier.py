"""The refine frontier (``benchmarks/experiments/refine_frontier.py``): its smoke run end to end on test_vit (refines,
both streams' evaluations, the result, the table between the page's markers, the plot), and its page handling."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.experiments.refine_frontier import (
    ARMS,
    BEGIN,
    END,
    STREAMS,
    Arm,
    parse_budgets,
    plan,
    table,
    update_page,
)
from mepo_stream.cli import parse
from tests.helpers import mepo_commands

ROOT = Path(__file__).parents[1]


@pytest.mark.timeout(300)
def test_quick_frontier_writes_every_point_the_table_and_the_plot(tmp_path):
    page, image, out = tmp_path / "docs" / "refine.md", tmp_path / "docs" / "img" / "frontier.png", tmp_path / "f.json"
    page.parent.mkdir()
    page.write_text(f"# Refine\n\nintro\n\n{BEGIN}\nold table\n{END}\n\nafter\n")
    args = [sys.executable, "-m", "benchmarks.experiments.refine_frontier", "--quick", "true", "--arms", "cosine",
            "--budgets", "1", "--model", "test_vit", "--weights", "null", "--img_size", "32", "--runs",
            str(tmp_path / "runs"), "--out", str(out), "--page", str(page), "--image", str(image)]
    subprocess.run(args, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    result = json.loads(out.read_text())
    points = {(p["arm"], p["budget"]): p for p in result["points"]}
    assert set(points) == {("untouched", 0), ("cosine", 1)}  # every arm at every budget, and the untouched
    assert result["quick"] and result["seeds"] == "1" and result["machine"]["device_name"]
    for (arm, k), p in points.items():
        refine = p["refine"]
        if k:
            assert refine["minutes"] > 0 and refine["images_per_s"] > 0 and refine["meta_epochs"] == k
            assert refine["precision"] in {"float32", "bfloat16"} and (tmp_path / "runs" / f"{arm}-{k}").is_dir()
            assert refine["command"].startswith("mepo refine") and "--cov.skip true" in refine["command"]
        for s in STREAMS:
            e = p[s]
            assert all(0 <= e[key] <= 1 for key in ("a_last", "a_auc", "probe", "lda", "best_offline_head"))
            assert e["seeds"] == [1] and math.isfinite(e["a_last_std"]) and e["stream_samples"] > 0
            assert ("--mepo_rep" in e["command"]) == (k > 0)
    assert points[("cosine", 1)]["refine"]["mode"] == "finetune"
    assert "--preset best --loop.head cosine" in points[("cosine", 1)]["refine"]["command"]
    assert "--data.dataset cifar10" in points[("untouched", 0)]["C"]["command"]
    text = page.read_text()
    assert "old table" not in text and text.startswith("# Refine\n\nintro\n\n") and text.endswith(f"{END}\n\nafter\n")
    rows = [line for line in text.split(BEGIN)[1].splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + len(points) and all(line.count(" | ") == 8 for line in rows)
    assert "![Refine frontier](img/frontier.png)" in text
    commands = mepo_commands(text)  # each point's refine, as the docs test parses every command of a page
    assert [c[:3] for c in commands] == [["refine", "--preset", "best"]]
    assert all(parse(c).subcommand == "refine" for c in commands)
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plan_and_the_budgets():
    assert plan({n: ARMS[n] for n in ("finetune", "old_demo")}, [1, 2, 4]) == [
        ("finetune", 1), ("finetune", 2), ("finetune", 4), ("old_demo", 1)]
    assert plan({"x": Arm(("--preset", "best"), "x")}, parse_budgets("8,2")) == [("x", 2), ("x", 8)]
    with pytest.raises(ValueError):
        parse_budgets("0,1")


def test_refines_of_one_recipe_with_other_seeds_are_pooled_in_the_table():
    """Arms ``X_seedN`` join ``X`` at the same budget in a second table (mean ± std over the refines); a budget
    with one refine gets no pooled row."""
    def point(arm: str, k: int, a: float) -> dict:
        refine = {"minutes": 2.0, "cpus": 2, "images_per_s": 100.0, "precision": "bfloat16", "command": "mepo refine"}
        return {"arm": arm, "budget": k, "refine": refine,
                "T": {"a_last": a, "a_last_std": 0.0, "probe": a - 0.1, "lda": a, "seeds": [1]}}

    result = {"streams": {"T": "t"}, "spec": {"model": "m", "img_size": 84}, "arms": {}, "command": "c",
              "points": [point("a", 2, 0.5), point("a_seed2", 2, 0.7), point("a", 4, 0.6)]}
    text = table(result)
    assert "| a | 2 | a, a_seed2 | 2.0 | 60.00 ± 14.14 | 50.00 / 60.00 |" in text
    assert "| a | 4 | a |" not in text


def test_the_page_gets_its_markers(tmp_path):
    missing, bare = tmp_path / "new.md", tmp_path / "bare.md"
    update_page(missing, "| t |", None)
    assert missing.read_text() == f"# Refine\n\n{BEGIN}\n| t |\n{END}\n"
    bare.write_text("# Page\n\ntext\n")
    update_page(bare, "| t |", "x.png")
    update_page(bare, "| u |", None)  # a second run replaces the first
    text = bare.read_text()
    assert text.startswith("# Page\n\ntext\n\n## The measured frontier") and "| t |" not in text
    assert text.count(BEGIN) == 1 and "| u |" in text and "x.png" not in text


def test_the_docs_page_has_the_markers():
    text = (ROOT / "docs" / "refine.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)


@pytest.mark.parametrize("quick, only, runs", [(False, None, False), (True, None, True),
                                                (False, "refine_frontier", True)])
def test_run_all_runs_the_long_row_at_smoke_sizes_or_when_named(monkeypatch, tmp_path, quick, only, runs):
    """The full ``make bench`` skips the frontier (hours); the smoke run and ``--only refine_frontier`` run it."""
    from benchmarks import run_all

    ran: list[list[str]] = []
    monkeypatch.setattr(run_all, "_run", lambda module, args, cuda, fresh=True: ran.append([module, *args]))
    monkeypatch.setattr(run_all, "sigma_bundle", lambda *a: tmp_path / "sigma")
    monkeypatch.setattr(run_all, "table", lambda results: "")
    run_all.main(quick=quick, only=only, gpu=False, results=tmp_path, page=None)
    frontier = [args for args in ran if args[0] == "experiments.refine_frontier"]
    assert len(frontier) == runs
    if frontier:
        assert ("--quick" in frontier[0]) == quick and ("--page" in frontier[0]) == quick  # smoke: no docs written
