import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mepo_stream.artifacts import BACKBONE, BundleError, load_part, load_sigma_pre, read_manifest, write_bundle
from mepo_stream.backbone import create_backbone
from mepo_stream.cli import main, parse
from mepo_stream.errors import ConfigError
from mepo_stream.model import BundleParts, ModelConfig, create_model
from server.config import ServeConfig, model_config
from tests.helpers import TINY


def make_bundle(path):
    sigma = torch.eye(3, dtype=torch.float64) * 2
    write_bundle(path, {"sigma_pre": {"sigma_pre": sigma}, "backbone": {"w": torch.ones(2)}}, {"kind": "test"})
    return sigma


def test_round_trip_with_hashes(tmp_path):
    sigma = make_bundle(tmp_path / "b")
    manifest = read_manifest(tmp_path / "b")
    assert manifest["kind"] == "test" and set(manifest["files"]) == {"sigma_pre.safetensors", "backbone.safetensors"}
    assert torch.equal(load_sigma_pre(tmp_path / "b"), sigma)
    assert torch.equal(load_part(tmp_path / "b", "backbone")["w"], torch.ones(2))


def test_tampered_file_is_refused(tmp_path):
    make_bundle(tmp_path / "b")
    with open(tmp_path / "b" / "backbone.safetensors", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x00")
    with pytest.raises(BundleError, match="backbone.safetensors: sha256"):
        load_part(tmp_path / "b", "backbone")


def test_missing_and_foreign_bundles_are_refused(tmp_path):
    make_bundle(tmp_path / "b")
    (tmp_path / "b" / "sigma_pre.safetensors").unlink()
    with pytest.raises(BundleError, match="missing"):
        read_manifest(tmp_path / "b")
    with pytest.raises(BundleError, match="manifest.json is missing"):
        read_manifest(tmp_path)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(BundleError, match="unknown bundle format"):
        read_manifest(tmp_path / "c")


def test_rewriting_a_bundle_replaces_it_whole(tmp_path):
    make_bundle(tmp_path / "b")
    write_bundle(tmp_path / "b", {"sigma_pre": {"sigma_pre": torch.eye(2, dtype=torch.float64)}}, {"kind": "v2"})
    assert read_manifest(tmp_path / "b")["kind"] == "v2"
    assert not (tmp_path / "b" / "backbone.safetensors").exists()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left behind


def test_mepo_release_npy_covariance(tmp_path):
    np.save(tmp_path / "cov_sup21k_meta_5.npy", np.eye(4))
    assert load_sigma_pre(tmp_path / "cov_sup21k_meta_5.npy").shape == (4, 4)
    np.save(tmp_path / "bad.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        load_sigma_pre(tmp_path / "bad.npy")  # object arrays would need pickle: refused


def test_atomic_path_keeps_the_first_copy_when_asked(tmp_path):
    from mepo_stream.files import atomic_path

    with atomic_path(tmp_path / "cache", replace=False) as tmp:
        tmp.mkdir()
        (tmp / "a").write_text("first")
    with atomic_path(tmp_path / "cache", replace=False) as tmp:
        tmp.mkdir()
        (tmp / "a").write_text("second")
    assert (tmp_path / "cache" / "a").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


# --- a bundle checked against what uses it, before any work ------------------------------------------------------
def backbone_bundle(root, img_size: int = 32):
    """A bundle holding only a (random) test_vit backbone refined at ``img_size``: no Sigma_pre, no prompts."""
    backbone = create_backbone(replace(TINY, img_size=img_size))
    return write_bundle(root / "refined", {BACKBONE: backbone.state_dict()},
                        {"kind": "refined", "backbone": {"name": "test_vit", "img_size": img_size}})


@pytest.fixture
def forbid_work(monkeypatch):
    """Call it, and from then on any dataset read or backbone built fails the test: what "before any work" means,
    checked by what is not done rather than by a clock (which a busy machine stretches)."""

    def work(*args, **kwargs):
        raise AssertionError("work was done before the refusal")

    def forbid() -> None:
        monkeypatch.setattr("mepo_stream.data._resolve", work)
        monkeypatch.setattr("timm.create_model", work)

    return forbid


def test_evaluate_refuses_a_bundle_without_sigma_pre_before_any_work(tmp_path, capsys, forbid_work):
    bundle = backbone_bundle(tmp_path)
    forbid_work()
    with pytest.raises(SystemExit) as stop:
        main(["evaluate", "--mepo", str(bundle), "--out", str(tmp_path / "out"), "--backbone.name", "test_vit",
              "--backbone.weights", "null", "--backbone.img_size", "32", "--data.train_per_class", "5"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"mepo: error: {bundle} has backbone but no sigma_pre" in err and f"--mepo_rep {bundle}" in err
    assert "Traceback" not in err and not (tmp_path / "out" / "cache").exists()


def test_a_bundle_refined_at_another_size_is_refused_unless_resampling_is_asked(tmp_path):
    cfg = ModelConfig(backbone=replace(TINY, img_size=48), mepo=BundleParts.of(backbone_bundle(tmp_path, img_size=32)))
    with pytest.raises(ConfigError, match="refined at 32 px, not 48 px: leave --backbone.img_size out"):
        create_model(cfg, 4)
    model = create_model(replace(cfg, backbone=replace(cfg.backbone, allow_resample=True)), 4)
    assert model.backbone.patch_embed.img_size[0] == 48
    unsized = create_model(replace(cfg, backbone=replace(cfg.backbone, img_size=None)), 4)
    assert unsized.backbone.patch_embed.img_size[0] == 32  # the bundle's own resolution, not repeated by hand


def test_refine_offers_the_learners_precisions_and_refuses_int8_before_any_work(tmp_path, capsys, forbid_work):
    """``--loop.precision`` takes what ``--learner.precision`` takes; int8, which cannot train, is refused at once."""
    forbid_work()
    with pytest.raises(SystemExit) as stop:
        main(["refine", "--out", str(tmp_path / "out"), "--loop.precision", "int8", "--backbone.name", "test_vit",
              "--backbone.weights", "null", "--backbone.img_size", "32"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "mepo: error: --loop.precision int8: the refine trains the backbone" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["serve", "demo", "export", "evaluate"])
def test_every_command_that_takes_a_bundle_takes_the_same_three_options(command):
    ns = parse([command, "--mepo", "a", "--mepo_rep", "b", "--mepo_cov", "c.npy"])
    assert (ns[command].mepo, ns[command].mepo_rep, ns[command].mepo_cov) == (Path("a"), Path("b"), Path("c.npy"))


def test_serve_takes_meta_rep_and_meta_cov_from_their_own_bundles_at_the_bundles_resolution(tmp_path):
    """``--mepo_rep`` and ``--mepo_cov`` mean what they mean to ``mepo evaluate``: each part from its own bundle
    (over --mepo's), and the resolution is the refined bundle's, not repeated by hand."""
    rep = backbone_bundle(tmp_path, img_size=48)
    np.save(tmp_path / "cov.npy", np.eye(64))
    base = ServeConfig(backbone=replace(TINY, img_size=None), mepo_rep=rep, mepo_cov=tmp_path / "cov.npy")
    model = model_config(base)
    assert (model.mepo.rep, model.mepo.cov, model.backbone.img_size) == (rep, tmp_path / "cov.npy", 48)
    built = create_model(model, 4)
    assert built.backbone.patch_embed.img_size[0] == 48 and built.alignment is not None
    with pytest.raises(ConfigError, match="refined at 48 px, not 32 px: leave --backbone.img_size out"):
        create_model(model_config(replace(base, backbone=TINY)), 4)
    assert model_config(replace(base, mepo_rep=None)).backbone.img_size == ServeConfig.default_img_size
