"""Each host method learns a tiny stream in one pass and keeps its defining mechanism."""


import pytest
import torch

from mepo_stream.learner import LearnerConfig, OnlineLearner
from mepo_stream.methods import METHODS, create_method
from server.snapshot import take_snapshot
from tests.helpers import color_images, learner_of

CFG = LearnerConfig(batch_size=16, online_iter=3, samples_per_slot=10_000, autoaugment=None)


def learn_stream(method: str, lr: float = 5e-3) -> OnlineLearner:
    learner = learner_of(method, LearnerConfig(**{**CFG.__dict__, "lr": lr}), 8)
    stream = torch.randint(0, 4, (320,), generator=torch.Generator().manual_seed(1))
    for start in range(0, len(stream), 16):
        y = stream[start:start + 16]
        learner.observe(color_images(y), y)
    return learner


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_learns_above_chance(method):
    lr = 1e-3 if method == "seq_ft" else 5e-3  # the whole model at 5e-3 Adam diverges even on colours
    learner = learn_stream(method, lr)
    test = torch.arange(4).repeat(16)
    acc = (learner.predict(color_images(test), ("batch",))["batch"] == test).float().mean().item()
    assert acc > 0.5  # chance is 0.25


def backbone_shift(learner: OnlineLearner, start: dict[str, torch.Tensor]) -> float:
    now = learner.method.backbone.state_dict()  # a frozen backbone may be stored in bf16: compare in its dtype
    return sum((now[k].float() - v.to(now[k].dtype).float()).norm().item() for k, v in start.items())


def initial_backbone() -> dict[str, torch.Tensor]:
    """The backbone every ``learner_of`` model starts from (the factory seeds it)."""
    return learner_of("frozen", CFG).method.backbone.state_dict()


def test_linear_probe_never_changes_the_backbone():
    assert backbone_shift(learn_stream("linear_probe"), initial_backbone()) == 0.0


def test_slow_learner_moves_the_backbone_less_than_seq_ft():
    start = initial_backbone()
    fast = backbone_shift(learn_stream("seq_ft", 1e-3), start)
    slow = backbone_shift(learn_stream("seq_ft_sl", 1e-3), start)
    assert 0 < slow < 0.2 * fast


def test_fine_tuned_backbones_are_snapshotted_and_checkpointed():
    learner = learn_stream("seq_ft", 1e-3)
    snap = take_snapshot(learner, 1)
    assert snap.model.backbone is not learner.method.backbone  # predictions must not see a moving backbone
    images = color_images(torch.arange(4))
    before = snap.probabilities(images)
    y = torch.arange(4).repeat(4)
    learner.observe(color_images(y), y)
    assert torch.equal(snap.probabilities(images), before)
    assert any(k.startswith("backbone.") for k in learner.state_dict()["method"])


def test_unknown_method():
    with pytest.raises(ValueError, match="available"):
        create_method("nope", None, 2)


def test_prefix_tuning_touches_only_the_configured_blocks(tiny_backbone):
    """Prefixes at block 2 leave blocks 0-1 as the plain ViT computes them, and change what follows."""
    from mepo_stream.prompts import embed, prefix_forward

    vit = tiny_backbone.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(prefix_forward(vit, x, {}), vit.forward_features(x), atol=1e-5)
        prefix = (torch.randn(2, 5, 64), torch.randn(2, 5, 64))
        captured = {}
        hooks = [vit.blocks[i].register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out))
                 for i in range(len(vit.blocks))]
        out = prefix_forward(vit, x, {2: prefix})
        for h in hooks:
            h.remove()
        plain = embed(vit, x)
        for i in range(2):
            plain = vit.blocks[i](plain)
            assert torch.allclose(captured[i], plain, atol=1e-6)  # untouched before block 2
        assert 2 not in captured  # block 2 ran through the prefix path
        assert not torch.allclose(out, vit.forward_features(x), atol=1e-3)


def test_deep_l2p_trains_only_prefixes_keys_and_head():
    learner = learn_stream("deep_l2p")
    trainable = {n for n, p in learner.method.named_parameters() if p.requires_grad}
    assert trainable == {"prefixes", "keys", "head.weight", "head.bias"}
    assert learner.method.prefixes.shape == (10, 5, 2, 5, 64)  # pool, layers 1-5, K/V, length 5, D


def test_dualprompt_prefix_tunes_blocks_0_to_4_with_the_g_prompt_then_the_key_selected_e_prompt(monkeypatch):
    """What the forward does: blocks 0-4 attend to 5 extra keys and values (the g-prompt's in 0-1, the selected
    e-prompt's in 2-4), block 5 runs plain, and only the e-prompt whose key matches the image is used."""
    import mepo_stream.prompts as prompts

    learner = learner_of("dualprompt", CFG, 8)
    method, x = learner.method.eval(), learner.method.transform(color_images(torch.arange(2)))
    prefixed, plain = {}, []
    attention = prompts.prefix_attention

    def record_prefix(attn, tokens, prefix_k, prefix_v):
        block = next(i for i, b in enumerate(method.backbone.blocks) if b.attn is attn)
        prefixed[block] = (prefix_k.detach().clone(), prefix_v.detach().clone())
        return attention(attn, tokens, prefix_k, prefix_v)

    monkeypatch.setattr(prompts, "prefix_attention", record_prefix)
    hooks = [b.register_forward_hook(lambda m, a, out, i=i: plain.append(i))
             for i, b in enumerate(method.backbone.blocks)]
    with torch.no_grad():
        out = method.encode(x).feature
    for h in hooks:
        h.remove()
    assert sorted(prefixed) == [0, 1, 2, 3, 4]
    assert plain == [0, 1, 2, 3, 4, 5, 5]  # the prompt-free query pass, then only block 5 of the prompted one
    assert all(k.shape == v.shape == (2, 5, 64) for k, v in prefixed.values())
    with torch.no_grad():
        chosen = method.e_prompt.similarity(method.backbone.forward_features(x)[:, 0]).argmax(1)  # [2]
    g, e = method.g_prompt.prompts, method.e_prompt.prompts  # [1, 2, 10, D], [pool, 3, 10, D]
    for block in (0, 1):
        assert torch.equal(torch.cat(prefixed[block], 1), g[0, block].expand(2, -1, -1))
    for block in (2, 3, 4):
        assert torch.equal(torch.cat(prefixed[block], 1), e[chosen, block - 2])
    unused = next(i for i in range(e.shape[0]) if i not in chosen.tolist())
    with torch.no_grad():
        e[unused].add_(1.0)  # an e-prompt no image selects changes nothing
        assert torch.equal(method.encode(x).feature, out)
        e[chosen[0]].add_(1.0)
        assert not torch.allclose(method.encode(x).feature[0], out[0])


def test_coda_p_trains_only_the_current_component_group(tiny_backbone):
    from mepo_stream.methods.coda import CodaConfig, CodaPrompt

    method = CodaPrompt(tiny_backbone, 4, cfg=CodaConfig(components=10, groups=5, length=2))
    before = method.components.detach().clone()
    feature = method.encode(torch.randn(3, 3, 32, 32), slot=2).feature  # groups 0-2 in use, 2 learns
    # A random projection: the sum of a LayerNorm output (no affine yet) is 0 whatever the input, so its gradient
    # would be rounding noise, nonzero on one CPU and exactly zero on another.
    (feature * torch.randn_like(feature)).sum().backward()
    grad = method.components.grad.flatten(1).abs().sum(1)  # per component
    assert (grad[4:6] > 0).all() and (grad[:4] == 0).all() and (grad[6:] == 0).all()
    torch.optim.Adam(method.param_groups(1e-2)).step()  # the learner's optimizer: only group 2 moves
    moved = (method.components.detach() != before).flatten(1).any(1)
    assert moved.tolist() == [False] * 4 + [True] * 2 + [False] * 4


def test_coda_p_inference_uses_only_the_groups_trained_so_far(tiny_backbone):
    from mepo_stream.methods.coda import CodaConfig, CodaPrompt

    method = CodaPrompt(tiny_backbone, 4, cfg=CodaConfig(components=10, groups=5, length=2))
    assert method.active(method.keys, None).shape[0] == 2  # nothing trained yet: group 0
    method.active(method.keys, 3)
    assert method.active(method.keys, None).shape[0] == 8  # groups 0-3


def test_mvp_mask_suppresses_unseen_classes():
    learner = learn_stream("mvp")  # classes 0-3 of 8 seen (head outputs 0-3)
    scale = 2 * torch.sigmoid(learner.method.class_mask.detach())  # [pool, C]
    used = learner.method.usage > 0
    assert torch.allclose(scale[:, 4:], torch.full_like(scale[:, 4:], 2 * torch.sigmoid(torch.tensor(-1.0))))
    assert scale[used][:, :4].max() > scale[:, 4:].max()  # learned classes are amplified above the rest
    enc = learner.method.eval().encode(learner.method.transform(color_images(torch.arange(4))))
    assert enc.logit_scale.shape == (4, 8)
