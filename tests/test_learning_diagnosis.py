"""The learning diagnosis keeps running and counts what it claims to count (tiny ViT, a 100-image CIFAR stream)."""

import json
from dataclasses import replace

import pytest
import torch

from benchmarks.experiments.learning_diagnosis import features, main, predict_cached
from mepo_stream.anytime import stream_batches
from mepo_stream.backbone import BackboneConfig
from mepo_stream.data import DataConfig, load_split
from mepo_stream.learner import PAPER_RECIPE, LearnerConfig
from mepo_stream.sampler import si_blurry_stream
from tests.helpers import color_images, learner_of

TINY = BackboneConfig(name="test_vit", weights=None, img_size=32)
DATA = DataConfig("cifar10", train_per_class=10, test_per_class=5)


def test_diagnosis_writes_every_measure_and_counts_single_class_batches_from_the_stream(tmp_path):
    out, png = tmp_path / "diag.json", tmp_path / "diag.png"
    result = main(data=DATA, backbone=TINY, eval_period=25, out=out, plot_path=png)
    assert json.loads(out.read_text())["benchmark"] == "learning_diagnosis" and png.stat().st_size > 0
    assert {"stream", "runs", "features", "adam", "prompt_init", "machine"} <= set(result)
    assert set(result["runs"]) == {"paper_recipe", "default"}
    head = result["runs"]["paper_recipe"]["head"]
    assert {"weight_norm", "bias", "shared_logit", "discriminative_std", "zero_grad_moving_steps",
            "shared_drift_from_zero_grad_steps"} <= set(head)
    assert head["adam_steps"] == result["stream"]["batches"] * PAPER_RECIPE.online_iter
    for run in result["runs"].values():
        assert run["anytime"] and len(run["per_class_end"]) == 10

    targets = load_split(DATA, "train").targets
    tasks = si_blurry_stream(targets.tolist(), seed=1).tasks
    batches = stream_batches(tasks, 32, eval_period=25)  # cut at every task's end and every 25th sample
    starts = [sum(map(len, batches[:i])) for i in range(len(batches))]
    assert all(s // 25 == (s + len(b) - 1) // 25 and len(b) <= 32 for s, b in zip(starts, batches, strict=True))
    assert sum(map(len, batches)) == len(targets)
    single = sum(len(set(targets[b].tolist())) == 1 for b in batches)
    assert result["stream"]["batches"] == len(batches)
    assert result["stream"]["single_class_batches"] == single
    assert result["stream"]["single_class_share"] == pytest.approx(single / len(batches))
    assert result["runs"]["paper_recipe"]["zero_loss_batches"] == single  # batch mask: one class, loss exactly 0
    assert {"mean_norm", "mean_share_of_energy", "different_class_raw", "different_class_centred"} <= set(
        result["features"])
    assert result["prompt_init"]["norm_ratio"] > 0 and -1 <= result["prompt_init"]["cosine_to_plain_mean"] <= 1


@pytest.mark.parametrize("method,cfg", [("linear_probe", PAPER_RECIPE), ("frozen", LearnerConfig())])
def test_predictions_from_cached_features_are_the_learners_own(method, cfg):
    """The diagnosis evaluates on features computed once; that must be what ``learner.predict`` answers."""
    learner = learner_of(method, replace(cfg, autoaugment=None))
    for labels in (torch.tensor([0, 1] * 8), torch.tensor([2, 1, 3, 3] * 4)):
        learner.observe(color_images(labels), labels)
    images = color_images(torch.arange(4).repeat(6))
    feats = features(learner.method, images)
    assert torch.equal(predict_cached(learner, feats), learner.predict(images)["running"])
