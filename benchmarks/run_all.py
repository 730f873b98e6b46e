"""Run every benchmark, write their JSON results, and update the results table of docs/performance.md.

Each benchmark runs in its own process (clean memory and threads), one after another, with the same model
and MePo bundle. Without ``--mepo`` a Sigma_pre-only bundle is computed first (``mepo covariance`` on a few
pretraining images per class: the alignment's cost does not depend on the statistics' quality).

The CPU rows run with CUDA hidden, so they stay CPU rows wherever ``make bench`` runs. Where CUDA is present the
GPU rows follow (skipped with a note elsewhere): the service against the bare loop on the GPU at fp32 and at
bf16, predict latency while learning against the bare forward on the same GPU, the bare learner of ViT-B/16 at
224 px in bf16 with the paper's recipe, camera JPEGs decoded on the GPU against the CPU's scaled decode, and
ViT-B/16 learning a 1280x960 JPEG stream with its JPEGs decoded on the GPU and by the decode pool. Every row says
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
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.camera_streams import camera_folder
from benchmarks.service import ROOT, ServiceSpec, paper_recipe
from mepo_stream.cli import config_options
from mepo_stream.data import DataConfig

START, END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"
BENCHMARKS = ("model_arithmetic", "learning_quality", "learning_quality_tinyimagenet", "learner_throughput",
              "predict_latency", "predict_throughput", "protocol_latency", "replica_latency", "alignment_cost",
              "refine_throughput", "scale_out", "label_join_memory", "corrections", "batch_invariance",
              "refine_frontier", "decode", "camera_learner", "predict_latency_camera", "learner_overhead",
              "corrections_service")
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
"""The GPU camera rows' stream: 3,000 CIFAR-10 images upscaled to 1280x960 JPEGs (``benchmarks.camera_streams``)."""
Row = tuple[str, str, str, float | None, str, bool | None]  # measurement, ours, bare, ratio, goal, met


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


def sigma_bundle(model: str, weights: str | None, img_size: int, work: Path) -> Path:
    """A Sigma_pre-only bundle for the benchmark model (computed once, reused)."""
    path = work / f"sigma_pre_{model}_{img_size}"
    if not (path / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "mepo_stream.cli", "covariance", "--out", str(path),
                        "--backbone.name", model, "--backbone.weights", weights or "null",
                        "--backbone.img_size", str(img_size), "--cov.data.train_per_class", "5"],
                       check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return path


def job(name: str, spec: ServiceSpec, quick: bool, work: Path) -> tuple[str, list[str]]:
    """The script and arguments of one result (its ``--out`` aside). The GPU rows are the CPU rows' scripts with
    the precision pinned, and the bare learner on ViT-B/16 (at the smoke sizes: on the spec's model)."""

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
                                       mepo=sigma_bundle(model, None, size, work))
        return paper_recipe(replace(s, learner=replace(s.learner, precision="bf16")))

    def camera(gpu_decode: bool) -> tuple[str, list[str]]:
        """ViT-B/16 in bf16 learning a 1280x960 JPEG stream, its JPEGs decoded on the GPU or by the decode pool;
        one round each (the GPU's time is short), against its bare loop on tensors already on the device."""
        per_class = int(n(3, CAMERA_PER_CLASS))
        folder = camera_folder(DataConfig(dataset="cifar10", train_per_class=per_class, test_per_class=5), 1280, 960)
        model, size = VIT_B16
        s = spec if quick else replace(spec, model=model, weights=None, img_size=size, mepo=None)
        s = replace(s, dataset=str(folder), learner=replace(s.learner, precision="bf16"),
                    extra=("--gpu_decode", str(gpu_decode).lower()))
        return "learner_throughput", [*stream(s, per_class, per_class), "--configs",
                                      json.dumps(["learn_only"] if quick else ["learn_only", "paper_recipe"]),
                                      "--bare_batches", n(2, 8), "--rounds", "1"]

    def learner(s: ServiceSpec, *configs: str, full: int = 100, bare_batches: int = 8) -> tuple[str, list[str]]:
        if quick:  # one service run (its first configuration): the others differ only in the spec, which
            # tests/test_benchmarks.py checks in-process against a stand-in service (each one's bare loop runs)
            configs = configs[:1] or ("prequential",)
        chosen = ["--configs", json.dumps(configs)] if configs else []
        return "learner_throughput", [*stream(s, 10, full), "--bare_batches", n(2, bare_batches), "--rounds", n(1, 3),
                                      *chosen]

    def quality(s: ServiceSpec, train: int, test: int) -> tuple[str, list[str]]:
        """The default learner over seeds 1-3 (one at the smoke sizes): the README's headline table."""
        return "learning_quality", [*config_options(replace(s, train_per_class=int(n(10, train))), "--spec."),
                                    "--test_per_class", n(5, test), "--seeds", f"1-{n(1, 3)}",
                                    "--eval_period", n(50, 250), "--work", str(work / name)]

    def latency(full: int = 100) -> tuple[str, list[str]]:
        return "predict_latency", [*stream(spec, 10, full), "--requests", n(10, 300), "--idle_requests", n(10, 100)]

    jobs: dict[str, Callable[[], tuple[str, list[str]]]] = {  # called for the one result asked for only
        "learning_quality": lambda: quality(spec, 100, 50),
        "learning_quality_tinyimagenet": lambda: quality(  # at the smoke sizes, the spec's small dataset
            spec if quick else replace(spec, dataset="tinyimagenet-downstream"), 25, 10),
        "model_arithmetic": lambda: ("model_arithmetic", [*config_options(spec, "--spec."), "--repeats", n(2, 20),
                                                     "--compiled", str(not quick).lower()]),
        "learner_throughput": lambda: learner(spec),
        "learner_overhead": lambda: learner(replace(spec, model=FREE_MODEL[0], weights=None, img_size=FREE_MODEL[1],
                                                    mepo=None), "learn_only", "prequential", full=OVERHEAD_PER_CLASS,
                                            bare_batches=OVERHEAD_BARE_BATCHES),
        "predict_latency": latency,
        "predict_throughput": lambda: ("predict_throughput", [*stream(spec, 2, 10), "--seconds", n(3, 30),
                                                              "--bare_seconds", n(1, 10)]),
        "protocol_latency": lambda: ("protocol_latency", [*stream(spec, 2, 10), "--requests", n(10, 100),
                                                          "--flood_clients", n(0, 16)]),
        "replica_latency": lambda: ("replica_latency", [*stream(spec, 20, 300), "--bare_repeats", n(20, 100)]),
        "alignment_cost": lambda: ("alignment_cost", [*config_options(paper_recipe(spec), "--spec."),
                                                      "--repeats", n(2, 10)]),
        "refine_throughput": lambda: ("refine_throughput", ["--model", spec.model, "--img_size", str(spec.img_size),
                                                            "--steps", n(2, 10), "--rounds", n(1, 3)]),
        "scale_out": lambda: ("scale_out", [*stream(replace(spec, mepo=None), 200, 100),
                                            "--min_seconds", n(0, 30),
                                            "--test_per_class", n(5, 100)]),
        "label_join_memory": lambda: ("label_join_memory", [
            "--feature_model", spec.model, "--img_size", str(spec.img_size), "--n", n(200, 5000),
            "--max_images", n(50, 2000), "--sample_every", n(50, 1000), "--delay_min", n(10, 50),
            "--delay_max", n(40, 200)]),
        "corrections": lambda: ("corrections", [
            "--feature_model", spec.model, "--img_size", str(spec.img_size), "--n", n(400, 5000),
            *(["--long_img_size", str(spec.img_size)] if quick else []),  # full: one patch of ViT-S/14 per image
            "--long", n(2000, 100_000), "--sample_every", n(200, 1000)]),
        "corrections_service": lambda: ("corrections_service", [*stream(replace(spec, mepo=None), 4, 300),
                                                                "--tombstones", n(5, 50)]),
        "refine_frontier": lambda: ("refine_frontier", [
            "--model", spec.model, "--weights", spec.weights or "null", "--img_size", str(spec.img_size),
            *(["--quick", "true", "--arms", "finetune", "--budgets", "1", "--runs", str(work / name), "--page", "null",
               "--image", str(work / name / "refine_frontier.png")] if quick else [])]),  # full: runs/frontier
        "decode": lambda: ("decode", ["--size", str(spec.img_size), "--images", n(4, 40), "--rounds", n(1, 5),
                                      "--dataset", spec.dataset if quick else "tinyimagenet-downstream"]),
        "predict_latency_camera": lambda: ("predict_latency", [*stream(spec, 10, 20), "--requests", n(5, 50),
                                                               "--idle_requests", n(10, 100), "--camera", "1920x1080"]),
        "camera_learner": lambda: ("camera_learner", [
            *config_options(spec, "--spec."), "--images_per_class", n(3, 50), "--rounds", n(1, 3),
            "--bare_batches", n(2, 8), "--source", spec.dataset if quick else "tinyimagenet-downstream",
            "--work", str(work / name)]),
        "batch_invariance": lambda: ("batch_invariance", [*config_options(spec, "--spec."), "--batches", n(1, 10),
                                                          "--rounds", n(1, 5), "--repeats", n(3, 30)]),
        "gpu_learner_fp32": lambda: learner(pinned("fp32"), *GPU_LEARNER_CONFIGS, full=GPU_STREAM_PER_CLASS),
        "gpu_learner_bf16": lambda: learner(pinned("bf16"), *GPU_LEARNER_CONFIGS, full=GPU_STREAM_PER_CLASS),
        "gpu_predict_latency": lambda: latency(GPU_STREAM_PER_CLASS),
        "gpu_vit_b16": lambda: ("bare_learner", [*config_options(vit_b16(), "--spec."), "--batches", n(2, 20)]),
        "gpu_decode": lambda: ("gpu_decode", ["--images", n(4, 256), "--rounds", n(1, 3),
                                              "--sizes", json.dumps([spec.img_size] if quick else [84, 224])]),
        "gpu_camera_learner": lambda: camera(gpu_decode=True),
        "gpu_camera_learner_cpu_decode": lambda: camera(gpu_decode=False),
    }
    return jobs[name]()


def _fmt(value: float, unit: str) -> str:
    return {"ms": f"{1000 * value:.1f} ms", "/s": f"{value:.1f}/s", "MB": f"{value / 2**20:.0f} MB"}[unit]


def _learner_rows(r: dict) -> list[Row]:
    rows: list[Row] = []
    for name in ("learn_only", "prequential", "paper_recipe", "int8_learn_only"):
        if c := r.get(name):  # results from before a configuration existed lack it (and its method, classifier)
            config = f"{c.get('method', r['spec']['method'])} + {c.get('classifier', 'linear')}"
            recipe = {"paper_recipe": " (the paper's recipe)", "int8_learn_only": ", int8 backbone"}.get(name, "")
            what = "with test-then-train prediction" if c.get("prequential", name == "prequential") else \
                "learning only"
            dtype = "int8" if name == "int8_learn_only" else r.get("machine", {}).get("dtype", "float32")
            rows.append((f"Learner throughput from Kafka, {config}{recipe}, {what} (samples/s{_spread(c)})",
                         _fmt(c["service_samples_per_s"], "/s"),
                         f"{_fmt(c['bare_samples_per_s'], '/s')} (its loop, {dtype})", c["ratio"], "≥ 0.90",
                         c["ratio"] >= 0.9))
    if c := r.get("prequential"):
        rows.append(("Learner memory (RSS) at 10% → 100% of the stream",
                     f"{_fmt(c['rss_bytes_at_10pct'], 'MB')} → {_fmt(c['rss_bytes_at_100pct'], 'MB')}", "–",
                     c["rss_growth"], "growth < 0.05", c["rss_growth"] < 0.05))
    return rows


def _overhead_rows(r: dict) -> list[Row]:
    """The learner rows of the nearly free model, whose goal is lower: the per-sample work of a Python service
    (Kafka's record parsing, the claims) is most of what it does."""
    what = f"nearly free model ({r['spec']['model']} @ {r['spec']['img_size']} px)"
    return [(text.replace("Learner throughput from Kafka", f"Learner throughput from Kafka, {what}"), ours, bare,
             ratio, "≥ 0.70", ratio is not None and ratio >= 0.7)
            for text, ours, bare, ratio, _, _ in _learner_rows(r) if not text.startswith("Learner memory")]


def _spread(c: dict) -> str:
    """How far a throughput's rounds went (nothing for one round).

    Example:
        >>> _spread({"rounds": [{}, {}, {}], "ratio_range": [0.861, 0.97]})
        '; median of 3 rounds, ratios 0.86–0.97'
    """
    if len(rounds := c.get("rounds", [])) < 2:
        return ""
    low, high = c["ratio_range"]
    return f"; median of {len(rounds)} rounds, ratios {low:.2f}–{high:.2f}"


def _latency_rows(r: dict) -> list[Row]:
    rows: list[Row] = []
    for q, goal in (("p50", 1.3), ("p99", 3.0)):
        ratio = r[f"ratio_{q}"]
        rows.append((f"Predict latency {q}, one image while learning (bare: idle device)",
                     _fmt(r["http"][f"{q}_s"], "ms"), _fmt(r["bare_forward_idle"][f"{q}_s"], "ms"), ratio,
                     f"≤ {goal}", ratio <= goal))
    for q in ("p50", "p99"):
        rows.append((f"Predict latency {q}, one image, learner idle", _fmt(r["http_idle"][f"{q}_s"], "ms"),
                     _fmt(r["bare_forward_idle"][f"{q}_s"], "ms"), r[f"ratio_idle_{q}"], "–", None))
    if "http_idle_raw_client" in r:  # results from before both clients were timed lack it
        floor = _fmt(r["backbone_forward_idle"]["p50_s"], "ms")
        ratio = r["ratio_idle_p50_backbone"]
        rows.append(("Predict latency p50, one image, learner idle, stdlib client (bare: the backbone's own forward)",
                     _fmt(r["http_idle_raw_client"]["p50_s"], "ms"), floor, ratio, "≤ 1.3", ratio <= 1.3))
        rows.append(("Predict latency p50, one image, learner idle, httpx client (bare: the backbone's own forward)",
                     _fmt(r["http_idle"]["p50_s"], "ms"), floor, r["ratio_idle_p50_backbone_httpx"], "–", None))
    return rows


def _protocol_rows(r: dict) -> list[Row]:
    floor = _fmt(r["backbone_forward_idle"]["p50_s"], "ms")
    names = {"v1": "/v1/predict (the image as the body)", "oip_http_binary": "OIP over HTTP, binary tensor data",
             "oip_http_json": "OIP over HTTP, JSON and base64", "oip_grpc": "OIP over gRPC (raw_input_contents)"}
    rows: list[Row] = [(f"Predict latency p50, one image, learner idle, {what} (bare: the backbone's own forward)",
                        _fmt(r[name]["p50_s"], "ms"), floor, r[name]["ratio_p50_backbone"], "–", None)
                       for name, what in names.items()]
    if f := r.get("flood"):
        answers = ", ".join(f"{n} × {a}" for a, n in sorted(f["answers"].items()))
        rows.append((f"Server memory, {f['clients']} bodies of {f['body_bytes'] / 2**20:.0f} MB at once "
                     f"(answers: {answers}; bare: what they take unbounded)", f"+{f['rss_peak_growth_mb']:.0f} MB",
                     f"{f['unbounded_would_hold_mb']:.0f} MB", f["rss_peak_growth_mb"] / f["unbounded_would_hold_mb"],
                     "bounded", None))
    return rows


def _quality_rows(r: dict) -> list[Row]:
    s, seeds = r["spec"], r["seeds"]
    return [(f"Learning quality: A_last ÷ offline probe ({s['method']} + {s['learner']['classifier']}, the service's "
             f"default; {s['dataset']} {r['stream_samples']}-sample stream, seeds {', '.join(map(str, seeds))})",
             f"A_last {r['a_last']:.3f}", f"probe {r['ceiling']:.3f}", r["ratio"], "≥ 0.80", r["ratio"] >= 0.8)]


def _throughput_rows(r: dict) -> list[Row]:
    return [(f"Predict throughput, {r['clients']} clients (images/s)", _fmt(r["service_images_per_s"], "/s"),
             _fmt(r["bare_images_per_s"], "/s"), r["ratio"], "≥ 0.70", r["ratio"] >= 0.7)]


def _replica_rows(r: dict) -> list[Row]:
    rows: list[Row] = []
    for q, goal in (("p50", 1.3), ("p99", 3.0)):
        ratio = r[f"ratio_{q}"]
        rows.append((f"Predict latency {q} on a replica while the learner trains (own cores; bare: the replica's core)",
                     _fmt(r["latency"]["http"][f"{q}_s"], "ms"), _fmt(r["bare_forward"][f"{q}_s"], "ms"), ratio,
                     f"≤ {goal}", ratio <= goal))
    with_clients, ratio = r["clients"], r["throughput_ratio"]
    rows.append((f"Learner throughput with {with_clients['clients']} clients on a replica, ÷ without (samples/s)",
                 _fmt(with_clients["samples_per_s"], "/s"), _fmt(r["latency"]["samples_per_s"], "/s") + " (1 client)",
                 ratio, "≥ 0.70", ratio >= 0.7))
    return rows


def _alignment_rows(r: dict) -> list[Row]:
    return [("Alignment (Cholesky + solve + blend) per training step", _fmt(r["alignment_s"], "ms"),
             _fmt(r["step_s"], "ms") + " (step)", r["ratio"], "< 0.03", r["ratio"] < 0.03)]


def _refine_rows(r: dict) -> list[Row]:
    return [("Refine throughput (images/s)", _fmt(r["refine_images_per_s"], "/s"), _fmt(r["bare_images_per_s"], "/s"),
             r["ratio"], "–", None)]


def _bare_learner_rows(r: dict) -> list[Row]:
    s, rate = r["spec"], r["bare_samples_per_s"]
    return [(f"Bare learner, {s['model']} @ {s['img_size']} px, {s['method']} + {s['learner']['classifier']} "
             f"(samples/s)", _fmt(rate, "/s"), "–", None, "≥ 400/s on an H100-class GPU", rate >= 400)]


def _arithmetic_rows(r: dict) -> list[Row]:
    """Each native precision's bare forward against the fastest one; FLOP/s against the peak where known and
    against the device's own large matmul."""
    rows: list[Row] = []
    fastest = r["precisions"][r["fastest"]]
    for name, p in r["precisions"].items():
        share = "" if p["share_of_peak"] is None else f", {100 * p['share_of_peak']:.1f} % of peak"
        if p.get("share_of_matmul") is not None:  # results from before the matmul was measured lack it
            share += (f", {100 * p['share_of_matmul']:.0f} % of this device's {r['matmul_size']}² matmul "
                      f"({p['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s)")
        if "feature_cosine_min" in p:  # results from before the features were compared lack it
            share += f"; features' cosine to fp32 ≥ {p['feature_cosine_min']:.4f}"
        rows.append((f"Backbone forward, batch {r['batch']}, {name} (images/s; {r['flops_per_image'] / 1e9:.2f} "
                     f"GFLOP per image: {p['achieved_flops_per_s'] / 1e9:.0f} GFLOP/s achieved{share})",
                     _fmt(p["batch_images_per_s"], "/s"), _fmt(fastest["batch_images_per_s"], "/s") +
                     f" ({r['fastest']})", p["batch_images_per_s"] / fastest["batch_images_per_s"], "–", None))
    rows.append((f"Backbone forward, one image, p50 ({r['fastest']})", _fmt(fastest["single_image_p50_s"], "ms"), "–",
                 None, "–", None))
    return rows


def _scale_out_rows(r: dict) -> list[Row]:
    one, two = r["one"], r["two"]
    bare = r["bare_samples_per_s"]
    return [("Learning scaled out: 2 learners (1 thread, 1 core each) on 4 partitions, ÷ 1 learner (samples/s), "
             f"over the machine's 2 ÷ 1 limit (runs ≥ {r['min_seconds']:.0f} s)", _fmt(two["samples_per_s"], "/s"),
             _fmt(one["samples_per_s"], "/s") + " (1 learner)", r["of_limit"], "≥ 0.95",
             r["of_limit"] >= 0.95 and r["long_enough"]),
            ("The machine's limit: 2 bare learner loops at once (1 thread, 1 core each), ÷ 1 (samples/s)",
             _fmt(bare["2"], "/s"), _fmt(bare["1"], "/s") + " (1 loop)", r["bare_ratio"], "–", None)]


def _invariance_rows(r: dict) -> list[Row]:
    learner, predict = r["learner"], r["predict"]
    b, part = learner["batch_size"], learner["partial_images"]
    rows: list[Row] = [
        (f"One image, one feature: the learner with every forward in its fixed shape ({b} images) ÷ free shapes, "
         f"full mini-batches, side by side (samples/s)", _fmt(statistics.median(learner["full"]["b_samples_per_s"]),
                                                             "/s"),
         _fmt(statistics.median(learner["full"]["a_samples_per_s"]), "/s") + " (free shapes)",
         learner["full"]["ratio"], "≥ 0.97", learner["full"]["ratio"] >= 0.97),
        (f"The same on a partial mini-batch of {part} images (padded to {b})",
         _fmt(statistics.median(learner["partial"]["b_samples_per_s"]), "/s"),
         _fmt(statistics.median(learner["partial"]["a_samples_per_s"]), "/s") + " (free shapes)",
         learner["partial"]["ratio"], "–", None)]
    for name, what in (("free", "as it comes (the default)"), ("invariant", "--learner.invariant_predictions")):
        rows.append((f"Predict p50, one image, {what} (bare: the backbone's own forward)",
                     f"{predict[f'{name}_ms']:.1f} ms", f"{predict['backbone_ms']:.1f} ms",
                     predict[f"{name}_x_backbone"], "–", None))
    if int8 := r.get("int8"):
        rows.append(("int8 learner, activations per row (exact, invariant) ÷ per batch (before), side by side "
                     "(samples/s)", _fmt(statistics.median(int8["b_samples_per_s"]), "/s"),
                     _fmt(statistics.median(int8["a_samples_per_s"]), "/s") + " (per batch)", int8["ratio"], "–",
                     None))
    return rows


def _join_rows(r: dict) -> list[Row]:
    long, short = r["long"], r["short"]
    rss = f"{_fmt(r['rss_bytes_at_n'], 'MB')} → {_fmt(r['rss_bytes_at_end'], 'MB')}"
    return [(f"Labels that come later: learner memory (RSS) at {short['images']:,} → {long['images']:,} images, "
             f"30% of labels never coming ({r['feature_dim']}-d features kept)", rss,
             "–", r["rss_growth_after_n"], "growth < 0.05", r["rss_growth_after_n"] < 0.05),
            ("Labels that come later: most images the join held (its bound: --join.max_images)",
             f"{long['store_max']:,}", f"{r['max_images']:,} (the bound)", None, "≤ the bound", r["store_bounded"])]


def _corrections_rows(r: dict) -> list[Row]:
    """Corrections and deletions (``benchmarks.corrections``): the learner's rate, the tombstone's wait, the disk
    and the memory over a long stream."""
    w, wo, long = r["with_changes"], r["without"], r["long"]
    wait = r["tombstone_to_model_s"] or long["tombstone_to_model_s"]
    return [(f"Corrections and deletions: learner state rate with {100 * w['change_share']:.1f} % of records changes "
             f"(corrections 5 : deletions 1), {w['images']:,} images, {r['feature_model']} @ {r['img_size']} px, "
             f"against the same images without", _fmt(w["images_per_s"], "/s"), _fmt(wo["images_per_s"], "/s"),
             r["ratio"], "≥ 0.9", r["ratio"] >= 0.9),
            ("Corrections and deletions: a tombstone read to the model without it (p50 / p99; the poll after, no "
             "broker)", f"{_fmt(wait['p50'], 'ms')} / {_fmt(wait['p99'], 'ms')}", "–", None, "–", None),
            (f"Corrections and deletions: sample table on disk per id ({long['table_ids']:,} ids)",
             f"{r['table_bytes_per_id']:,.0f} B", "–", None, "–", None),
            (f"Corrections and deletions: learner memory (anonymous RSS) at {r['memory_at_tenth']['images']:,} → "
             f"{r['memory_at_end']['images']:,} images",
             f"{_fmt(r['memory_at_tenth']['anon_bytes'], 'MB')} → {_fmt(r['memory_at_end']['anon_bytes'], 'MB')}",
             "–", r["anon_growth_after_tenth"], "growth < 0.05", r["anon_growth_after_tenth"] < 0.05),
            ("Corrections and deletions: resident set (VmRSS: the sample table's memory-mapped pages included, which "
             "the kernel reclaims at will) over the same images",
             f"{_fmt(r['memory_at_tenth']['rss_bytes'], 'MB')} → {_fmt(r['memory_at_end']['rss_bytes'], 'MB')}",
             "–", r["rss_growth_after_tenth"], "growth < 0.05", r["rss_growth_after_tenth"] < 0.05)]


def _corrections_service_rows(r: dict) -> list[Row]:
    """Corrections and deletions through Kafka (``benchmarks.corrections_service``): ``mepo serve``'s rate, and a
    tombstone's wait from its write."""
    w, wo, wait, spec = r["with_changes"], r["without"], r["tombstone_waits_s"], r["spec"]
    return [(f"Corrections and deletions through Kafka: mepo serve's rate with {100 * r['change_share']:.1f} % of "
             f"records changes (corrections 5 : deletions 1), {w['images']:,} images, {spec['model']} @ "
             f"{spec['img_size']} px, against the same images without", _fmt(w["images_per_s"], "/s"),
             _fmt(wo["images_per_s"], "/s"), r["ratio"], "≥ 0.9", r["ratio"] >= 0.9),
            (f"Corrections and deletions through Kafka: a tombstone written to the model without it, learner idle "
             f"(p50 / p99 of {wait['n']})", f"{_fmt(wait['p50_s'], 'ms')} / {_fmt(wait['p99_s'], 'ms')}", "–", None,
             "–", None)]


def _frontier_rows(r: dict) -> list[Row]:
    """Each stream's most accurate refine on the frontier against the untouched backbone (docs/refine.md has all)."""
    base = next(p for p in r["points"] if p["budget"] == 0)
    rows: list[Row] = []
    for s, what in r["streams"].items():
        best = max((p for p in r["points"] if p["refine"]), key=lambda p: p[s]["a_last"], default=None)
        if best is None:
            continue
        refine = best["refine"]
        rows.append((f"Refine frontier, {s} ({what}): the most accurate refine, {best['arm']} × {best['budget']} "
                     f"({refine['minutes']:.2g} min at {refine['images_per_s']:.0f} images/s, {refine['precision']}), "
                     f"A_last (probe {100 * best[s]['probe']:.1f} %) against the untouched backbone",
                     f"A_last {best[s]['a_last']:.3f}", f"{base[s]['a_last']:.3f} (untouched)",
                     best[s]["a_last"] / base[s]["a_last"] if base[s]["a_last"] else None, "–", None))
    return rows


def _decode_rows(r: dict) -> list[Row]:
    rows: list[Row] = []
    for kind, s in r["streams"].items():
        camera_jpeg = kind in ("1280x960 JPEG", "1920x1080 JPEG")
        ratio = s["scaled_ms"] / s["full_ms"]
        rows.append((f"Decode to {r['size']} px, {kind} ({s['bytes_mean'] / 1024:.0f} KB), one thread, ms an image "
                     f"(pixels apart from the full decode: max {s['pixels_apart_max']}, mean "
                     f"{s['pixels_apart_mean']:.2f} of 255)",
                     f"{s['scaled_ms']:.2f} ms", f"{s['full_ms']:.2f} ms (full decode, then resize)", ratio,
                     "≤ 0.2 (5× faster)" if camera_jpeg else "–", ratio <= 0.2 if camera_jpeg else None))
    return rows


def _camera_learner_rows(r: dict) -> list[Row]:
    camera, streams = r["camera"], r["streams"]
    rows: list[Row] = [(f"Learner on a {camera} JPEG stream ÷ on the same images at 64 px (samples/s, "
                        f"{r['stream_samples']} images)", _fmt(streams[camera]["service_samples_per_s"], "/s"),
                        _fmt(streams["64x64"]["service_samples_per_s"], "/s") + " (64 px)", r["camera_over_64px"],
                        "≥ 0.80", r["camera_over_64px"] >= 0.8)]
    for name, c in streams.items():
        rows.append((f"Learner throughput from Kafka, {name} JPEGs, against a bare loop that decodes them too "
                     f"(samples/s{_spread(c)})", _fmt(c["service_samples_per_s"], "/s"),
                     _fmt(c["bare_samples_per_s"], "/s") + " (decode + its loop)", c["ratio"], "≥ 0.90",
                     c["ratio"] >= 0.9))
    return rows


def _camera_latency_rows(r: dict) -> list[Row]:
    scaled, full = r["bare_scaled_decode_and_forward_idle"], r["bare_full_decode_and_forward_idle"]
    ours, ratio = r["http_idle_raw_client"]["p50_s"], r["ratio_idle_p50_camera"]
    return [(f"Predict latency p50, one {r['camera']} JPEG ({r['camera_bytes'] / 1024:.0f} KB), learner idle, stdlib "
             f"client (bare: its scaled decode + the snapshot's forward; with the full decode it replaced: "
             f"{_fmt(full['p50_s'], 'ms')})", _fmt(ours, "ms"), _fmt(scaled["p50_s"], "ms"), ratio, "≤ 1.3",
             ratio <= 1.3)]


def _gpu_decode_rows(r: dict) -> list[Row]:
    rows: list[Row] = []
    for name, stream in r["streams"].items():
        for size, m in ((k, v) for k, v in stream.items() if k != "images"):
            threads, cpu = max(m["cpu_images_per_s"].items(), key=lambda kv: kv[1])
            rows.append((f"{name} JPEG to {size} px on the GPU, batches of {r['batch']} (images/s; pixels apart from "
                         f"the CPU's decode: mean {m['pixels_apart_mean']:.2f}, max {m['pixels_apart_max']})",
                         _fmt(m["gpu_images_per_s"], "/s"), f"{_fmt(cpu, '/s')} (CPU scaled decode, {threads} threads)",
                         m["gpu_over_best_cpu"], "–", None))
    return rows


def _camera_rows(r: dict, decoded: str) -> list[Row]:
    """The learner rows of a camera stream, named by where its JPEGs decode (no memory row: one short round)."""
    what = f"{r['stream_samples']} 1280x960 JPEGs {decoded}, {r['spec']['model']} @ {r['spec']['img_size']} px"
    return [(text.replace("Learner throughput from Kafka", f"Learner throughput from Kafka, {what}"), *rest)
            for text, *rest in _learner_rows(r) if not text.startswith("Learner memory")]


ROWS: dict[str, Callable[[dict], list[Row]]] = {
    "model_arithmetic": _arithmetic_rows, "learning_quality": _quality_rows,
    "learning_quality_tinyimagenet": _quality_rows, "learner_throughput": _learner_rows,
    "predict_latency": _latency_rows, "protocol_latency": _protocol_rows,
    "predict_throughput": _throughput_rows, "replica_latency": _replica_rows,
    "alignment_cost": _alignment_rows, "refine_throughput": _refine_rows, "scale_out": _scale_out_rows,
    "label_join_memory": _join_rows, "corrections": _corrections_rows, "batch_invariance": _invariance_rows,
    "corrections_service": _corrections_service_rows,
    "refine_frontier": _frontier_rows,
    "decode": _decode_rows, "camera_learner": _camera_learner_rows, "predict_latency_camera": _camera_latency_rows,
    "learner_overhead": _overhead_rows, "gpu_learner_fp32": _learner_rows,
    "gpu_learner_bf16": _learner_rows, "gpu_predict_latency": _latency_rows, "gpu_vit_b16": _bare_learner_rows,
    "gpu_decode": _gpu_decode_rows, "gpu_camera_learner": lambda r: _camera_rows(r, "decoded on the GPU"),
    "gpu_camera_learner_cpu_decode": lambda r: _camera_rows(r, "decoded by the decode pool's threads"),
}


def _device(m: dict) -> str:
    return m.get("device_name", m.get("processor", "?"))


def _where(m: dict) -> str:
    """Device and dtype (results from before they were recorded ran on the CPU in fp32: there was no autocast)."""
    return f"{_device(m)}, {m.get('dtype', 'float32')}"


def _machine_text(m: dict) -> str:
    """The device and the software around it (leaving out what a result predates)."""
    facts = [f"{m['cpus']} CPUs" if "cpus" in m else None,
             f"{m['torch_threads']} torch threads" if "torch_threads" in m else None, f"torch {m.get('torch')}",
             f"CUDA {m.get('cuda')}" if m.get("device") == "cuda" else None]
    return f"{_device(m)} ({', '.join(f for f in facts if f)})"


def table(results: dict[str, dict]) -> str:
    """The results table: one row per measured quantity, with its goal and where it was measured."""
    lines = ["| measurement | mepo-stream | bare PyTorch reference | ratio | goal | met | measured on |",
             "|---|---|---|---|---|---|---|"]
    for name, rows in ROWS.items():
        if name in results:
            where = _where(results[name].get("machine", {}))
            lines += [f"| {what} | {ours} | {bare} | {'–' if ratio is None else f'{ratio:.3f}'} | {goal} | "
                      f"{'–' if met is None else 'yes' if met else 'no'} | {where} |"
                      for what, ours, bare, ratio, goal, met in rows(results[name])]
    if not results:
        return "No rows measured."
    some = next(iter(results.values()))
    times = sorted(r["measured_at"] for r in results.values() if "measured_at" in r)
    machines = sorted({_machine_text(r["machine"]) for r in results.values() if "machine" in r})
    spec = some.get("spec", some)
    when = f"{times[0]} to {times[-1]}" if times else "?"
    lines += ["", f"Measured {when} on {'; '.join(machines)}, model {spec.get('model')} @ {spec.get('img_size')} px "
              "unless the row names another. Ratios are mepo-stream / reference (for memory: the growth)."]
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
         fresh_processes: bool = True) -> str:
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
                       mepo=mepo or sigma_bundle(model, weights, img_size, work))
    for name in [b for b in ALL if b in selected and b not in skipped]:
        module, args = job(name, spec, quick, work)
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
