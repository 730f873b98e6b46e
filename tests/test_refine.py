"""Meta Rep: pseudo tasks, Reptile arithmetic, one meta-epoch end to end, resume, and torchrun DDP."""

import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from mepo_stream.artifacts import BundleError, load_part, load_sigma_pre, read_manifest
from mepo_stream.backbone import BackboneConfig, create_backbone
from mepo_stream.data import DataConfig
from mepo_stream.meta import group_mask, reptile_update
from mepo_stream.pseudo_tasks import PseudoTaskConfig, meta_epoch_plan
from offline.guard import GuardConfig
from offline.refine import PAPER_REFINE, CovarianceStage, ISAStage, RefineConfig, checkpoint_path, refine
from tests.helpers import TINY, color_folder

DATA = DataConfig(dataset="tinyimagenet-pretrain", train_per_class=4)
TASKS = PseudoTaskConfig(classes_per_group=20, n_tasks=4, samples_per_class=4, val_ratio=0.25)
LOOP = RefineConfig(mode="meta", meta_epochs=1, inner_epochs=1, batch_size=16)
GUARD = GuardConfig(per_class=2)
COV = CovarianceStage(data=DATA, batch_size=64)
NO_COV = replace(COV, skip=True)
CLI_ARGS = ["--adapt.skip", "true",
            "--backbone.name", "test_vit", "--backbone.weights", "null", "--backbone.img_size", "32",
            "--data.train_per_class", "4", "--tasks.classes_per_group", "20", "--tasks.n_tasks", "4",
            "--tasks.samples_per_class", "4", "--tasks.val_ratio", "0.25", "--loop.meta_epochs", "1",
            "--loop.inner_epochs", "1", "--loop.batch_size", "16", "--cov.skip", "true",
            "--loop.precision", "fp32", "--guard.per_class", "2"]  # fp32: DDP must match one process to 1e-5


def initial_backbone() -> dict[str, torch.Tensor]:
    """The random-init test_vit that refine starts from (it seeds with RefineConfig.seed = 1)."""
    torch.manual_seed(1)
    return create_backbone(TINY).state_dict()


def run_refine(out: Path, loop: RefineConfig = LOOP, **kw) -> Path:
    """Refine without the ISA stage (tests/test_isa.py covers it)."""
    kw = {"data": DATA, "tasks": TASKS, "guard": GUARD, "cov": COV, **kw}
    return refine(out, backbone=TINY, loop=loop, adapt=ISAStage(skip=True), **kw)


def test_pseudo_tasks_partition_each_group():
    targets = [c for c in range(40) for _ in range(10)]
    cfg = PseudoTaskConfig(classes_per_group=20, n_tasks=5, samples_per_class=8, val_ratio=0.25)
    plans = meta_epoch_plan(targets, cfg, seed=1, meta_epoch=3)
    assert len(plans) == 2 and not set(plans[0].classes) & set(plans[1].classes)
    for plan in plans:
        task_classes = [{targets[i] for i in task} for task in plan.tasks]
        assert all(len(c) == 4 for c in task_classes)  # 20 classes / 5 tasks
        assert all(not a & b for i, a in enumerate(task_classes) for b in task_classes[i + 1:])  # disjoint tasks
        seq = [i for task in plan.tasks for i in task]
        assert len(seq) == 20 * 6 and len(plan.joint) == 20 * 2  # 8 per class, gamma = 0.25 held out
        assert not set(seq) & set(plan.joint)
        assert {targets[i] for i in plan.joint} == set(plan.classes)
    assert plans == meta_epoch_plan(targets, cfg, seed=1, meta_epoch=3)
    assert plans != meta_epoch_plan(targets, cfg, seed=1, meta_epoch=4)


def test_pseudo_task_config_is_validated():
    with pytest.raises(ValueError, match="val_ratio"):
        meta_epoch_plan([0, 1], PseudoTaskConfig(1, 1, 1, 0.0), 1, 1)
    with pytest.raises(ValueError, match="n_tasks"):
        meta_epoch_plan([0, 1], PseudoTaskConfig(2, 3, 1, 0.5), 1, 1)


def test_reptile_arithmetic():
    theta0 = {"w": torch.randn(3, 3), "steps": torch.tensor(1)}
    theta_hat = {"w": torch.randn(3, 3), "steps": torch.tensor(5)}
    assert torch.equal(reptile_update(theta0, theta_hat, 0.0)["w"], theta0["w"])
    assert torch.equal(reptile_update(theta0, theta_hat, 1.0)["w"], theta_hat["w"])
    assert torch.allclose(reptile_update(theta0, theta_hat, 0.1)["w"], 0.9 * theta0["w"] + 0.1 * theta_hat["w"])


def test_group_mask_modes():
    logits, group = torch.tensor([[2.0, -1.0, 3.0]]), torch.tensor([0, 2])
    assert group_mask(logits, group, "multiply").tolist() == [[2.0, 0.0, 3.0]]  # the reference: 0, not -inf
    assert group_mask(logits, group, "neg_inf")[0, 1] == float("-inf")
    assert torch.equal(group_mask(logits, group, "none"), logits)


def test_one_meta_epoch_end_to_end_makes_a_bundle(tmp_path):
    before = initial_backbone()
    run_refine(tmp_path / "bundle")
    manifest = read_manifest(tmp_path / "bundle")
    assert manifest["meta_epochs_completed"] == 1 and manifest["refine"]["reptile_eps"] == 0.1
    assert manifest["refine"]["head"] == "mlp"  # no preset: the reference's head, recorded
    assert manifest["data"]["classes"][0] == "n01443537" and len(manifest["data"]["classes"]) == 100
    refined = create_backbone(BackboneConfig("test_vit", str(tmp_path / "bundle"), 32)).state_dict()
    assert not torch.equal(refined["blocks.0.attn.qkv.weight"], before["blocks.0.attn.qkv.weight"])
    assert not any(k.startswith("head") for k in load_part(tmp_path / "bundle", "backbone"))
    assert load_sigma_pre(tmp_path / "bundle").shape == (64, 64)
    with open(tmp_path / "bundle" / "sigma_pre.safetensors", "ab") as f:
        f.write(b"junk")
    with pytest.raises(BundleError, match="sha256"):
        load_sigma_pre(tmp_path / "bundle")


def test_eps_zero_leaves_the_backbone_unchanged(tmp_path):
    run_refine(tmp_path / "b", replace(LOOP, reptile_eps=0.0, freeze=()),
               cov=NO_COV)
    refined = load_part(tmp_path / "b", "backbone")
    assert all(torch.equal(v, refined[k]) for k, v in initial_backbone().items())


def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path):
    two = replace(LOOP, meta_epochs=2)
    run_refine(tmp_path / "straight", two, cov=NO_COV)
    run_refine(tmp_path / "resumed", LOOP, cov=NO_COV)  # "interrupted" after meta-epoch 1
    assert checkpoint_path(tmp_path / "resumed").is_file()
    run_refine(tmp_path / "resumed", two, cov=NO_COV, resume=True)
    assert read_manifest(tmp_path / "resumed")["meta_epochs_completed"] == 2
    a, b = load_part(tmp_path / "straight", "backbone"), load_part(tmp_path / "resumed", "backbone")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_torchrun_two_processes_match_one(tmp_path):
    """2 CPU ranks (gloo), each taking half of every batch, give the single-process weights to 1e-5."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    single = [sys.executable, "-m", "mepo_stream.cli", "refine", "--out", str(tmp_path / "one"), *CLI_ARGS]
    subprocess.run(single, check=True, env=env, capture_output=True)
    ddp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "mepo_stream.cli", "refine", "--out", str(tmp_path / "two"), *CLI_ARGS]
    proc = subprocess.run(ddp, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = load_part(tmp_path / "one", "backbone"), load_part(tmp_path / "two", "backbone")
    max_diff = max((one[k] - two[k]).abs().max().item() for k in one)
    assert max_diff < 1e-5
    start = initial_backbone()
    assert any(not torch.equal(one[k], start[k]) for k in one)  # it did train


@pytest.mark.parametrize("mode", ["finetune", "meta"])
def test_the_default_refine_leaves_the_patch_embedding_bit_identical(tmp_path, mode):
    before = initial_backbone()
    run_refine(tmp_path / "b", replace(RefineConfig(), mode=mode, meta_epochs=1, inner_epochs=1, batch_size=16))
    refined = load_part(tmp_path / "b", "backbone")
    stem = [k for k in before if k.startswith("patch_embed.")]
    assert stem and all(torch.equal(before[k], refined[k]) for k in stem)
    assert not torch.equal(before["blocks.0.attn.qkv.weight"], refined["blocks.0.attn.qkv.weight"])
    history = read_manifest(tmp_path / "b")["history"]
    assert history[0]["meta_epoch"] == 0 and set(history[0]["held_out"]) == {"probe", "lda"}
    assert history[1]["change"]["patch_embed"] == 0.0 and history[1]["change"]["blocks.0"] > 0


def test_freeze_names_must_exist(tmp_path):
    with pytest.raises(ValueError, match="no parameter under \\['patch_embd'\\]"):
        run_refine(tmp_path / "b", replace(LOOP, freeze=("patch_embd",)))


def test_the_guard_fires_when_the_patch_embedding_is_pushed(tmp_path, caplog):
    """Colour classes that the untouched backbone separates; a huge patch-embedding learning rate wrecks them."""
    data = DataConfig(dataset=str(color_folder(tmp_path / "colors")))
    tasks = PseudoTaskConfig(classes_per_group=4, n_tasks=2, samples_per_class=16, val_ratio=0.25)
    pushed = RefineConfig(freeze=(), lr_patch_embed=1e20, meta_epochs=3, batch_size=16, inner_epochs=1)
    guard = GuardConfig(per_class=None, stop=True)
    with caplog.at_level(logging.WARNING, logger="offline.guard"):
        run_refine(tmp_path / "b", pushed, data=data, tasks=tasks, guard=guard, cov=NO_COV)
    manifest = read_manifest(tmp_path / "b")
    base, first = manifest["history"][0]["held_out"]["probe"], manifest["history"][1]
    assert base >= 0.9 and first["held_out"]["probe"] < base - 0.01
    assert first["stopped_by_guard"] and manifest["meta_epochs_completed"] == 1  # stopped after 1 of 3
    assert "degrading the features" in caplog.text
    assert all(torch.equal(v, load_part(tmp_path / "b", "backbone")[k]) for k, v in initial_backbone().items())

    run_refine(tmp_path / "warn", replace(pushed, meta_epochs=2), data=data, tasks=tasks,
               guard=replace(guard, stop=False), cov=NO_COV)
    assert read_manifest(tmp_path / "warn")["meta_epochs_completed"] == 2  # warns only


def test_the_paper_recipe_file_is_the_reference_meta_rep(tmp_path):
    """``--config mepo_stream/recipes/refine_paper.yaml`` (the file behind ``--preset paper``) gives PAPER_REFINE:
    Meta Rep with nothing frozen."""
    recipe = Path(__file__).parents[1] / "mepo_stream" / "recipes" / "refine_paper.yaml"
    result = subprocess.run([sys.executable, "-m", "mepo_stream.cli", "refine", "--out", str(tmp_path),
                             "--config", str(recipe), "--print_config"], capture_output=True, text=True, check=True)
    printed = yaml.safe_load(result.stdout)["loop"]
    assert RefineConfig(**{**printed, "freeze": tuple(printed["freeze"])}) == PAPER_REFINE
    assert PAPER_REFINE.mode == "meta" and PAPER_REFINE.freeze == () and PAPER_REFINE.head == "mlp"
