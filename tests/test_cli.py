"""The ``mepo`` command end to end on tiny settings: help texts, covariance, import, evaluate."""

import json
import subprocess
import sys

import pytest
import timm
import torch

from mepo_stream.artifacts import load_sigma_pre, read_manifest
from mepo_stream.cli import main

TINY = ["--backbone.name", "test_vit", "--backbone.weights", "null", "--backbone.img_size", "32"]


@pytest.mark.parametrize("command", [[], ["evaluate"], ["covariance"], ["backbone", "import"], ["refine"], ["serve"],
                                     ["produce"], ["demo"]])
def test_help_explains_every_option(command):
    out = subprocess.run([sys.executable, "-m", "mepo_stream.cli", *command, "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "usage: mepo" in out
    if command == ["evaluate"]:
        assert "Adam learning rate" in out and "Disjoint-class ratio" in out  # field docstrings become help


def test_covariance_writes_a_verified_bundle(tmp_path):
    main(["covariance", "--out", str(tmp_path / "cov"), *TINY, "--cov.data.dataset", "cifar10",
          "--cov.data.train_per_class", "8"])
    manifest = read_manifest(tmp_path / "cov")
    assert manifest["covariance"]["n_classes"] == 10 and manifest["backbone"]["name"] == "test_vit"
    sigma = load_sigma_pre(tmp_path / "cov")
    assert sigma.shape == (64, 64) and sigma.dtype == torch.float64


def test_backbone_import_makes_a_usable_bundle(tmp_path):
    model = timm.create_model("test_vit", pretrained=False, num_classes=0)
    torch.save(model.state_dict(), tmp_path / "vit_test_meta_1.pth")
    import numpy as np

    np.save(tmp_path / "cov.npy", np.eye(64))
    main(["backbone", "import", "--source", str(tmp_path / "vit_test_meta_1.pth"), "--out", str(tmp_path / "b"),
          "--name", "test_vit", "--covariance", str(tmp_path / "cov.npy")])
    assert set(read_manifest(tmp_path / "b")["files"]) == {"backbone.safetensors", "sigma_pre.safetensors"}
    from mepo_stream.backbone import BackboneConfig, create_backbone

    loaded = create_backbone(BackboneConfig("test_vit", str(tmp_path / "b"), 224))
    assert torch.equal(loaded.cls_token, model.cls_token)


def test_evaluate_end_to_end(tmp_path):
    sigma_dir = tmp_path / "cov"
    main(["covariance", "--out", str(sigma_dir), *TINY, "--cov.data.dataset", "cifar10",
          "--cov.data.train_per_class", "8"])
    main(["evaluate", "--out", str(tmp_path / "ev"), "--seeds", "1-2", "--mepo-cov", str(sigma_dir), *TINY,
          "--data.dataset", "cifar10", "--data.train_per_class", "20", "--data.test_per_class", "5",
          "--protocol.eval_period", "50", "--learner.samples_per_slot", "40"])
    result = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert [r["seed"] for r in result["runs"]] == [1, 2]
    curve = result["runs"][0]["curves"]["running"]
    assert curve["samples"] == [50, 100, 150, 200] and 0 <= curve["A_auc"] <= 1
    assert len(curve["task_accuracy"]) >= 1
    table = (tmp_path / "ev" / "table.md").read_text()
    assert "| running |" in table and "| batch |" in table and "±" in table
    assert (tmp_path / "ev" / "anytime_accuracy.png").stat().st_size > 10_000


def test_sweep_of_methods_with_mepo_writes_table1_ablation_and_reuses_cached_runs(tmp_path):
    import numpy as np

    torch.save(timm.create_model("test_vit", pretrained=False, num_classes=0).state_dict(), tmp_path / "w.pth")
    np.save(tmp_path / "cov.npy", np.eye(64))
    main(["backbone", "import", "--source", str(tmp_path / "w.pth"), "--out", str(tmp_path / "bundle"),
          "--name", "test_vit", "--covariance", str(tmp_path / "cov.npy")])
    args = ["evaluate", "--out", str(tmp_path / "sweep"), "--seeds", "1", "--methods", "misa,linear_probe",
            "--mepo", str(tmp_path / "bundle"), "--ablation", "true", *TINY, "--data.dataset", "cifar10",
            "--data.train_per_class", "10", "--data.test_per_class", "3", "--protocol.eval_period", "50"]
    main(args)
    result = json.loads((tmp_path / "sweep" / "results.json").read_text())
    done = sorted((r["method"], r["variant"]) for r in result["runs"])
    assert done == [("linear_probe", "host"), ("misa", "cov"), ("misa", "host"), ("misa", "mepo"), ("misa", "rep")]
    table = (tmp_path / "sweep" / "table.md").read_text()
    assert "| method | A_AUC w/o MePo | A_AUC w/ MePo |" in table and "**" in table
    assert "| linear_probe |" in table and "–" in table  # lower bounds run without MePo only
    assert "Meta Rep A_AUC" in (tmp_path / "sweep" / "ablation.md").read_text()
    assert "A_last ÷ probe w/o" in table and "Ceiling (offline linear probe" in table
    assert set(result["ceiling"]) == {"w/o Meta Rep", "Meta Rep"}  # one probe per backbone
    assert all(0 < r["ceiling"] <= 1 for r in result["runs"])
    cache = tmp_path / "sweep" / "cache"
    ceilings = sorted(p.name for p in cache.iterdir() if p.name.startswith("ceiling-"))
    cached = sorted(p.name for p in cache.iterdir() if not p.name.startswith("ceiling-"))
    assert len(cached) == 5 and len(ceilings) == 2
    marked = cache / cached[0]
    run = json.loads(marked.read_text())
    run["wall_time_s"] = -1.0  # a value no computation produces: it can only come from the cache
    marked.write_text(json.dumps(run))
    main(args)  # a re-run reuses every finished run
    rerun = json.loads((tmp_path / "sweep" / "results.json").read_text())["runs"]
    assert -1.0 in [r["wall_time_s"] for r in rerun] and len(rerun) == 5
    assert sorted(p.name for p in cache.iterdir()) == sorted(cached + ceilings)  # nothing computed again
