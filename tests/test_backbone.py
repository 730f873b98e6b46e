import hashlib
import json
import pickle
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from huggingface_hub import constants as hub_constants
from safetensors.torch import save, save_file

from mepo_stream.backbone import (
    BackboneConfig,
    create_backbone,
    hub_repo,
    load_backbone_weights,
    provenance,
    read_state_dict,
)
from mepo_stream.errors import ConfigError
from mepo_stream.model import weights_sha256
from server.export import read_snapshot
from tests.helpers import TINY, ServeProcess, fill_hub_cache, settings


def trained_state(img_size: int = 32) -> dict[str, torch.Tensor]:
    torch.manual_seed(123)
    return timm.create_model("test_vit", pretrained=False, num_classes=10, img_size=img_size).state_dict()


def same_backbone(model, state) -> bool:
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_safetensors_and_pth_sources(tmp_path):
    state = trained_state()
    save_file(state, str(tmp_path / "w.safetensors"))
    torch.save({"model": state}, tmp_path / "w.pth")  # common wrapper, unwrapped on load
    for name in ("w.safetensors", "w.pth"):
        model = create_backbone(BackboneConfig("test_vit", str(tmp_path / name), 32))
        assert same_backbone(model, state)


def test_mepo_release_format_loads_without_head(tmp_path):
    """vit_*_meta_k.pth: a backbone state dict without head keys, loaded non-strictly."""
    state = {k: v for k, v in trained_state().items() if not k.startswith("head.")}
    torch.save(state, tmp_path / "vit_test_meta_5.pth")
    assert same_backbone(create_backbone(BackboneConfig("test_vit", str(tmp_path / "vit_test_meta_5.pth"), 32)), state)


def test_missing_backbone_keys_fail_loudly(tmp_path):
    state = {k: v for k, v in trained_state().items() if not k.startswith("blocks.3.")}
    torch.save(state, tmp_path / "broken.pth")
    with pytest.raises(ValueError, match="missing.*blocks.3"):
        create_backbone(BackboneConfig("test_vit", str(tmp_path / "broken.pth"), 32))


def test_pickled_objects_are_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(tmp_path / "evil.pth", "wb") as f:
        pickle.dump({"w": Payload()}, f)
    with pytest.raises(ValueError, match="refused to unpickle"):
        read_state_dict(tmp_path / "evil.pth")


def test_position_table_is_resampled_to_the_image_size(tmp_path):
    state = trained_state(img_size=32)  # 2x2 grid of 16-px patches
    model = create_backbone(BackboneConfig("test_vit", None, 64))  # 4x4 grid
    load_backbone_weights(model, state)
    assert state["pos_embed"].shape[1] == 1 + 4 and model.pos_embed.shape[1] == 1 + 16
    assert torch.equal(model.pos_embed[:, :1], state["pos_embed"][:, :1])  # the CLS position is kept as is
    assert torch.equal(model.cls_token, state["cls_token"])


def test_google_npz_goes_through_timms_loader(tmp_path):
    """A Google-format npz written from a known model must load back to the same weights."""
    model = timm.create_model("test_vit", pretrained=False, num_classes=0, img_size=32)
    np.savez(tmp_path / "ViT.npz", **google_npz(model))
    loaded = create_backbone(BackboneConfig("test_vit", str(tmp_path / "ViT.npz"), 32))
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(model.eval().forward_features(x), loaded.eval().forward_features(x), atol=1e-5)


def google_npz(model) -> dict[str, np.ndarray]:
    """Inverse of timm's npz reader for a plain ViT (big_vision/jax layout), for the test above."""
    n = lambda t: t.detach().numpy()  # noqa: E731
    d, h = model.embed_dim, model.blocks[0].attn.num_heads
    out = {"embedding/kernel": n(model.patch_embed.proj.weight.permute(2, 3, 1, 0)),
           "embedding/bias": n(model.patch_embed.proj.bias), "cls": n(model.cls_token),
           "Transformer/posembed_input/pos_embedding": n(model.pos_embed),
           "Transformer/encoder_norm/scale": n(model.norm.weight), "Transformer/encoder_norm/bias": n(model.norm.bias)}
    for i, blk in enumerate(model.blocks):
        p = f"Transformer/encoderblock_{i}/"
        q, k, v = blk.attn.qkv.weight.chunk(3)
        qb, kb, vb = blk.attn.qkv.bias.chunk(3)
        out |= {p + "LayerNorm_0/scale": n(blk.norm1.weight), p + "LayerNorm_0/bias": n(blk.norm1.bias),
                p + "LayerNorm_2/scale": n(blk.norm2.weight), p + "LayerNorm_2/bias": n(blk.norm2.bias),
                p + "MultiHeadDotProductAttention_1/out/kernel": n(blk.attn.proj.weight.T.reshape(h, d // h, d)),
                p + "MultiHeadDotProductAttention_1/out/bias": n(blk.attn.proj.bias)}
        for name, w, b in (("query", q, qb), ("key", k, kb), ("value", v, vb)):
            out[p + f"MultiHeadDotProductAttention_1/{name}/kernel"] = n(w.T.reshape(d, h, d // h))
            out[p + f"MultiHeadDotProductAttention_1/{name}/bias"] = n(b.reshape(h, d // h))
        for j, fc in enumerate((blk.mlp.fc1, blk.mlp.fc2)):
            out[p + f"MlpBlock_3/Dense_{j}/kernel"] = n(fc.weight.T)
            out[p + f"MlpBlock_3/Dense_{j}/bias"] = n(fc.bias)
    return out


def test_random_init_needs_no_files():
    assert create_backbone(TINY).num_features == 64


def test_non_vit_and_unknown_names_are_rejected():
    with pytest.raises(TypeError, match="VisionTransformer"):
        create_backbone(BackboneConfig("resnet18", None, 32))
    with pytest.raises(ValueError, match="unknown timm model"):
        create_backbone(BackboneConfig("vit_does_not_exist", None, 32))


# --- timm's pretrained weights through the Hugging Face cache, offline -------------------------------------------
HUB_CONFIG = json.dumps({"architecture": "test_vit", "num_classes": 10, "pretrained_cfg": {
    "num_classes": 10, "classifier": "head", "mean": [0.5] * 3, "std": [0.5] * 3}})  # as timm's push_to_hub writes it


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, the Hub forbidden (what ``HF_HOME=... HF_HUB_OFFLINE=1`` set at start does)."""
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


@pytest.mark.parametrize("weights", ["timm", "hf-hub:someone/test-vit"])
def test_hub_weights_load_from_a_filled_cache_offline(offline_hub, weights):
    state = trained_state()  # with its 10-class head, which timm drops for a headless model
    repo = "timm/test_vit.r160_in1k" if weights == "timm" else weights.removeprefix("hf-hub:")
    fill_hub_cache(offline_hub, repo, {"model.safetensors": save(state), "config.json": HUB_CONFIG.encode()})
    cfg = BackboneConfig("test_vit", weights, 32)
    assert same_backbone(create_backbone(cfg), {k: v for k, v in state.items() if not k.startswith("head.")})
    assert provenance(cfg)["weights_sha256"] == hashlib.sha256(save(state)).hexdigest()


@pytest.mark.parametrize("weights", ["timm", "hf-hub:someone/test-vit"])
def test_hub_weights_missing_from_the_cache_offline_say_what_to_do(offline_hub, weights):
    with pytest.raises(ConfigError, match=r"is not in the Hugging Face cache .* \(HF_HUB_OFFLINE=1\): run it once "
                                          r"with hub access, or `hf download"):
        create_backbone(BackboneConfig("test_vit", weights, 32))


def test_hub_weights_of_another_architecture_name_it(offline_hub):
    fill_hub_cache(offline_hub, "someone/test-vit", {"model.safetensors": save(trained_state()),
                                                      "config.json": HUB_CONFIG.encode()})
    with pytest.raises(ConfigError, match="holds a test_vit, not a vit_tiny_patch16_224: pass --backbone.name test_"):
        create_backbone(BackboneConfig("vit_tiny_patch16_224", "hf-hub:someone/test-vit", 32))


def test_timm_weights_of_a_model_without_a_hub_tag_are_refused():
    with pytest.raises(ConfigError, match="timm has no pretrained weights on the Hugging Face Hub for 'nope'"):
        hub_repo("nope", "timm")


@pytest.mark.parametrize("weights", ["timm", "hf-hub:someone/test-vit"])
def test_mepo_serve_builds_hub_weights_from_a_filled_cache_with_the_hub_off(broker, tmp_path, monkeypatch, weights):
    """``mepo serve --backbone.name test_vit --backbone.weights timm`` (or ``hf-hub:``) as its own process, with
    ``HF_HUB_OFFLINE=1`` and a cache filled here: the backbone it publishes (its snapshots' sha256 of the weights as
    built) is the cached state dict's."""
    state = trained_state()
    repo = "timm/test_vit.r160_in1k" if weights == "timm" else weights.removeprefix("hf-hub:")
    fill_hub_cache(tmp_path / "hf" / "hub", repo,
                   {"model.safetensors": save(state), "config.json": HUB_CONFIG.encode()})
    save_file(state, str(tmp_path / "local.safetensors"))
    expected = weights_sha256(create_backbone(BackboneConfig("test_vit", str(tmp_path / "local.safetensors"), 32)))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = settings(broker, tmp_path, backbone=BackboneConfig("test_vit", weights, 32))
    cfg = replace(cfg, kafka=replace(cfg.kafka, snapshot_topic=f"snapshots-{cfg.kafka.group_id}"))
    with ServeProcess(cfg, tmp_path / "serve.log") as process:
        try:
            assert read_snapshot(cfg, wait_s=120).origin.backbone_sha256 == expected
        finally:
            process.terminate()
