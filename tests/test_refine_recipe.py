"""The fine-tuning recipe of the presets: layer-wise learning rates, the schedule, per-image crops, a lower
training resolution than the bundle's, and presets that yield to the options a user gives."""

import inspect
import json
import signal
from dataclasses import replace

import pytest
import torch
import yaml

from benchmarks.experiments.refine_frontier import recipe, refine_seed_groups
from mepo_stream.artifacts import load_part, read_manifest
from mepo_stream.backbone import BackboneConfig, create_backbone
from mepo_stream.cli import given_options, main
from mepo_stream.data import load_split
from mepo_stream.errors import ConfigError
from mepo_stream.meta import CosineHead
from mepo_stream.pseudo_tasks import PseudoTaskConfig
from mepo_stream.recipes import given, layer
from mepo_stream.shutdown import Stopped
from mepo_stream.transforms import RandomResizedCropFlip
from offline.optim import create_optimizer, layer_scales, param_groups
from offline.presets import PRESETS, apply_preset
from offline.presets import recipe as preset_recipe
from offline.refine import Distributed, ISAStage, MetaModel, RefineConfig, Trainer, checkpoint_path, refine
from tests.helpers import ROOT, TINY
from tests.test_refine import CLI_ARGS, DATA, GUARD, NO_COV, TASKS, initial_backbone, run_refine

RECIPE = RefineConfig(mode="finetune", meta_epochs=1, inner_epochs=1, batch_size=16, optimizer="adamw",
                      lr_backbone=1e-3, lr_head=1e-2, layer_decay=0.75, weight_decay=0.05, schedule="cosine",
                      warmup=0.2, label_smoothing=0.1, augment="image", low_res=0.5, train_img_size=16)


def test_adamw_is_the_fused_kernel_on_the_cpu_and_steps_as_the_unfused_one():
    """The fused AdamW (one kernel per tensor) is chosen on the CPU, and takes the same step as the reference one."""
    torch.manual_seed(0)
    weights, grad = [torch.randn(8, 4, requires_grad=True) for _ in range(2)], torch.randn(8, 4)
    fused = create_optimizer([{"params": [weights[0]], "lr": 1e-2, "weight_decay": 0.05}], "adamw", 0.9)
    plain = torch.optim.AdamW([{"params": [weights[1]], "lr": 1e-2, "weight_decay": 0.05}], foreach=False)
    weights[1].data.copy_(weights[0].data)
    for opt, w in ((fused, weights[0]), (plain, weights[1])):
        for _ in range(3):
            w.grad = grad.clone()
            opt.step()
    assert fused.defaults["fused"] is True
    torch.testing.assert_close(weights[0], weights[1])


def test_layer_decay_trains_the_top_fastest_and_decays_matrices_only():
    vit = create_backbone(TINY)
    vit.patch_embed.requires_grad_(False)
    head = torch.nn.Linear(vit.num_features, 3)
    groups = param_groups(vit, head, 1e-3, 1e-2, 0.5, 0.05)
    lr_of = {id(p): (g["lr"], g["weight_decay"]) for g in groups for p in g["params"]}
    named = dict(vit.named_parameters())
    assert not any(id(p) in lr_of for p in vit.patch_embed.parameters())  # frozen: in no group
    blocks = [lr_of[id(named[f"blocks.{i}.attn.qkv.weight"])][0] for i in range(len(vit.blocks))]
    assert blocks == sorted(blocks) and blocks[-1] == pytest.approx(1e-3 * 0.5)  # one step below the norm
    assert lr_of[id(named["norm.weight"])] == (1e-3, 0.0)  # the top at the full rate; a vector: no decay
    assert lr_of[id(named["pos_embed"])][0] == pytest.approx(1e-3 * 0.5 ** (len(vit.blocks) + 1))
    assert lr_of[id(named["blocks.0.mlp.fc1.weight"])][1] == 0.05 and lr_of[id(head.weight)] == (1e-2, 0.0)
    assert layer_scales(vit, 1.0) == [1.0] * len(named)  # no decay: the paper's single rate


def test_each_image_gets_its_own_crop_and_a_whole_crop_keeps_the_image():
    torch.manual_seed(0)
    img = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8).expand(8, -1, -1, -1)
    out = RandomResizedCropFlip(16, (0.5,) * 3, (0.5,) * 3)(img)  # [8, 3, 16, 16]
    assert out.shape == (8, 3, 16, 16)
    assert len({tuple(o.flatten()[:20].tolist()) for o in out}) == 8  # eight crops of one image, all different
    ramp = (torch.arange(32) * 8).to(torch.uint8).expand(16, 3, 32, 32)  # a horizontal ramp, 0 to 248
    whole = RandomResizedCropFlip(32, (0.0,) * 3, (1.0,) * 3, scale=(1.0, 1.0), ratio=(1.0, 1.0))(ramp)
    inner = ramp[0].float()[..., 2:-2] / 255  # bilinear sampling keeps a linear ramp exactly, off its borders
    kept = [torch.allclose(w[..., 2:-2], inner, atol=1e-5) for w in whole]
    flipped = [torch.allclose(w.flip(-1)[..., 2:-2], inner, atol=1e-5) for w in whole]
    assert all(k or f for k, f in zip(kept, flipped, strict=True)) and any(kept) and any(flipped)


def test_a_lower_training_resolution_writes_the_bundle_at_its_own(tmp_path):
    """Trained on 16-px images (1 x 1 patches), the bundle is written at 32 px (2 x 2): the position table the
    forward pass resampled is the one that trained, and the bundle loads at 32 px as it is."""
    out = run_refine(tmp_path / "r", RECIPE, cov=NO_COV)
    refined, start = load_part(out, "backbone"), initial_backbone()
    assert refined["pos_embed"].shape == start["pos_embed"].shape == (1, 1 + 4, 64)
    assert not torch.equal(refined["pos_embed"], start["pos_embed"])
    assert torch.equal(refined["patch_embed.proj.weight"], start["patch_embed.proj.weight"])  # the stem frozen
    assert read_manifest(out)["backbone"]["img_size"] == 32
    create_backbone(BackboneConfig(name="test_vit", weights=str(out), img_size=32))


def test_a_training_resolution_off_the_patch_grid_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="train_img_size 20"):
        run_refine(tmp_path / "r", replace(RECIPE, train_img_size=20), cov=NO_COV)
    assert not (tmp_path / "r").exists()


def test_resume_continues_the_schedule_and_the_crops_exactly(tmp_path, monkeypatch):
    """A run stopped by SIGINT after its first of two meta-epochs, then resumed, ends where a straight run does:
    the cosine schedule spans both (a run configured for one would have decayed to 0 already)."""
    two = replace(RECIPE, meta_epochs=2)
    run_refine(tmp_path / "straight", two, cov=NO_COV)
    epoch = Trainer.run_epoch

    def stopped_after_the_first(self, n, tasks):
        result = epoch(self, n, tasks)
        if n == 1:
            signal.raise_signal(signal.SIGINT)  # held by the refine until meta-epoch 1 is checkpointed
        return result

    with monkeypatch.context() as m, pytest.raises(Stopped):
        m.setattr(Trainer, "run_epoch", stopped_after_the_first)
        run_refine(tmp_path / "resumed", two, cov=NO_COV)
    assert checkpoint_path(tmp_path / "resumed").is_file() and not (tmp_path / "resumed").exists()
    run_refine(tmp_path / "resumed", two, cov=NO_COV, resume=True)
    a, b = load_part(tmp_path / "straight", "backbone"), load_part(tmp_path / "resumed", "backbone")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_cosine_head_trains_the_backbone_and_stays_out_of_the_bundle(tmp_path):
    """--loop.head cosine: the refine trains through a scaled-cosine head (its logits bounded by --loop.head_scale,
    whatever the feature's norm), the backbone moves, and the bundle holds the backbone alone."""
    cosine = replace(RECIPE, head="cosine", head_scale=8.0)
    trainer = Trainer.create(TINY, load_split(DATA, "train"), cosine, Distributed())
    assert isinstance(trainer.model.head, CosineHead)
    logits = trainer.model.head(100 * torch.randn(5, trainer.model.backbone.num_features))  # [5, 100]
    assert logits.abs().max() <= 8.0 + 1e-4 and logits.abs().max() > 1.0
    out = run_refine(tmp_path / "r", cosine, cov=NO_COV)
    refined, start = load_part(out, "backbone"), initial_backbone()
    assert set(refined) == set(start) and not torch.equal(refined["blocks.1.mlp.fc2.weight"],
                                                          start["blocks.1.mlp.fc2.weight"])
    assert read_manifest(out)["refine"]["head"] == "cosine"
    with pytest.raises(ValueError, match="unknown training head 'linear'; choose from mlp, cosine"):
        MetaModel(trainer.model.backbone, 3, "linear")


def test_a_preset_sets_what_the_caller_did_not_give(tmp_path):
    loop, _ = apply_preset("demo", RefineConfig(lr_backbone=3e-4, train_img_size=32), PseudoTaskConfig())
    assert (loop.optimizer, loop.schedule, loop.lr_backbone, loop.train_img_size) == ("adamw", "cosine", 3e-4, 32)
    assert apply_preset("best", RefineConfig(), PseudoTaskConfig())[1].samples_per_class == 250
    paper, _ = apply_preset("paper", RefineConfig(), PseudoTaskConfig())
    assert (paper.mode, paper.freeze, paper.optimizer, paper.head) == ("meta", (), "sgd", "mlp")
    heads = {h: apply_preset("best", RefineConfig() if h is None else RefineConfig(head=h), TASKS)[0].head
             for h in (None, "mlp")}
    assert heads == {None: "cosine", "mlp": "mlp"}  # the reference's head, given at its default, stays
    assert given(RefineConfig(head="mlp")) == {"head"} and given(replace(RefineConfig(), head="mlp")) >= {"mode"}
    with pytest.raises(ValueError, match="unknown fields"):
        layer(RefineConfig(), {"lr": 1.0})
    out = refine(tmp_path / "p", backbone=TINY, data=DATA, tasks=replace(TASKS, samples_per_class=5),
                 loop=RefineConfig(train_img_size=16, batch_size=16, inner_epochs=2, steps=3), guard=GUARD,
                 cov=NO_COV, adapt=ISAStage(skip=True), preset="demo")
    manifest = read_manifest(out)
    assert manifest["preset"] == "demo" and manifest["refine"]["head"] == "cosine"
    assert manifest["refine"]["optimizer"] == "adamw" and manifest["refine"]["inner_epochs"] == 2
    assert manifest["pseudo_tasks"]["samples_per_class"] == 5
    assert (manifest["refine"]["steps"], manifest["refine"]["minutes"]) == (3, None)  # the user's budget, alone


def test_a_preset_that_can_set_nothing_says_so(caplog):
    """A config made by ``dataclasses.replace`` gives every field, so a preset layered under it sets nothing: the
    refine warns instead of dropping the preset silently."""
    with caplog.at_level("WARNING", logger="offline.presets"):
        loop, tasks = apply_preset("best", replace(RefineConfig(), seed=2), PseudoTaskConfig())
    assert (loop.head, tasks.samples_per_class) == ("mlp", 250)
    assert "--preset best sets nothing of --loop" in caplog.text and "of --tasks" not in caplog.text


def test_from_python_a_preset_gives_the_same_refine_as_on_the_command_line(tmp_path):
    """``refine(preset="best", ...)`` and ``mepo refine --preset best ...`` with the same options given (one of them
    at its default, which the preset changes): the same recipe, the same bundle."""
    options = {"head": "mlp", "train_img_size": 16, "batch_size": 16, "steps": 2, "precision": "fp32"}
    main(["refine", "--preset", "best", "--out", str(tmp_path / "cli"), *CLI_ARGS,
          *[a for k, v in options.items() for a in (f"--loop.{k}", str(v))]])
    cli_tasks = PseudoTaskConfig(classes_per_group=20, n_tasks=4, samples_per_class=4, val_ratio=0.25)
    python = refine(tmp_path / "py", backbone=TINY, data=DATA, tasks=cli_tasks, guard=GUARD,
                    loop=RefineConfig(meta_epochs=1, inner_epochs=1, **options), cov=NO_COV,
                    adapt=ISAStage(skip=True), preset="best")
    ran = {name: read_manifest(out) for name, out in (("cli", tmp_path / "cli"), ("python", python))}
    for part in ("refine", "pseudo_tasks", "preset"):
        assert ran["cli"][part] == ran["python"][part]
    assert (ran["python"]["refine"]["head"], ran["python"]["refine"]["optimizer"]) == ("mlp", "adamw")
    a, b = load_part(tmp_path / "cli", "backbone"), load_part(python, "backbone")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_each_presets_values_live_in_its_recipe_files_alone():
    """Balanced and demo are best's recipe with another budget (and demo fewer images): a later file's budget
    replaces the earlier one's whole."""
    best, demo = preset_recipe("best"), preset_recipe("demo")
    assert {k: v for k, v in demo["loop"].items() if k != "minutes"} == {
        k: v for k, v in best["loop"].items() if k != "meta_epochs"}
    assert (demo["loop"]["minutes"], best["loop"]["meta_epochs"], preset_recipe("balanced")["loop"]["meta_epochs"]) \
        == (2.5, 4, 2)
    assert set(PRESETS) == {"demo", "balanced", "best", "paper"}


def test_a_budget_in_minutes_is_repeated_exactly_by_the_steps_it_bought(tmp_path, caplog):
    """``--loop.minutes``: throwaway steps timed first set the steps, which the manifest records; a run given those
    steps is bit for bit the same run (so the timing steps left nothing behind: weights, moments, RNG)."""
    with caplog.at_level("INFO", logger="offline.refine"):
        timed = run_refine(tmp_path / "timed", replace(RECIPE, minutes=0.02), cov=NO_COV)
    loop = read_manifest(timed)["refine"]
    assert loop["minutes"] == 0.02 and loop["steps"] >= 1
    assert f"buys {loop['steps']} steps" in caplog.text and "bought them on this machine" in caplog.text
    again = run_refine(tmp_path / "again", replace(RECIPE, steps=loop["steps"]), cov=NO_COV)
    a, b = load_part(timed, "backbone"), load_part(again, "backbone")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_step_budget_spans_the_meta_epochs_it_needs_and_cuts_the_last(tmp_path):
    """400 images a meta-epoch in batches of 16: 25 steps each, so 30 steps are one meta-epoch and 5 steps of a
    second, and the schedule spans exactly those 480 images; the same run as 30 steps of meta-epochs of 30."""
    out = run_refine(tmp_path / "r", replace(RECIPE, steps=30), cov=NO_COV)
    manifest = read_manifest(out)
    assert (manifest["refine"]["steps"], manifest["meta_epochs_completed"]) == (30, 2)
    assert manifest["refine_images"] == 480
    passes = read_manifest(run_refine(tmp_path / "p", replace(RECIPE, meta_epochs=2), cov=NO_COV))["refine"]
    assert passes["steps"] == 50  # a budget of meta-epochs is recorded as its steps too


@pytest.mark.parametrize("loop,message", [
    (replace(RECIPE, mode="meta", minutes=1.0), "runs whole meta-epochs"),
    (replace(RECIPE, steps=0), "must be positive"),
])
def test_a_budget_the_loop_cannot_keep_is_refused(tmp_path, loop, message):
    with pytest.raises(ConfigError, match=message):
        run_refine(tmp_path / "r", loop, cov=NO_COV)


def test_the_demo_presets_budget_is_minutes_unless_the_user_gives_one():
    given_loops = {"none": RefineConfig(), "passes": RefineConfig(meta_epochs=1), "steps": RefineConfig(steps=7),
                   "default": RefineConfig(meta_epochs=5)}
    budgets = {name: apply_preset("demo", loop, PseudoTaskConfig())[0] for name, loop in given_loops.items()}
    assert budgets["none"].minutes == preset_recipe("demo")["loop"]["minutes"]
    assert (budgets["passes"].meta_epochs, budgets["passes"].minutes) == (1, None)
    assert (budgets["steps"].steps, budgets["steps"].minutes) == (7, None)
    assert budgets["default"].minutes is None  # --preset demo --loop.meta_epochs 5: five passes, as given


def test_on_the_command_line_a_typed_option_wins_over_the_preset_even_at_its_default(tmp_path):
    """``--preset demo --loop.label_smoothing 0``: 0 is the field's default and the preset's is 0.1, but the user
    typed it, so it holds; the fields not typed (the optimizer, the head) take the preset's."""
    main(["refine", "--preset", "demo", "--out", str(tmp_path / "b"), *CLI_ARGS, "--loop.train_img_size", "16",
          "--loop.label_smoothing", "0"])
    loop = read_manifest(tmp_path / "b")["refine"]
    assert (loop["label_smoothing"], loop["optimizer"], loop["head"]) == (0.0, "adamw", "cosine")
    assert loop["batch_size"] == 16  # typed off its default: as before


def test_a_config_files_fields_hold_over_the_preset_as_typed_options_do(tmp_path):
    """``--config FILE --preset demo`` and ``--loop FILE --preset demo``: the file's values (one of them at its
    default) hold over the preset's, and the fields it leaves out take the preset's."""
    whole, group = tmp_path / "whole.yaml", tmp_path / "loop.yaml"
    whole.write_text(yaml.safe_dump({"loop": {"lr_head": 0.05, "label_smoothing": 0.0}}))
    group.write_text(yaml.safe_dump({"lr_head": 0.05, "label_smoothing": 0.0}))
    assert given_options(["refine", "--config", str(whole), f"--loop={group}"]) == {
        "loop.lr_head", "loop.label_smoothing"}
    for name, option in (("whole", ["--config", str(whole)]), ("group", ["--loop", str(group)])):
        main(["refine", *option, "--preset", "demo", "--out", str(tmp_path / name), *CLI_ARGS,
              "--loop.train_img_size", "16"])
        loop = read_manifest(tmp_path / name)["refine"]
        assert (loop["lr_head"], loop["label_smoothing"], loop["optimizer"], loop["head"]) == (
            0.05, 0.0, "adamw", "cosine"), name


def test_the_presets_help_quotes_the_measured_frontier():
    """``mepo refine --help`` says what each preset measured: the numbers are the means over the refine seeds of
    ``benchmarks/results/refine_frontier.json`` (demo: the cosine_demo arms; balanced and best: 2 and 4 passes of
    the cosine arms, the presets' recipe), as ``refine_seed_groups`` pools them."""
    result = json.loads((ROOT / "benchmarks" / "results" / "refine_frontier.json").read_text())
    pooled = {(g["arm"], g["budget"]): g for g in refine_seed_groups(result["points"], ["T", "C"])}
    cpus = {p["refine"]["cpus"] for p in result["points"]
            if recipe(p["arm"]) in ("cosine_demo", "cosine") and p["refine"]}
    assert len(cpus) == 1
    cores, text = cpus.pop(), " ".join(inspect.getdoc(refine).split())
    for name, key in {"demo": ("cosine_demo", 1), "balanced": ("cosine", 2), "best": ("cosine", 4)}.items():
        g = pooled[key]
        assert len(g["arms"]) == 3
        images = key[1] * 100 * preset_recipe(name)["tasks"]["samples_per_class"]
        minutes = preset_recipe(name)["loop"].get("minutes")  # minutes: the frontier measured 1 pass
        budget = "" if minutes is None else f"{minutes:g} minutes of training; at "
        claim = (f"{name} ({budget}{images:,} images, {g['minutes']:.1f} min on {cores} cores: "
                 f"{100 * g['T']['a_last'][0]:.1f} / {100 * g['C']['a_last'][0]:.1f} %)")
        assert claim in text
