"""MISA's initial session adaptation: the FAM update by hand, the bundle it writes, that it learns, bad inputs."""

from dataclasses import replace

import pytest
import torch

from mepo_stream.artifacts import load_part, read_manifest, write_bundle
from mepo_stream.cli import main
from mepo_stream.data import DataConfig, ImageSet
from mepo_stream.fam import FAM
from mepo_stream.methods import MethodsConfig
from mepo_stream.model import BundleParts, ModelConfig, create_model
from mepo_stream.pseudo_tasks import PseudoTaskConfig
from offline.covariance import CovarianceConfig, covariance
from offline.isa import ISAConfig, PoolBatches, build_host, class_split, isa, warm_prompts
from offline.refine import CovarianceStage, ISAStage, RefineConfig, refine
from tests.helpers import TINY, color_images

DATA = DataConfig(dataset="tinyimagenet-pretrain", train_per_class=4)
FAST = ISAConfig(epochs=1, online_iter=1, batch_size=32, autoaugment=None)
COV = CovarianceConfig(data=DATA, batch_size=64)
CLI_TINY = ["--backbone.name", "test_vit", "--backbone.weights", "null", "--backbone.img_size", "32"]
TASKS = PseudoTaskConfig(classes_per_group=20, n_tasks=4, samples_per_class=4, val_ratio=0.25)


def test_fam_two_steps_match_a_hand_computation():
    """Two scalar parameters (the norm is global over them), plain SGD as the base optimizer.

    w0 = (1, -2); out-of-session loss 3 w1 + 4 w2, gradient (3, 4), norm 5; rho = 2.5 moves to
    w0 + 2.5 (3, 4) / 5 = (2.5, 0). Current loss w1^2 + w2^2, gradient at the perturbed point (5, 0);
    restore w0 and step: (1, -2) - 0.25 (5, 0) = (-0.25, -2). Every number is exact in float32."""
    w1, w2 = torch.nn.Parameter(torch.tensor(1.0)), torch.nn.Parameter(torch.tensor(-2.0))
    frozen = torch.nn.Parameter(torch.tensor(7.0))  # no gradient: neither perturbed nor stepped
    fam = FAM(torch.optim.SGD([w1, w2, frozen], lr=0.25), rho=2.5)
    (3 * w1 + 4 * w2).backward()
    fam.first_step()
    assert (w1.item(), w2.item(), frozen.item()) == (2.5, 0.0, 7.0)
    assert w1.grad is None and w2.grad is None
    (w1**2 + w2**2).backward()
    assert (w1.grad.item(), w2.grad.item()) == (5.0, 0.0)
    fam.second_step()
    assert (w1.item(), w2.item(), frozen.item()) == (-0.25, -2.0, 7.0)  # w2 restored, not left at 0
    with pytest.raises(RuntimeError, match="without first_step"):
        fam.second_step()


def test_class_split_and_pool_draws():
    tasks, pool = class_split(100, ISAConfig())
    assert pool == list(range(90, 100)) and len(tasks) == 10
    assert tasks[0] == list(range(9)) and tasks[-1] == list(range(81, 90))  # consecutive classes, MISA's n > 100
    targets = torch.arange(10).repeat_interleave(5)  # classes 0-9, 5 images each
    draws = PoolBatches(targets, [7, 8, 9], ISAConfig(pool_draw=1, redraw_prob=1.0), torch.Generator().manual_seed(0))
    batches = [draws.next(4) for _ in range(6)]
    assert [len(b) for b in batches] == [4, 1] * 3  # a draw's 5 images, then a new draw
    assert all(len(set(targets[b].tolist())) == 1 for b in batches)  # one class per draw
    with pytest.raises(ValueError, match="pool_classes"):
        class_split(10, ISAConfig(pool_classes=10))


def test_isa_writes_prompts_a_learner_starts_from(tmp_path):
    covariance(tmp_path / "b", backbone=TINY, cov=COV)  # an existing bundle: Sigma_pre only
    before = read_manifest(tmp_path / "b")
    main(["isa", "--mepo", str(tmp_path / "b"), *CLI_TINY, "--data.train_per_class", "4", "--adapt.epochs", "1",
          "--adapt.online_iter", "1", "--adapt.autoaugment", "null"])
    manifest = read_manifest(tmp_path / "b")  # verifies every hash, prompts.safetensors included
    assert set(manifest["files"]) == {"sigma_pre.safetensors", "prompts.safetensors"}
    assert manifest["files"]["sigma_pre.safetensors"] == before["files"]["sigma_pre.safetensors"]
    assert manifest["covariance"] == before["covariance"] and manifest["kind"] == "covariance"
    record = manifest["isa"]
    assert record["lr"] == FAST.lr and record["backbone"]["name"] == "test_vit" and record["steps"] > 0
    assert len(record["pool_classes_names"]) == 10 and sum(len(t) for t in record["session_tasks"]) == 90
    prompts = load_part(tmp_path / "b", "prompts")
    learner = create_model(ModelConfig("misa", backbone=TINY, mepo=BundleParts.of(tmp_path / "b")), 100)
    assert learner.initial_prompts().keys() == prompts.keys()
    assert all(torch.equal(learner.initial_prompts()[k], prompts[k]) for k in prompts)
    assert prompts["e_prompt"].shape == (10, 3, 20, 64)  # the whole keyed pool, every slot warmed


def color_set(per_class: int = 8, n_classes: int = 8) -> ImageSet:
    targets = torch.arange(n_classes).repeat_interleave(per_class)
    return ImageSet(color_images(targets), targets, [f"c{i}" for i in range(n_classes)],
                    [f"c{i}" for i in range(n_classes)])


def test_isa_changes_the_prompts_and_lowers_the_loss():
    cfg = ISAConfig(pool_classes=2, n_tasks=1, epochs=6, online_iter=1, batch_size=16, autoaugment=None)
    host = build_host(8, cfg, "misa", MethodsConfig(), TINY, None)
    start = {k: v.detach().cpu().clone() for k, v in host.initial_prompts().items()}  # warm_prompts's are on the CPU
    result = warm_prompts(host, color_set(), cfg)
    assert all(not torch.equal(result.prompts[k], start[k]) for k in start)
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0], losses


def test_clear_errors(tmp_path):
    write_bundle(tmp_path / "bad", {"prompts": {"g_prompt": torch.zeros(1, 2, 5, 64), "e_prompt": torch.zeros(
        10, 3, 20, 64), "e_keys": torch.zeros(10, 64)}}, {"kind": "isa"})
    with pytest.raises(ValueError, match="g_prompt.*another layout or backbone"):
        create_model(ModelConfig("misa", backbone=TINY, mepo=BundleParts.of(tmp_path / "bad")), 10)
    with pytest.raises(ValueError, match="not a prompt-based host"):
        isa(out=tmp_path / "x", backbone=TINY, data=DATA, adapt=FAST, method="linear_probe")
    covariance(tmp_path / "cov", backbone=TINY, cov=COV)
    with pytest.raises(ValueError, match="img_size 32, not 48"):
        isa(mepo=tmp_path / "cov", backbone=replace(TINY, img_size=48), data=DATA, adapt=FAST)


def test_refine_ends_with_the_isa_stage_unless_skipped(tmp_path):
    loop = RefineConfig(meta_epochs=1, inner_epochs=1, batch_size=16)
    for skip in (False, True):
        refine(tmp_path / f"b{skip}", backbone=TINY, data=DATA, tasks=TASKS, loop=loop, cov=CovarianceStage(skip=True),
               adapt=ISAStage(epochs=1, online_iter=1, autoaugment=None, skip=skip))
    manifest = read_manifest(tmp_path / "bFalse")
    assert set(manifest["files"]) == {"backbone.safetensors", "prompts.safetensors"}
    assert manifest["kind"] == "refined" and manifest["meta_epochs_completed"] == 1 and "skip" not in manifest["isa"]
    assert manifest["isa"]["backbone"]["weights_sha256"] == manifest["files"]["backbone.safetensors"]["sha256"]
    assert set(read_manifest(tmp_path / "bTrue")["files"]) == {"backbone.safetensors"}
