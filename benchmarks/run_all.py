"""Run every benchmark, write their JSON results, and update the results table of docs/performance.md.

The benchmarks are the scripts of ``benchmarks/rows/``: each measures its results and turns a result into its rows of
the table (``table_rows``); this runs them and joins their rows (``ROWS``). Each runs in its own process (clean memory
and threads), one after another, with the same model and MePo bundle. Without ``--mepo`` a Sigma_pre-only bundle
is computed first (``mepo covariance`` on a few pretraining images per class: the alignment's cost does not depend
on the statistics' quality).

The CPU rows run with CUDA hidden, so they stay CPU rows wherever ``make bench`` runs. Where CUDA is present the
GPU rows follow (skipped with a note elsewhere): the service against the bare loop on the GPU at fp32 and at
bf16, predict latency while learning against the bare forward on the same GPU, the bare learner of ViT-B/16 at
224 px in bf16 with the paper's recipe, camera JPEGs decoded on the GPU against the CPU's scaled decode, and
ViT-B/16 learning a 1280x960 JPEG stream with its JPEGs decoded on the GPU and on the CPU. Every row says
where it was measured (device and dtype).

Usage:
    python -m benchmarks.run_all                      # DINOv2 ViT-S/14 @ 84 px, the full sizes (~15 min on 2 CPUs)
    python -m benchmarks.run_all --mepo runs/refined_dinov2_84
    python -m benchmarks.run_all --only gpu_learner_bf16,gpu_vit_b16    # some rows; the table keeps the others
    python -m benchmarks.run_all --only refine_frontier   # the long row (hours): docs/refine.md's frontier
    python -m benchmarks.run_all --quick true --model test_vit --weights null --img_size 32  # smoke sizes
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.experiments import refine_frontier
from benchmarks.rows import (
    alignment_cost,
    bare_learner,
    batch_invariance,
    camera_learner,
    corrections,
    corrections_service,
    decode,
    gpu_decode,
    label_join_memory,
    learner_throughput,
    learning_quality,
    model_arithmetic,
    novelty,
    novelty_cost,
    predict_latency,
    predict_throughput,
    predict_while_learning,
    protocol_latency,
    refine_throughput,
    replica_latency,
    scale_out,
)
from benchmarks.tools.service import ROOT, ServiceSpec, paper_recipe
from benchmarks.tools.table import Row
from mepo_stream.cli import config_options
from offline.covariance import CovarianceConfig

START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
BENCHMARKS = ("model_arithmetic", "learning_quality", "learning_quality_tinyimagenet", "learner_throughput",
              "predict_latency", "predict_throughput", "protocol_latency", "replica_latency", "alignment_cost",
              "refine_throughput", "scale_out", "label_join_memory", "corrections", "batch_invariance",
              "refine_frontier", "decode", "camera_learner", "predict_latency_camera", "learner_overhead",
              "corrections_service", "predict_while_learning", "novelty", "novelty_cost")
LONG_BENCHMARKS = ("refine_frontier",)
"""Rows of hours at the full sizes (a dozen refines and their evaluations): the smoke run runs them, the full run
only when ``--only`` names them (the table keeps their last result)."""
GPU_BENCHMARKS = ("gpu_learner_fp32", "gpu_learner_bf16", "gpu_predict_latency", "gpu_vit_b16", "gpu_decode",
                  "gpu_camera_learner", "gpu_camera_learner_cpu_decode")
ALL = (*BENCHMARKS, *GPU_BENCHMARKS)
GPU_LEARNER_CONFIGS = ("prequential", "paper_recipe")
"""The GPU learner rows' configurations: the service's default and the expensive one."""
GPU_STREAM_PER_CLASS = 1000
"""The GPU rows' stream, images per class (10,000 CIFAR-10 samples; the CPU rows' 100 a class): on an H100 the
default learner took 1,000 samples in half a second, too short a window to time (docs/performance.md, "On a GPU")."""
VIT_B16 = ("vit_base_patch16_224", 224)
"""The GPU throughput row's model and resolution (the paper's backbone)."""
FREE_MODEL = ("test_vit", 32)
"""The overhead row's nearly free model (a two-block ViT at 32 px): what the service itself costs per sample shows,
as it will beside a GPU model."""
OVERHEAD_PER_CLASS = 2000
"""The overhead row's stream, images per class (20,000 CIFAR-10 samples: a few seconds of learning to time)."""
OVERHEAD_BARE_BATCHES = 300
"""The overhead row's bare runs, mini-batches each (about 1.5 s of the nearly free model: 8 took 40 ms, too short a
run to time)."""
CAMERA_PER_CLASS = 300
"""The GPU camera rows' stream: 3,000 CIFAR-10 images upscaled to 1280x960 JPEGs
(``benchmarks.tools.camera_streams``)."""
CAMERA_CONFIGS = ("learn_only", "librdkafka_learn_only", "paper_recipe")
"""The GPU camera rows' configurations: the default learner read by each client, and the paper's recipe.
kafka-python reads camera-size records at about the rate a GPU learns them, in the interpreter the model thread
needs (docs/performance.md, "Camera JPEGs on a GPU"): each client beside it tells whether reading sets the pace."""


def _run(module: str, args: list[str], cuda: bool, fresh: bool = True) -> None:
    """One benchmark script with ``args``: in a fresh process (CUDA hidden unless ``cuda``), or, not ``fresh``,
    its ``main`` called in this process (the smoke run: the scripts' logic, without a process start each)."""
    print(f"== {module} {' '.join(args)}", flush=True)
    if not fresh:
        from jsonargparse import CLI

        CLI(importlib.import_module(f"benchmarks.{module}").main, as_positional=False, args=args)
        return
    hide = {} if cuda else {"CUDA_VISIBLE_DEVICES": ""}
    subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT), **hide})


SIGMA_DATA = CovarianceConfig().data.dataset
"""What a Sigma_pre-only bundle is computed from by default: ``mepo covariance``'s own reference set."""


def sigma_bundle(model: str, weights: str | None, img_size: int, work: Path, dataset: str = SIGMA_DATA) -> Path:
    """A Sigma_pre-only bundle for the benchmark model over five images a class of ``dataset`` (computed once,
    reused)."""
    path = work / f"sigma_pre_{model}_{img_size}_{Path(dataset).name}"
    if not (path / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "mepo_stream.cli", "covariance", "--out", str(path),
                        "--backbone.name", model, "--backbone.weights", weights or "null",
                        "--backbone.img_size", str(img_size), "--cov.data.dataset", dataset,
                        "--cov.data.train_per_class", "5"],
                       check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return path


def job(name: str, spec: ServiceSpec, quick: bool, work: Path, sigma_data: str = SIGMA_DATA
        ) -> tuple[str, list[str]]:
    """The script (its module in ``benchmarks``) and arguments of one result (its ``--out`` aside). The GPU rows
    are the CPU rows' scripts with the precision pinned, and the bare learner on ViT-B/16 (at the smoke sizes: on
    the spec's model; its Sigma_pre from ``sigma_data``)."""

    def n(small: int, full: int) -> str:
        return str(small if quick else full)

    def stream(s: ServiceSpec, small: int, full: int) -> list[str]:
        """The spec's arguments with ``small`` or ``full`` stream images per class."""
        return [*config_options(replace(s, train_per_class=small if quick else full), "--spec."),
                "--work", str(work / name)]

    def pinned(precision: str) -> ServiceSpec:
        return replace(spec, learner=replace(spec.learner, precision=precision))

    def vit_b16() -> ServiceSpec:
        model, size = VIT_B16
        s = spec if quick else replace(spec, model=model, weights=None, img_size=size,
                                       mepo=sigma_bundle(model, None, size, work, sigma_data))
        return paper_recipe(replace(s, learner=replace(s.learner, precision="bf16")))

    def camera(gpu_decode: bool) -> tuple[str, list[str]]:
        """ViT-B/16 in bf16 learning a 1280x960 JPEG stream, its JPEGs decoded on the GPU or on the CPU;
        one round each (the GPU's time is short), against its bare loop on tensors already on the device."""
        per_class = int(n(3, CAMERA_PER_CLASS))
        model, size = VIT_B16
        s = spec if quick else replace(spec, model=model, weights=None, img_size=size, mepo=None)
        s = replace(s, dataset="cifar10", learner=replace(s.learner, precision="bf16"),
                    extra=("--gpu_decode", str(gpu_decode).lower()))
        return "rows.learner_throughput", [*stream(s, per_class, per_class), "--camera", "1280x960", "--configs",
                                           json.dumps(["learn_only"] if quick else list(CAMERA_CONFIGS)),
                                           "--bare_batches", n(2, 8), "--rounds", "1"]

    def learner(s: ServiceSpec, *configs: str, full: int = 100, bare_batches: int = 8) -> tuple[str, list[str]]:
        if quick:  # one service run (its first configuration): the others differ only in the spec, which
            # tests/test_benchmarks.py checks in-process against a stand-in service (each one's bare loop runs)
            configs = configs[:1] or ("prequential",)
        chosen = ["--configs", json.dumps(configs)] if configs else []
        return "rows.learner_throughput", [*stream(s, 10, full), "--bare_batches", n(2, bare_batches),
                                           "--rounds", n(1, 5), *chosen]

    def quality(s: ServiceSpec, train: int, test: int) -> tuple[str, list[str]]:
        """The default learner over seeds 1-3 (one at the smoke sizes): the README's headline table."""
        return "rows.learning_quality", [*config_options(replace(s, train_per_class=int(n(10, train))), "--spec."),
                                         "--test_per_class", n(5, test), "--seeds", f"1-{n(1, 3)}",
                                         "--eval_period", n(50, 250), "--work", str(work / name)]

    def latency(full: int = 100) -> tuple[str, list[str]]:
        return "rows.predict_latency", [*stream(spec, 10, full), "--requests", n(10, 300),
                                        "--idle_requests", n(10, 100)]

    jobs: dict[str, Callable[[], tuple[str, list[str]]]] = {  # called for the one result asked for only
        "learning_quality": lambda: quality(spec, 100, 50),
        "learning_quality_tinyimagenet": lambda: quality(  # at the smoke sizes, the spec's small dataset
            spec if quick else replace(spec, dataset="tinyimagenet-downstream"), 25, 10),
        "model_arithmetic": lambda: ("rows.model_arithmetic", [*config_options(spec, "--spec."),
                                                               "--repeats", n(2, 20),
                                                               "--compiled", str(not quick).lower()]),
        "learner_throughput": lambda: learner(spec),
        "learner_overhead": lambda: learner(replace(spec, model=FREE_MODEL[0], weights=None, img_size=FREE_MODEL[1],
                                                    mepo=None), "learn_only", "prequential", "librdkafka_learn_only",
                                            full=OVERHEAD_PER_CLASS,
                                            bare_batches=OVERHEAD_BARE_BATCHES),
        "predict_latency": latency,
        "predict_while_learning": lambda: ("rows.predict_while_learning", [
            *config_options(replace(spec, train_per_class=int(n(10, 100))), "--spec."), "--batches", n(4, 30),
            "--rounds", n(1, 5), "--bare_repeats", n(10, 50)]),
        "predict_throughput": lambda: ("rows.predict_throughput", [*stream(spec, 2, 10), "--seconds", n(3, 30),
                                                                   "--bare_seconds", n(1, 10)]),
        "protocol_latency": lambda: ("rows.protocol_latency", [*stream(spec, 2, 10), "--requests", n(10, 100),
                                                               "--flood_clients", n(0, 16)]),
        "replica_latency": lambda: ("rows.replica_latency", [*stream(spec, 20, 300), "--bare_repeats", n(20, 100)]),
        "alignment_cost": lambda: ("rows.alignment_cost", [*config_options(paper_recipe(spec), "--spec."),
                                                           "--repeats", n(2, 10)]),
        "refine_throughput": lambda: ("rows.refine_throughput", ["--model", spec.model,
                                                                 "--img_size", str(spec.img_size),
                                                                 "--steps", n(2, 10), "--rounds", n(1, 3)]),
        "scale_out": lambda: ("rows.scale_out", [*stream(replace(spec, mepo=None), 200, 100),
                                                 "--min_seconds", n(0, 30),
                                                 "--test_per_class", n(5, 100)]),
        "label_join_memory": lambda: ("rows.label_join_memory", [
            "--feature_model", spec.model, "--img_size", str(spec.img_size), "--n", n(200, 5000),
            "--max_images", n(50, 2000), "--sample_every", n(50, 1000), "--delay_min", n(10, 50),
            "--delay_max", n(40, 200)]),
        "corrections": lambda: ("rows.corrections", [
            "--feature_model", spec.model, "--img_size", str(spec.img_size), "--n", n(400, 5000),
            *(["--long_img_size", str(spec.img_size)] if quick else []),  # full: one patch of ViT-S/14 per image
            "--long", n(2000, 100_000), "--sample_every", n(200, 1000)]),
        "corrections_service": lambda: ("rows.corrections_service", [*stream(replace(spec, mepo=None), 4, 300),
                                                                     "--tombstones", n(5, 50)]),
        "refine_frontier": lambda: ("experiments.refine_frontier", [
            "--model", spec.model, "--weights", spec.weights or "null", "--img_size", str(spec.img_size),
            *(["--quick", "true", "--arms", "finetune", "--budgets", "1", "--runs", str(work / name), "--page", "null",
               "--image", str(work / name / "refine_frontier.png")] if quick else [])]),  # full: runs/frontier
        "decode": lambda: ("rows.decode", ["--size", str(spec.img_size), "--images", n(4, 40), "--rounds", n(1, 5),
                                           "--dataset", spec.dataset if quick else "tinyimagenet-downstream"]),
        "predict_latency_camera": lambda: ("rows.predict_latency", [*stream(spec, 10, 20), "--requests", n(5, 50),
                                                                    "--idle_requests", n(10, 100),
                                                                    "--camera", "1920x1080"]),
        "camera_learner": lambda: ("rows.camera_learner", [
            *config_options(spec, "--spec."), "--images_per_class", n(3, 50), "--rounds", n(1, 5),
            "--bare_batches", n(2, 8), "--source", spec.dataset if quick else "tinyimagenet-downstream",
            "--work", str(work / name)]),
        "batch_invariance": lambda: ("rows.batch_invariance", [*config_options(spec, "--spec."), "--batches", n(1, 10),
                                                               "--rounds", n(1, 5), "--repeats", n(3, 30)]),
        "novelty": lambda: ("rows.novelty", [  # the demo's bundle (make runs/demo/refined/manifest.json)
            *config_options(spec if quick else replace(spec, mepo=Path("runs/demo/refined")), "--spec."),
            "--work", str(work / name), *(["--train_per_class", "[10, 5]", "--test_per_class", "[5, 2]",
                                           "--eval_period", "50"] if quick else [])]),
        "novelty_cost": lambda: ("rows.novelty_cost", [*config_options(spec, "--spec."), "--rounds", n(1, 7),
                                                       "--repeats", n(5, 50)]),
        "gpu_learner_fp32": lambda: learner(pinned("fp32"), *GPU_LEARNER_CONFIGS, full=GPU_STREAM_PER_CLASS),
        "gpu_learner_bf16": lambda: learner(pinned("bf16"), *GPU_LEARNER_CONFIGS, full=GPU_STREAM_PER_CLASS),
        "gpu_predict_latency": lambda: latency(GPU_STREAM_PER_CLASS),
        "gpu_vit_b16": lambda: ("rows.bare_learner", [*config_options(vit_b16(), "--spec."), "--batches", n(2, 20)]),
        "gpu_decode": lambda: ("rows.gpu_decode", ["--images", n(4, 256), "--rounds", n(1, 3),
                                                   "--sizes", json.dumps([spec.img_size] if quick else [84, 224])]),
        "gpu_camera_learner": lambda: camera(gpu_decode=True),
        "gpu_camera_learner_cpu_decode": lambda: camera(gpu_decode=False),
    }
    return jobs[name]()


ROWS: dict[str, Callable[[dict], list[Row]]] = {
    "model_arithmetic": model_arithmetic.table_rows, "learning_quality": learning_quality.table_rows,
    "learning_quality_tinyimagenet": learning_quality.table_rows, "learner_throughput": learner_throughput.table_rows,
    "predict_latency": predict_latency.table_rows, "protocol_latency": protocol_latency.table_rows,
    "predict_while_learning": predict_while_learning.table_rows,
    "predict_throughput": predict_throughput.table_rows, "replica_latency": replica_latency.table_rows,
    "alignment_cost": alignment_cost.table_rows, "refine_throughput": refine_throughput.table_rows,
    "scale_out": scale_out.table_rows, "label_join_memory": label_join_memory.table_rows,
    "corrections": corrections.table_rows, "batch_invariance": batch_invariance.table_rows,
    "corrections_service": corrections_service.table_rows,
    "novelty": novelty.table_rows, "novelty_cost": novelty_cost.table_rows,
    "refine_frontier": refine_frontier.table_rows,
    "decode": decode.table_rows, "camera_learner": camera_learner.table_rows,
    "predict_latency_camera": predict_latency.camera_rows,
    "learner_overhead": learner_throughput.overhead_rows, "gpu_learner_fp32": learner_throughput.table_rows,
    "gpu_learner_bf16": learner_throughput.table_rows, "gpu_predict_latency": predict_latency.table_rows,
    "gpu_vit_b16": bare_learner.table_rows, "gpu_decode": gpu_decode.table_rows,
    "gpu_camera_learner": lambda r: learner_throughput.camera_rows(r, "decoded on the GPU"),
    "gpu_camera_learner_cpu_decode": lambda r: learner_throughput.camera_rows(
        r, "decoded on the CPU (measured with the decode pool, since removed)"),
}
"""Each result's rows in the table, in the table's order: each formatted by the script that measures it."""


def _machine_text(m: dict) -> str:
    """The device and the software around it."""
    facts = [f"{m['cpus']} CPUs", f"{m['torch_threads']} torch threads", f"torch {m['torch']}",
             f"CUDA {m['cuda']}" if m["device"] == "cuda" else None]
    return f"{m['device_name']} ({', '.join(f for f in facts if f)})"


def table(results: dict[str, dict]) -> str:
    """The results table: each result's rows (from the script that measured it), with where it was measured."""
    lines = ["| measurement | mepo-stream | bare PyTorch reference | ratio | goal | met | measured on |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in ROWS.items():
        if name in results:
            machine = results[name]["machine"]
            where = f"{machine['device_name']}, {machine['dtype']}"
            lines += [f"| {what} | {ours} | {bare} | {'–' if ratio is None else f'{ratio:.3f}'} | {goal} | "
                      f"{'–' if met is None else 'yes' if met else 'no'} | {where} |"
                      for what, ours, bare, ratio, goal, met in rows(results[name])]
    if not results:
        return "No rows measured."
    some = next(iter(results.values()))
    times = sorted(r["measured_at"] for r in results.values())
    machines = sorted({_machine_text(r["machine"]) for r in results.values()})
    spec = some.get("spec", some)  # some results name their model at the top (refine_throughput), some none
    lines += ["", f"Measured {times[0]} to {times[-1]} on {'; '.join(machines)}, model {spec.get('model')} @ "
              f"{spec.get('img_size')} px unless the row names another. Ratios are mepo-stream / reference (for "
              "memory: the growth)."]
    if not any(name in results for name in GPU_BENCHMARKS):
        lines.append("GPU rows: not measured (`make bench` adds them on a machine with CUDA).")
    return "\n".join(lines)


def update_page(page: Path, text: str) -> None:
    """Replace what is between the benchmark markers."""
    content = page.read_text()
    if START not in content or END not in content:
        raise ValueError(f"{page} has no {START} ... {END} markers")
    head, rest = content.split(START, 1)
    page.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END, 1)[1]}")


def main(mepo: Path | None = None, model: str = "vit_small_patch14_dinov2", weights: str | None = "dinov2",
         img_size: int = 84, quick: bool = False, only: str | None = None, gpu: bool | None = None,
         results: Path = Path("benchmarks/results"), page: Path | None = Path("docs/performance.md"),
         fresh_processes: bool = True, sigma_data: str = SIGMA_DATA) -> str:
    """Run all benchmarks, then rewrite the results table of the docs' performance page.

    Args:
        mepo: MePo bundle for the service benchmarks (null: compute a Sigma_pre-only bundle).
        model: timm ViT name.
        weights: Backbone weights (dinov2, a file, or null for a random init).
        img_size: Backbone resolution.
        quick: Tiny sizes (a smoke run that checks the scripts, not a measurement).
        only: Comma-separated subset of benchmarks to run; the table keeps the others' existing results.
        gpu: Run the GPU rows (null: when CUDA is present; true also runs them without CUDA, on the CPU, as the
            smoke test does).
        results: Folder of the JSON results.
        page: The page whose table to update (null: only print the table).
        fresh_processes: Run each benchmark in a process of its own (clean memory and threads; CUDA hidden from
            the CPU rows). false: call each one in this process, for a smoke run of the scripts at ``--quick``
            sizes, where process starts would take most of the time (the services still run as processes).
        sigma_data: The dataset a Sigma_pre-only bundle is computed from (without ``--mepo``, and for the ViT-B/16
            row): the pretraining images by default; ``cifar10`` on a machine that has only CIFAR-10, such as a
            lent GPU with ``gpu-pack``'s subset (the rows time the alignment, whose cost does not depend on the
            statistics).
    """
    selected = ALL if only is None else tuple(b.strip() for b in only.split(","))
    if unknown := set(selected) - set(ALL):
        raise ValueError(f"unknown benchmark(s) {sorted(unknown)}; choose from {', '.join(ALL)}")
    run_gpu = torch.cuda.is_available() if gpu is None else gpu
    if skipped := [] if run_gpu else [b for b in selected if b in GPU_BENCHMARKS]:
        why = "CUDA is not available here" if gpu is None else "--gpu false"
        print(f"== GPU rows skipped ({why}): {', '.join(skipped)}", flush=True)
    if long := [] if quick or only is not None else [b for b in selected if b in LONG_BENCHMARKS]:
        print(f"== long rows skipped (hours; --only {','.join(long)} runs them): {', '.join(long)}", flush=True)
        skipped = [*skipped, *long]
    work = results / "work"
    spec = ServiceSpec(model=model, weights=weights, img_size=img_size,
                       mepo=mepo or sigma_bundle(model, weights, img_size, work, sigma_data))
    for name in [b for b in ALL if b in selected and b not in skipped]:
        module, args = job(name, spec, quick, work, sigma_data)
        _run(module, [*args, "--out", str(results / f"{name}.json")], cuda=name in GPU_BENCHMARKS,
             fresh=fresh_processes)
    text = table({name: json.loads((results / f"{name}.json").read_text()) for name in ROWS
                  if (results / f"{name}.json").is_file()})
    if page is not None:
        update_page(page, text)
    print(text)
    return text


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
