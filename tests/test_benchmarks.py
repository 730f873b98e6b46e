"""Benchmarks are not tests, but each script must keep running: smoke runs on tiny sizes, no timing asserts."""

import importlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from jsonargparse import ArgumentParser

from benchmarks.run_all import (
    ALL,
    BENCHMARKS,
    END,
    GPU_BENCHMARKS,
    GPU_LEARNER_CONFIGS,
    GPU_STREAM_PER_CLASS,
    START,
    job,
    table,
    update_page,
)
from benchmarks.tools.service import ServiceSpec
from mepo_stream.precision import resolve_precision

ROOT = Path(__file__).parents[1]
TINY = ["--model", "test_vit", "--weights", "null", "--img_size", "32"]


def _run(module: str, *args: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run([sys.executable, "-m", module, *args], check=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, capture_output=True,
                          text=True).stdout


def _results(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}


def _numbers(result: object) -> list[float]:
    """Every number in a result, nested ones included (to check they are finite, never their size: timings)."""
    if isinstance(result, dict):
        return [n for v in result.values() for n in _numbers(v)]
    if isinstance(result, list):
        return [n for v in result for n in _numbers(v)]
    return [result] if isinstance(result, (int, float)) and not isinstance(result, bool) else []


TWO_CORES = ("replica_latency", "scale_out")
"""The benchmarks that pin their processes to two cores: smoke-run by the slow test below. In the default suite
their guarantees are held by tests/test_replica.py::test_two_replicas_follow_the_learner_answer_as_it_does_and_\
survive_restarts (replicas follow the learner and answer while it learns) and tests/test_scale_out.py::\
test_two_learners_on_four_partitions_build_the_single_learners_model (two learners build one learner's model, to
1e-9 and top-1 identical at every shrinkage), and their arithmetic in-process here (test_scale_out_same_model_...)."""
OWN_SMOKE = ("refine_frontier", "learner_overhead")
"""Smoke-run elsewhere: refine_frontier by a test of its own (tests/test_refine_frontier.py::test_quick_frontier_\
writes_every_point_the_table_and_the_plot, through the same script), learner_overhead by this smoke's
learner_throughput row (the same script on the same tiny model at the smoke sizes; its own stream and bare runs
differ only at the full sizes). The run_all smoke keeps their committed results, as for the two-core rows."""


def _results_with_committed(folder: Path, names: tuple[str, ...]) -> None:
    """Seed a results folder with the committed results of ``names`` (what ``--only`` keeps in the table)."""
    folder.mkdir(parents=True)
    for name in names:
        (folder / f"{name}.json").write_text((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())


SERVING_ROWS = ("predict_latency", "predict_throughput", "protocol_latency", "corrections_service")
"""The rows that answer requests or changes through a live service: about half the smoke's time, run as its second
half, so that two workers run the halves side by side."""


def _check_learning(results: dict[str, dict]) -> None:
    assert {"alignment_s", "step_s", "step_without_alignment_s", "differential_share"} <= set(
        results["alignment_cost"])
    arithmetic = results["model_arithmetic"]["precisions"]
    assert arithmetic["fp32"]["share_of_matmul"] > 0 and arithmetic["int8_dynamic"]["share_of_matmul"] is None
    learner = results["learner_throughput"]  # one configuration at the smoke sizes (the others: the test below)
    assert learner["stream_samples"] == 100 and len(learner["prequential"]["rounds"]) == 1
    assert "ratio" in learner["prequential"] and not {"learn_only", "paper_recipe", "int8_learn_only"} & set(learner)
    quality = results["learning_quality"]
    assert 0 < quality["ceiling"] <= 1 and quality["ratio"] == pytest.approx(quality["a_last"] / quality["ceiling"])
    assert quality["spec"]["method"] == "frozen" and quality["stream_samples"] == 100
    decode = results["decode"]["streams"]  # the camera sizes decode near the full decode's pixels; others exactly
    assert {"1280x960 JPEG", "1920x1080 JPEG", "1280x960 PNG", "1280x960 WEBP"} <= set(decode)
    assert all(s["pixels_apart_mean"] < 2 and s["pixels_apart_max"] <= 32 for s in decode.values())
    assert decode["1280x960 PNG"]["pixels_apart_max"] == decode["1280x960 WEBP"]["pixels_apart_max"] == 0
    changes = results["corrections"]  # corrections and deletions applied, none refused; the table on disk
    assert changes["long"]["counts"]["deletions_applied"] > 0 and changes["long"]["counts"]["corrections_refused"] == 0
    assert changes["table_bytes_per_id"] > 0 and changes["memory_at_end"]["anon_bytes"] > 0 and changes["ratio"] > 0
    join = results["label_join_memory"]  # the bound holds, and every image is joined, expired or waiting
    assert join["store_bounded"] and join["long"]["images"] == 10 * join["short"]["images"]
    assert join["long"]["counts"]["expired_images"] > 0 and join["long"]["counts"]["joined"] > 0


def _check_serving(results: dict[str, dict]) -> None:
    assert results["predict_throughput"]["answered"] > 0 and results["predict_throughput"]["failed"] == 0
    assert 0 < results["predict_latency"]["requests_while_learning"] <= 10
    live = results["corrections_service"]  # through Kafka: both streams learned, each tombstone applied and timed
    assert live["without"]["images"] == live["with_changes"]["images"] > 0 and live["tombstone_waits_s"]["n"] == 5
    assert live["with_changes"]["status"]["deletions_applied"] == live["with_changes"]["deletions"]


@pytest.mark.timeout(1200)  # a few processes each; on a busy 2-core machine the whole smoke has taken 4 minutes
@pytest.mark.parametrize("serving", [False, True], ids=["learning_rows", "serving_rows"])
def test_run_all_smoke_writes_every_result_and_the_performance_table(tmp_path, serving):
    """Every one-core benchmark once at its smallest size through run_all, in two halves (the two-core ones and the
    other half keep their committed results, which the table shows beside the new ones: ``--only`` keeps the others'
    rows)."""
    readme = tmp_path / "performance.md"
    readme.write_text(f"# x\n\nbefore\n{START}\nold table\n{END}\nafter\n")
    ran = [b for b in BENCHMARKS if b not in TWO_CORES + OWN_SMOKE and (b in SERVING_ROWS) == serving]
    _results_with_committed(tmp_path / "results", tuple(b for b in BENCHMARKS if b not in ran))
    kept = _results(tmp_path / "results")
    out = _run("benchmarks.run_all", "--quick", "true", "--gpu", "false", *TINY, "--results", str(tmp_path / "results"),
               "--page", str(readme), "--only", ",".join([*ran, *GPU_BENCHMARKS]),
               "--fresh_processes", "false",  # one process for them all
               env={"CUDA_VISIBLE_DEVICES": ""})  # the CPU rows, CUDA or not (the GPU rows test: fresh processes)
    assert "GPU rows skipped" in out
    results = _results(tmp_path / "results")
    assert set(results) == set(BENCHMARKS)  # the GPU rows skipped (and the CPU rows on the CPU, CUDA or not)
    assert {name: results[name] for name in kept} == kept  # not run: left as they were
    assert all(math.isfinite(n) for name in ran for n in _numbers(results[name]))
    (_check_serving if serving else _check_learning)(results)
    auto = str(resolve_precision("auto", torch.device("cpu"))).removeprefix("torch.")  # bf16 where the CPU has it
    assert all(results[name]["machine"]["device"] == "cpu" and results[name]["machine"]["dtype"] in {"float32", auto}
               and results[name]["machine"]["device_name"] and "cuda" in results[name]["machine"]
               and results[name]["machine"]["torch_threads"] > 0 for name in ran)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\n\nbefore\n") and text.endswith(f"{END}\nafter\n")
    assert text.count("| ") > 7 and "Learner throughput" in text and "Alignment" in text
    assert "Learning quality: A_last ÷ offline probe" in text and "on a replica" in text  # a kept row
    assert "| measured on |" in text and "GPU rows: not measured" in text


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pins its processes to two cores")
def test_two_core_benchmarks_smoke(tmp_path):
    """replica_latency and scale_out at their smallest sizes (scale_out's stream: 2,000 images, so that the
    second learner joins before the stream is learned)."""
    _run("benchmarks.run_all", "--quick", "true", "--gpu", "false", *TINY, "--results", str(tmp_path / "results"),
         "--page", "null", "--only", ",".join(TWO_CORES))
    results = _results(tmp_path / "results")
    assert set(results) == set(TWO_CORES) and all(math.isfinite(n) for r in results.values() for n in _numbers(r))
    replica = results["replica_latency"]
    assert replica["latency"]["answered"] >= 2 and replica["clients"]["answered"] >= 2
    assert replica["latency"]["other"] == replica["clients"]["other"] == 0
    scale_out = results["scale_out"]
    assert 0 < scale_out["one"]["samples"] <= 2000 and 0 < scale_out["two"]["samples"] <= 2000
    assert scale_out["two"]["learners"] == 2
    assert len(scale_out["two"]["state_bytes_per_learner_per_s"]) == 2 and scale_out["on_paper"][-1]["learners"] == 100
    exact = scale_out["same_model"]  # one learner's and two learners' models, read back from their state topics
    assert max(exact["relative_difference"].values()) <= 1e-9 and all(exact["identical_predictions_per_shrinkage"])
    bare = scale_out["bare_samples_per_s"]
    assert scale_out["bare_ratio"] == pytest.approx(bare["2"] / bare["1"])


SMALL = ServiceSpec(model="test_vit", weights=None, img_size=32, mepo=None, train_per_class=2)


@pytest.mark.parametrize("precision,configs", [("auto", None), ("bf16", GPU_LEARNER_CONFIGS),
                                               ("auto", ("learn_only", "librdkafka_learn_only"))])
def test_learner_throughput_measures_every_configuration_against_its_own_bare_loop(tmp_path, monkeypatch,
                                                                                     precision, configs):
    """Each configuration's service (a stand-in here: the smoke runs start the real one for the first
    configuration) between two runs of its own bare loop, which really runs: the model, method, classifier,
    precision and test-then-train of the configuration. bf16 with the GPU rows' configurations: the GPU rows."""
    import benchmarks.rows.learner_throughput as throughput

    served = []

    def service_round(spec, prequential, work):
        consumer = spec.extra[spec.extra.index("--consumer") + 1] if "--consumer" in spec.extra else "kafka-python"
        served.append((spec.method, spec.learner.classifier, spec.learner.precision, prequential, consumer))
        return {"service_samples_per_s": 50.0, "rss_bytes_at_10pct": 100, "rss_bytes_at_100pct": 101,
                "rss_growth": 0.01, "measured_between_samples": [3, 20], "dead_lettered": 0}

    bare = []
    real_bare_run = throughput.bare_run
    monkeypatch.setattr(throughput, "service_round", service_round)
    monkeypatch.setattr(throughput, "bare_run", lambda *a: bare.append(a[0].learner.precision) or real_bare_run(*a))
    spec = replace(SMALL, learner=replace(SMALL.learner, precision=precision))
    result = throughput.main(spec, bare_batches=1, rounds=1, configs=configs, work=tmp_path, out=tmp_path / "r.json")
    expected = {"learn_only": ("frozen", "slda", precision, False, "kafka-python"),
                "prequential": ("frozen", "slda", precision, True, "kafka-python"),
                "paper_recipe": ("misa", "linear", precision, True, "kafka-python"),
                "int8_learn_only": ("frozen", "slda", "int8", False, "kafka-python"),
                "librdkafka_learn_only": ("frozen", "slda", precision, False, "librdkafka")}
    names = list(configs or [name for name in throughput.configurations(spec)  # int8_learn_only on the CPU only
                             if name not in throughput.ON_REQUEST])
    assert served == [expected[n] for n in names] and bare == [expected[n][2] for n in names for _ in "ab"]
    for name in names:
        c = result[name]
        assert c["bare_samples_per_s"] > 0 and c["ratio"] == pytest.approx(50.0 / c["bare_samples_per_s"])
        assert (c["method"], c["classifier"]) == expected[name][:2] and len(c["rounds"]) == 1
    assert json.loads((tmp_path / "r.json").read_text())["stream_samples"] == 20
    text = table({"learner_throughput": result})
    assert ("Learner throughput from Kafka, misa + linear (the paper's recipe)" in text) == ("paper_recipe" in names)
    assert ("frozen + slda, read with librdkafka" in text) == ("librdkafka_learn_only" in names)


def test_learner_throughput_streams_the_camera_size_it_is_given(tmp_path, monkeypatch):
    """``--camera`` (the GPU camera rows): the service and its bare loop learn the dataset's images upscaled to that
    size as JPEGs, built when the row runs (a stand-in service, as above; the bare loop decodes them for real)."""
    from PIL import Image

    import benchmarks.rows.learner_throughput as throughput
    from mepo_stream.cache import cache_dir

    served = []
    monkeypatch.setattr(throughput, "service_round", lambda spec, prequential, work: served.append(spec) or {
        "service_samples_per_s": 50.0, "rss_bytes_at_10pct": 100, "rss_bytes_at_100pct": 101, "rss_growth": 0.01,
        "measured_between_samples": [3, 20], "dead_lettered": 0})
    result = throughput.main(SMALL, bare_batches=1, rounds=1, configs=("learn_only",), camera="640x480",
                             work=tmp_path, out=tmp_path / "r.json")
    folder = Path(served[0].dataset)
    assert folder.is_relative_to(cache_dir() / "camera") and result["stream_samples"] == 20
    assert {Image.open(f).size for f in folder.rglob("*.jpg")} == {(640, 480)}
    assert result["learn_only"]["bare_samples_per_s"] > 0


def test_scale_out_same_model_finds_the_sums_of_two_parts_the_whole_and_predicts_identically():
    """scale_out's exactness check (``same_model``) on one learner's sums against two halves' summed, in-process."""
    from benchmarks.rows.scale_out import add_cost_per_element, on_paper, same_model
    from benchmarks.tools.service import bare_learner
    from mepo_stream.data import list_files, load_split
    from mepo_stream.label_statistics import LabelStatistics

    torch.set_num_threads(1)  # batch-invariant features
    classes = len(list_files(SMALL.data, "train").classes)
    data = load_split(replace(SMALL.data, load_size=SMALL.limits.size), "train")
    whole = bare_learner(SMALL, classes)
    whole.observe(data.images, data.targets)
    parts = []
    for rows in (slice(0, 10), slice(10, 20)):
        part = bare_learner(SMALL, classes)
        part.observe(data.images[rows], data.targets[rows])
        parts.append(part.statistics())
    exact = same_model(SMALL, whole.statistics(), LabelStatistics.total(parts), test_per_class=2)
    assert max(exact["relative_difference"].values()) <= 1e-9 and all(exact["identical_predictions_per_shrinkage"])
    assert exact["one"]["a_last_per_shrinkage"] == exact["two"]["a_last_per_shrinkage"]
    skewed = LabelStatistics.total([parts[0], parts[0]])  # not the whole: told apart
    assert max(same_model(SMALL, whole.statistics(), skewed, test_per_class=2)["relative_difference"].values()) > 1e-3
    rows = on_paper(add_cost_per_element(repeats=1), rate=100.0)
    assert rows[-1]["learners"] == 100 and all(r["merge_s"] > 0 for r in rows)


def test_gpu_rows_smoke_on_the_cpu(tmp_path):
    """The GPU rows' functions at tiny sizes (on the CPU without CUDA): bf16 service and bare loop, bare ViT; with
    Sigma_pre from CIFAR-10, as on a lent GPU that has only gpu-pack's CIFAR-10 subset."""
    _run("benchmarks.run_all", "--quick", "true", "--gpu", "true", "--only", "gpu_learner_bf16,gpu_vit_b16", *TINY,
         "--results", str(tmp_path / "results"), "--page", "null", "--sigma_data", "cifar10")
    results = _results(tmp_path / "results")
    assert set(results) == {"gpu_learner_bf16", "gpu_vit_b16"}
    bundle = json.loads((Path(results["gpu_vit_b16"]["spec"]["mepo"]) / "manifest.json").read_text())
    assert bundle["covariance"]["data"]["dataset"] == "cifar10" and bundle["covariance"]["n_classes"] == 10
    assert all(r["machine"]["dtype"] == "bfloat16" for r in results.values())
    learner = results["gpu_learner_bf16"]
    assert "learn_only" not in learner and all(math.isfinite(n) for r in results.values() for n in _numbers(r))
    assert "ratio" in learner["prequential"]  # paper_recipe in bf16: test_learner_throughput_measures_every_...
    assert "bare_samples_per_s" in results["gpu_vit_b16"] and results["gpu_vit_b16"]["spec"]["method"] == "misa"
    text = table(results)
    assert "Bare learner, test_vit @ 32 px, misa + linear" in text and "bfloat16 |" in text
    assert "GPU rows: not measured" not in text


def test_the_gpu_rows_time_a_stream_ten_times_the_cpu_rows(tmp_path):
    """At the full sizes the GPU's learner and latency rows stream 1,000 images a class: 1,000 in all took an H100
    half a second, too short a window to time."""
    spec = ServiceSpec(model="test_vit", weights=None, img_size=32, mepo=None)

    def per_class(name: str) -> int:
        args = job(name, spec, quick=False, work=tmp_path)[1]
        return int(args[args.index("--spec.train_per_class") + 1])

    assert {n: per_class(n) for n in ("learner_throughput", "predict_latency")} == {
        "learner_throughput": 100, "predict_latency": 100}
    assert {per_class(n) for n in ("gpu_learner_fp32", "gpu_learner_bf16", "gpu_predict_latency")} == {
        GPU_STREAM_PER_CLASS} and GPU_STREAM_PER_CLASS == 1000


@pytest.mark.parametrize("name", ALL)
def test_every_job_passes_arguments_its_script_reads(name, tmp_path):
    """Each result's command line parses with its script's own parser (the GPU rows' precision pinned)."""
    spec = ServiceSpec(model="test_vit", weights=None, img_size=32, mepo=None)
    module, args = job(name, spec, quick=True, work=tmp_path)
    parser = ArgumentParser()
    parser.add_function_arguments(importlib.import_module(f"benchmarks.{module}").main)
    parsed = parser.parse_args([*args, "--out", str(tmp_path / "out.json")])
    if name.startswith("gpu_learner_"):
        assert parsed.spec.learner.precision == name.removeprefix("gpu_learner_")
    if name == "gpu_vit_b16":
        assert parsed.spec.learner.precision == "bf16" and parsed.spec.method == "misa"


def test_table_reads_every_committed_result():
    """The committed results' table: each row script formats its results (the GPU rows may be missing)."""
    results = {name: r for name, r in _results(ROOT / "benchmarks" / "results").items()
               if name in ALL}
    text = table(results)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows and all(line.count(" | ") == 6 for line in rows)
    assert all(f"{r['machine']['device_name']}, {r['machine']['dtype']} |" in text for r in results.values())
    assert ("GPU rows: not measured" in text) == (not set(GPU_BENCHMARKS) & set(results))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_rows_measure_on_the_gpu(tmp_path):
    """The GPU-only path: by default (CUDA present) the GPU rows run, each on the GPU in its own dtype."""
    _run("benchmarks.run_all", "--quick", "true", *TINY, "--only", ",".join(GPU_BENCHMARKS), "--results",
         str(tmp_path / "results"), "--page", "null")
    machines = {name: r["machine"] for name, r in _results(tmp_path / "results").items()}
    assert set(machines) == set(GPU_BENCHMARKS)
    assert all(m["device"] == "cuda" and m["device_name"] == torch.cuda.get_device_name() and m["cuda"]
               for m in machines.values())
    assert machines["gpu_learner_fp32"]["dtype"] == "float32" and machines["gpu_vit_b16"]["dtype"] == "bfloat16"


def test_a_page_without_markers_is_a_clear_error(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        update_page(page, "table")


def test_serve_report_smoke(tmp_path):
    out = tmp_path / "serve.json"
    _run("benchmarks.experiments.serve_report", "--spec.train_per_class", "3", "--test_per_class", "2",
         "--spec.img_size", "32", "--spec.model", "test_vit", "--spec.weights", "null", "--bad_copies", "1",
         "--eval_period", "16", "--timeout", "300", "--work", str(tmp_path / "work"), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["samples_learned"] == 30 and report["dead_lettered"] == report["bad_records_injected"] == 5


def test_profile_summary_counts_only_the_learner_loop_and_the_model_threads_work_for_it():
    from benchmarks.tools.profile_summary import shares

    raw = "\n".join([
        "_worker (concurrent/futures/thread.py:1);_learn (server/learner/state.py:3);encode (mepo_stream/x.py:4) 6",
        "_run (server/learner/stream.py:1);_consume (server/learner/stream.py:9);save (server/learner/state.py:5) 2",
        "_worker (concurrent/futures/thread.py:1);_serve (server/batching.py:2);encode (mepo_stream/x.py:4) 40",
        "serve (uvicorn/main.py:1);predict (server/web/routers/predict.py:2) 50",
    ])
    total, rows = shares(raw)
    assert total == 8 and dict(rows)["_consume (server/learner/stream.py)"] == 0.25
    assert dict(rows)["_learn (server/learner/state.py)"] == dict(rows)["encode (mepo_stream/x.py)"] == 0.75


def test_camera_streams_are_built_once_at_their_size_and_format_the_same_bytes_each_time():
    import shutil

    from PIL import Image

    from benchmarks.tools.camera_streams import camera_folder
    from mepo_stream.data import DataConfig, list_files

    data = DataConfig(dataset="cifar10", num_classes=2, train_per_class=2, test_per_class=1)
    jpeg = camera_folder(data, 640, 480)
    files = sorted(jpeg.rglob("*.jpg"))
    first = [f.read_bytes() for f in files]
    assert len(files) == 6 and all(Image.open(f).size == (640, 480) for f in files)
    assert list_files(DataConfig(dataset=str(jpeg)), "train").classes == list_files(data, "train").classes
    assert camera_folder(data, 640, 480) == jpeg  # found, not built again
    shutil.rmtree(jpeg)
    assert [f.read_bytes() for f in sorted(camera_folder(data, 640, 480).rglob("*.jpg"))] == first  # built again
    assert len(list(camera_folder(data, 320, 240, "WEBP").rglob("*.webp"))) == 6
