import copy
from dataclasses import replace

import pytest
import torch

from mepo_stream.alignment import AlignmentConfig
from mepo_stream.errors import ConfigError
from mepo_stream.learner import PAPER_RECIPE, LearnerConfig, OnlineLearner
from mepo_stream.model import ModelConfig, create_model
from mepo_stream.precision import native_bf16, resolve_precision
from tests.helpers import TINY, color_images, learner_of, sigma_file

# the MISA tests run the paper's recipe (the SGD-trained linear head), where these mechanisms matter
CFG = replace(PAPER_RECIPE, batch_size=16, online_iter=3, lr=5e-3, samples_per_slot=10_000, autoaugment=None)


def make_learner(n_classes=8, cov=None, alpha=0.7, cfg=CFG):
    return learner_of("misa", cfg, n_classes, cov, AlignmentConfig(alpha=alpha))


def accuracy(learner, labels, mode="running"):
    return (learner.predict(color_images(labels), (mode,))[mode] == labels).float().mean().item()


@pytest.mark.parametrize("with_cov", [False, True])
def test_learner_learns_a_stream_in_one_pass(tmp_path, with_cov):
    learner = make_learner(cov=sigma_file(tmp_path, torch.eye(64)) if with_cov else None, alpha=0.5)
    g = torch.Generator().manual_seed(1)
    stream = torch.randint(0, 4, (320,), generator=g)
    test = torch.arange(4).repeat(16)
    losses = []
    for start in range(0, len(stream), 16):
        y = stream[start:start + 16]
        losses.append(learner.observe(color_images(y), y))
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4
    assert accuracy(learner, test) > 0.9  # chance is 0.25
    assert learner.samples_seen == 320 and sorted(learner.exposed) == [0, 1, 2, 3]


def test_labels_are_remapped_by_first_appearance():
    learner = make_learner()
    learner.observe(color_images(torch.tensor([5, 2, 5])), torch.tensor([5, 2, 5]))
    learner.observe(color_images(torch.tensor([7, 2])), torch.tensor([7, 2]))
    assert learner.exposed == [5, 2, 7]
    with pytest.raises(ValueError, match="outputs"):
        make_learner(n_classes=2).observe(color_images(torch.tensor([0, 1, 3])), torch.tensor([0, 1, 3]))


def test_backbone_stays_frozen_and_only_the_slot_prompt_trains():
    learner = make_learner(cfg=replace(CFG, batch_size=8, samples_per_slot=8))
    before = {k: v.clone() for k, v in learner.method.state_dict().items()}
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    learner.observe(color_images(y), y)  # slot 0
    learner.observe(color_images(y), y)  # slot 1
    after = learner.method.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("backbone."))
    changed = [i for i in range(10) if not torch.equal(before["e_prompt.prompts"][i], after["e_prompt.prompts"][i])]
    assert changed == [0, 1]  # the reference's index bug would only ever train prompts[0]
    keys_changed = [i for i in range(10) if not torch.equal(before["e_prompt.keys"][i], after["e_prompt.keys"][i])]
    assert keys_changed == [0, 1]


def test_batch_mask_only_trains_present_classes():
    learner = make_learner()
    bias_before = learner.method.head.bias.detach().clone()
    y = torch.tensor([3, 3, 1, 1])
    learner.observe(color_images(y), y)
    moved = (learner.method.head.bias.detach() != bias_before).nonzero().squeeze(1).tolist()
    assert moved == [0, 1]  # head outputs of the two classes seen (remapped 3 -> 0, 1 -> 1)


def test_seen_class_eval_mask_never_predicts_unseen_outputs():
    learner = make_learner(cfg=replace(CFG, eval_mask="seen"))
    y = torch.tensor([4, 6])
    learner.observe(color_images(y), y)
    preds = learner.predict(color_images(torch.arange(8)), ("batch",))["batch"]
    assert set(preds.tolist()) <= {4, 6}


def test_state_round_trip_continues_identically(tmp_path):
    y = torch.tensor([0, 1, 2, 3] * 4)
    cov = sigma_file(tmp_path, torch.eye(64))
    a = make_learner(cov=cov, alpha=0.5)
    a.observe(color_images(y), y)
    b = make_learner(cov=cov, alpha=0.5)
    b.load_state_dict(a.state_dict())
    assert b.exposed == a.exposed and b.samples_seen == 16
    torch.manual_seed(5)
    a.observe(color_images(y), y)
    torch.manual_seed(5)
    b.observe(color_images(y), y)
    # equal up to float summation order, which Adam can amplify to about one step (lr 5e-3) on tiny gradients;
    # a learner that had not restored the state would differ by the init scale (~0.5)
    for k, v in a.method.state_dict().items():
        assert torch.allclose(v, b.method.state_dict()[k], atol=1e-2), k


def test_snapshot_is_isolated_from_further_learning(tmp_path):
    from server.snapshot import take_snapshot

    learner = make_learner(cov=sigma_file(tmp_path, torch.eye(64)))
    y = torch.tensor([0, 1, 2, 3] * 4)
    learner.observe(color_images(y), y)
    snap = take_snapshot(learner, version=1)
    images = color_images(y)
    before = snap.probabilities(images)
    learner.observe(images, y)
    assert torch.equal(snap.probabilities(images), before)  # the snapshot did not move
    assert snap.model.backbone is learner.method.backbone  # the frozen backbone is shared, not copied
    one = snap.probabilities(images[:1])[0]
    assert torch.allclose(one, before[0], atol=1e-5)  # non-transductive: alone or in a batch, same answer
    top = snap.top_k(snap.probabilities(images[:2]), 2)
    assert len(top) == 2 and len(top[0]) == 2 and {lbl for lbl, _ in top[0]} <= {0, 1, 2, 3}


def colour_stream(learner: OnlineLearner, n: int = 128) -> None:
    stream = torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(2))
    for y in stream.split(16):
        learner.observe(color_images(y), y)


def test_default_frozen_host_learns_by_statistics_without_gradient_steps():
    learner = learner_of("frozen", LearnerConfig(autoaugment=None))
    head_before = learner.method.head.weight.detach().clone()
    colour_stream(learner)
    assert not learner.trains_by_gradient and not learner.optimizer.state  # no Adam step was ever taken
    assert torch.equal(learner.method.head.weight, head_before)
    assert accuracy(learner, torch.arange(4).repeat(8)) > 0.9


def test_bf16_autocast_learns_like_fp32():
    """--learner.precision bf16 (autocast of the backbone; statistics stay fp64) keeps the accuracy."""

    learners = {p: learner_of("frozen", LearnerConfig(autoaugment=None, precision=p)) for p in ("fp32", "bf16")}
    for learner in learners.values():
        colour_stream(learner)
    assert learners["bf16"].dtype == torch.bfloat16 and learners["fp32"].dtype == torch.float32
    assert learners["bf16"].method.classifier.sums.dtype == torch.float64
    test = torch.arange(4).repeat(8)
    assert accuracy(learners["bf16"], test) >= accuracy(learners["fp32"], test) - 0.1


def test_auto_precision_is_fp32_where_onednn_is_capped_below_bf16(monkeypatch):
    """``ONEDNN_MAX_CPU_ISA=AVX2`` keeps oneDNN off bf16 hardware, so ``auto`` must not pick bf16 there: that is how a
    bf16 machine acts like a CPU without it (docs/performance.md)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert resolve_precision("auto", torch.device("cpu")) == torch.float32
    assert not native_bf16(torch.device("cpu"))


def test_int8_backbone_learns_like_fp32_and_checkpoints_without_it():
    """--learner.precision int8 quantises the frozen backbone's Linear layers (statistics stay fp64) and keeps the
    accuracy; the backbone stays out of the learner's state, so a checkpoint is the same tensors as at fp32."""
    learners = {p: learner_of("frozen", LearnerConfig(autoaugment=None, precision=p)) for p in ("fp32", "int8")}
    for learner in learners.values():
        colour_stream(learner)
    int8 = learners["int8"]
    assert int8.method.backbone.blocks[0].mlp.fc1._get_name() == "Int8Linear"
    assert int8.dtype == torch.float32 and int8.method.classifier.sums.dtype == torch.float64
    test = torch.arange(4).repeat(8)
    assert accuracy(int8, test) >= accuracy(learners["fp32"], test) - 0.1
    state = int8.state_dict()["method"]
    assert not any(k.startswith("backbone.") for k in state)
    assert state.keys() == learners["fp32"].state_dict()["method"].keys()
    restored = learner_of("frozen", LearnerConfig(autoaugment=None, precision="int8"))
    restored.load_state_dict(copy.deepcopy(int8.state_dict()))  # a restart from its checkpoint
    images = color_images(test)
    assert torch.equal(restored.predict_logits(images)["running"], int8.predict_logits(images)["running"])


@pytest.mark.parametrize("method", ["misa", "dualprompt"])
def test_int8_refuses_a_host_that_trains_through_the_backbone(method):
    with pytest.raises(ValueError, match="int8 needs a frozen backbone without prompts"):
        learner_of(method, LearnerConfig(autoaugment=None, precision="int8"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int8_on_a_gpu_is_refused_with_the_way_to_the_cpu():
    model = ModelConfig("frozen", backbone=TINY, learner=LearnerConfig(autoaugment=None, precision="int8"))
    with pytest.raises(ConfigError, match=r"int8 runs on the CPU only \(the model is on cuda.*CUDA_VISIBLE_DEVICES="):
        create_model(model, 4, torch.device("cuda"))


def test_statistics_classifier_state_round_trip():
    import copy

    a = learner_of("frozen", LearnerConfig(autoaugment=None))
    colour_stream(a)
    b = learner_of("frozen", LearnerConfig(autoaugment=None))
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    images = color_images(torch.arange(4).repeat(4))
    assert torch.equal(a.predict_logits(images)["running"], b.predict_logits(images)["running"])


def test_test_then_train_equals_predict_then_observe():
    """One forward serves the prediction and the statistics of a frozen host: same answers, same state."""
    import copy

    cfg = LearnerConfig(autoaugment=None, batch_size=16)
    a = learner_of("frozen", cfg)
    b = learner_of("frozen", cfg)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    stream = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(3))
    for y in stream.split(16):
        torch.manual_seed(7)
        got = a.test_then_train(color_images(y), y)
        torch.manual_seed(7)
        expected = b.predict(color_images(y))["running"] if b.exposed else None
        b.observe(color_images(y), y)
        assert (got is None and expected is None) or torch.equal(got, expected)
    for k, v in a.method.state_dict().items():
        torch.testing.assert_close(v, b.method.state_dict()[k], msg=k)


def test_the_default_learner_at_bf16_with_a_cast_backbone_predicts_as_at_fp32():
    """The bf16 path (autocast, the frozen backbone stored in bf16) learns the same stream to the same answers."""
    learners = {p: learner_of("frozen", LearnerConfig(precision=p, autoaugment=None), 8) for p in ("fp32", "bf16")}
    assert learners["bf16"].method.backbone.cls_token.dtype == torch.bfloat16
    assert learners["fp32"].method.backbone.cls_token.dtype == torch.float32
    stream = torch.randint(0, 8, (256,), generator=torch.Generator().manual_seed(2))
    for learner in learners.values():
        for y in stream.split(32):
            learner.observe(color_images(y, seed=int(y.sum())), y)
    test = torch.arange(8).repeat(8)
    images = color_images(test, seed=99)
    pred = {p: learner.predict(images, ("running",))["running"] for p, learner in learners.items()}
    assert (pred["bf16"] == pred["fp32"]).float().mean() >= 0.95
    assert (pred["fp32"] == test).float().mean() > 0.5  # chance is 1/8
