"""Run every benchmark, write their JSON results, and update the results table in the README.

Each benchmark runs in its own process (clean memory and threads), one after another, with the same model
and MePo bundle. Without ``--mepo`` a Sigma_pre-only bundle is computed first (``mepo covariance`` on a few
pretraining images per class: the alignment's cost does not depend on the statistics' quality).

Usage:
    python -m benchmarks.run_all                      # DINOv2 ViT-S/14 @ 84 px, the full sizes (~15 min on 2 CPUs)
    python -m benchmarks.run_all --mepo runs/refined_dinov2_84
    python -m benchmarks.run_all --quick true --model test_vit --weights null --img_size 32  # smoke sizes
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.service import ROOT

START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
BENCHMARKS = ("learner_throughput", "predict_latency", "predict_throughput", "alignment_cost", "refine_throughput")


def _run(module: str, args: list[str]) -> None:
    print(f"== {module} {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


def sigma_bundle(model: str, weights: str | None, img_size: int, work: Path) -> Path:
    """A Sigma_pre-only bundle for the benchmark model (computed once, reused)."""
    path = work / f"sigma_pre_{model}_{img_size}"
    if not (path / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "mepo_stream.cli", "covariance", "--out", str(path),
                        "--backbone.name", model, "--backbone.weights", weights or "null",
                        "--backbone.img_size", str(img_size), "--cov.data.train_per_class", "5"],
                       check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return path


def _fmt(value: float, unit: str) -> str:
    return {"ms": f"{1000 * value:.1f} ms", "/s": f"{value:.1f}/s", "MB": f"{value / 2**20:.0f} MB"}[unit]


def table(results: dict[str, dict]) -> str:
    """The README table: one row per measured quantity, with its goal."""
    rows = []
    if learner := results.get("learner_throughput"):
        for name, what in (("learn_only", "learning only"), ("prequential", "with test-then-train prediction")):
            r = learner[name]
            rows.append((f"Learner throughput from Kafka, {what} (samples/s)", _fmt(r["service_samples_per_s"], "/s"),
                         _fmt(r["bare_samples_per_s"], "/s"), r["ratio"], "≥ 0.90", r["ratio"] >= 0.9))
        r = learner["prequential"]
        rows.append(("Learner memory (RSS) at 10% → 100% of the stream",
                     f"{_fmt(r['rss_bytes_at_10pct'], 'MB')} → {_fmt(r['rss_bytes_at_100pct'], 'MB')}", "–",
                     r["rss_growth"], "growth < 0.05", r["rss_growth"] < 0.05))
    if r := results.get("predict_latency"):
        for q, goal in (("p50", 1.3), ("p99", 3.0)):
            ratio = r[f"ratio_{q}"]
            rows.append((f"Predict latency {q}, one image while learning (bare: idle machine)",
                         _fmt(r["http"][f"{q}_s"], "ms"), _fmt(r["bare_forward_idle"][f"{q}_s"], "ms"), ratio,
                         f"≤ {goal}", ratio <= goal))
        for q in ("p50", "p99"):
            rows.append((f"Predict latency {q}, one image, learner idle", _fmt(r["http_idle"][f"{q}_s"], "ms"),
                         _fmt(r["bare_forward_idle"][f"{q}_s"], "ms"), r[f"ratio_idle_{q}"], "–", None))
    if r := results.get("predict_throughput"):
        rows.append((f"Predict throughput, {r['clients']} clients (images/s)", _fmt(r["service_images_per_s"], "/s"),
                     _fmt(r["bare_images_per_s"], "/s"), r["ratio"], "≥ 0.70", r["ratio"] >= 0.7))
    if r := results.get("alignment_cost"):
        rows.append(("Alignment (Cholesky + solve + blend) per training step", _fmt(r["alignment_s"], "ms"),
                     _fmt(r["step_s"], "ms") + " (step)", r["ratio"], "< 0.03", r["ratio"] < 0.03))
    if r := results.get("refine_throughput"):
        rows.append(("Refine throughput (images/s)", _fmt(r["refine_images_per_s"], "/s"),
                     _fmt(r["bare_images_per_s"], "/s"), r["ratio"], "–", None))
    lines = ["| measurement | mepo-stream | bare PyTorch reference | ratio | goal | met |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {ours} | {bare} | {ratio:.3f} | {goal} | {'–' if met is None else 'yes' if met else 'no'} |"
              for name, ours, bare, ratio, goal, met in rows]
    some = next(iter(results.values()))
    m = some.get("machine", {})
    times = sorted(r["measured_at"] for r in results.values() if "measured_at" in r)
    spec = some.get("spec", some)
    when = f"{times[0]} to {times[-1]}" if times else "?"
    machine_text = (f"{m.get('cpus', '?')} CPUs ({m.get('processor', '?')}, {m.get('device', '?')}, "
                    f"torch {m.get('torch', '?')}, {m.get('torch_threads', '?')} threads)")
    lines += ["", f"Measured {when} on {machine_text}, model {spec.get('model')} @ {spec.get('img_size')} px. "
              "Ratios are mepo-stream / reference (for memory: the growth)."]
    return "\n".join(lines)


def update_readme(readme: Path, text: str) -> None:
    """Replace what is between the benchmark markers."""
    content = readme.read_text()
    if START not in content or END not in content:
        raise ValueError(f"{readme} has no {START} ... {END} markers")
    head, rest = content.split(START, 1)
    readme.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END, 1)[1]}")


def main(mepo: Path | None = None, model: str = "vit_small_patch14_dinov2", weights: str | None = "dinov2",
         img_size: int = 84, quick: bool = False, only: str | None = None, results: Path = Path("benchmarks/results"),
         readme: Path | None = Path("README.md")) -> str:
    """Run all benchmarks, then rewrite the README's results table.

    Args:
        mepo: MePo bundle for the service benchmarks (null: compute a Sigma_pre-only bundle).
        model: timm ViT name.
        weights: Backbone weights (dinov2, a file, or null for a random init).
        img_size: Backbone resolution.
        quick: Tiny sizes (a smoke run that checks the scripts, not a measurement).
        only: Comma-separated subset of benchmarks to run; the table keeps the others' existing results.
        results: Folder of the JSON results.
        readme: README to update (null: only print the table).
    """
    selected = BENCHMARKS if only is None else tuple(b.strip() for b in only.split(","))
    if unknown := set(selected) - set(BENCHMARKS):
        raise ValueError(f"unknown benchmark(s) {sorted(unknown)}; choose from {', '.join(BENCHMARKS)}")
    work = results / "work"
    spec = ["--spec.model", model, "--spec.weights", weights or "null", "--spec.img_size", str(img_size)]
    spec += ["--spec.mepo", str(mepo or sigma_bundle(model, weights, img_size, work))]
    sizes = {
        "learner_throughput": ["--spec.train_per_class", "10" if quick else "100",
                               "--bare_batches", "2" if quick else "8"],
        "predict_latency": ["--spec.train_per_class", "10" if quick else "100", "--requests", "10" if quick else "300",
                            "--idle_requests", "10" if quick else "100"],
        "predict_throughput": ["--spec.train_per_class", "2" if quick else "10", "--seconds", "3" if quick else "30",
                               "--bare_seconds", "1" if quick else "10"],
        "alignment_cost": ["--repeats", "2" if quick else "10"],
    }
    for name in [b for b in BENCHMARKS[:-1] if b in selected]:
        _run(name, [*spec, *sizes[name], "--out", str(results / f"{name}.json"),
                    *(["--work", str(work / name)] if name != "alignment_cost" else [])])
    if "refine_throughput" in selected:
        _run("refine_throughput", ["--model", model, "--img_size", str(img_size), "--steps", "2" if quick else "10",
                                   "--rounds", "1" if quick else "3", "--out", str(results / "refine_throughput.json")])
    text = table({name: json.loads((results / f"{name}.json").read_text()) for name in BENCHMARKS
                  if (results / f"{name}.json").is_file()})
    if readme is not None:
        update_readme(readme, text)
    print(text)
    return text


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
