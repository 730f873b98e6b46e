import json

import numpy as np
import pytest
import torch

from mepo_stream.artifacts import BundleError, load_part, load_sigma_pre, read_manifest, write_bundle


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
