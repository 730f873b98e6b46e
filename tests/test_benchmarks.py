"""Benchmarks are not tests, but each script must keep running: a smoke run on tiny sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_refine_throughput_smoke(tmp_path):
    out = tmp_path / "refine.json"
    subprocess.run([sys.executable, "benchmarks/refine_throughput.py", "--model", "test_vit", "--img_size", "32",
                    "--batch_size", "8", "--steps", "2", "--rounds", "1", "--n_classes", "10", "--out", str(out)],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    result = json.loads(out.read_text())
    assert result["refine_images_per_s"] > 0 and result["bare_images_per_s"] > 0 and result["ratio"] > 0


def test_serve_report_smoke(tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run([sys.executable, "benchmarks/serve_report.py", "--train_per_class", "3", "--test_per_class", "2",
                    "--img_size", "32", "--model", "test_vit", "--weights", "null", "--bad_copies", "1",
                    "--eval_period", "16", "--timeout", "300", "--out", str(out)],
                   check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)
    report = json.loads(out.read_text())
    assert report["samples_learned"] == 30 and report["dead_lettered"] == report["bad_records_injected"] == 5
