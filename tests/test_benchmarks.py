"""Benchmarks are not tests, but each script must keep running: smoke runs on tiny sizes, no timing asserts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run_all import END, START, update_readme

ROOT = Path(__file__).parents[1]
TINY = ["--model", "test_vit", "--weights", "null", "--img_size", "32"]


def _run(module: str, *args: str) -> None:
    subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)


def test_run_all_smoke_writes_every_result_and_the_readme_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{START}\nold table\n{END}\nafter\n")
    _run("run_all", "--quick", "true", *TINY, "--results", str(tmp_path / "results"), "--readme", str(readme))
    results = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "results").glob("*.json")}
    assert set(results) == {"learner_throughput", "predict_latency", "predict_throughput", "alignment_cost",
                            "refine_throughput"}
    assert all(r[key] > 0 for r in results.values() for key in r if key.startswith("ratio"))
    learner = results["learner_throughput"]
    assert learner["stream_samples"] == 100 and learner["learn_only"]["ratio"] > 0 < learner["prequential"]["ratio"]
    assert results["predict_throughput"]["answered"] > 0 and results["predict_throughput"]["failed"] == 0
    assert 0 < results["predict_latency"]["requests_while_learning"] <= 10
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\n\nbefore\n") and text.endswith(f"{END}\nafter\n")
    assert text.count("| ") > 7 and "Learner throughput" in text and "Alignment" in text


def test_readme_without_markers_is_a_clear_error(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        update_readme(readme, "table")


def test_serve_report_smoke(tmp_path):
    out = tmp_path / "serve.json"
    _run("serve_report", "--spec.train_per_class", "3", "--test_per_class", "2", "--spec.img_size", "32",
         "--spec.model", "test_vit", "--spec.weights", "null", "--bad_copies", "1", "--eval_period", "16",
         "--timeout", "300", "--work", str(tmp_path / "work"), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["samples_learned"] == 30 and report["dead_lettered"] == report["bad_records_injected"] == 5
