"""Artifact bundles: a folder of safetensors files plus a ``manifest.json`` that records their hashes.

A bundle is what ``refine`` and ``covariance`` write and what ``evaluate``/``serve`` take as their one MePo
argument::

    bundle/
      manifest.json          {"format": "mepo-bundle/1", "files": {"sigma_pre.safetensors": {"sha256": ...}}, ...}
      backbone.safetensors   the (refined) backbone, no head            (optional)
      sigma_pre.safetensors  Sigma_pre, float64 [D, D], key "sigma_pre"  (optional)
      prompts.safetensors    ISA-warmed prompts of a prompt-based host (optional; see offline/isa.py)

Bundles are written atomically (temporary folder, fsync, rename). Reading verifies every hash and fails with
a message naming the file on any mismatch; nothing is ever unpickled.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()) / "b"
    >>> _ = write_bundle(d, {"sigma_pre": {"sigma_pre": torch.eye(2, dtype=torch.float64)}}, {"note": "demo"})
    >>> read_manifest(d)["note"], load_sigma_pre(d).dtype
    ('demo', torch.float64)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mepo_stream.errors import ConfigError
from mepo_stream.files import atomic_path, sha256_file

FORMAT = "mepo-bundle/1"
MANIFEST = "manifest.json"
SIGMA_PRE = "sigma_pre"
BACKBONE = "backbone"
PROMPTS = "prompts"


class BundleError(ConfigError):
    """A bundle is missing, incomplete or does not match its manifest."""


def write_bundle(path: str | Path, parts: dict[str, dict[str, torch.Tensor]], manifest: dict) -> Path:
    """Write ``parts`` (name -> tensors, one ``name.safetensors`` each) and the manifest, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.mkdir()
        files = {}
        for name, tensors in parts.items():
            file = tmp / f"{name}.safetensors"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(file))
            files[file.name] = {"sha256": sha256_file(file), "bytes": file.stat().st_size}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, **manifest, "files": files}, indent=2))
    return path


def read_manifest(path: str | Path) -> dict:
    """Read a bundle's manifest and verify every file it lists against its sha256."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise BundleError(f"{path} is not a bundle: {MANIFEST} is missing")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise BundleError(f"{path / MANIFEST} is not valid JSON: {e}") from e
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{path}: unknown bundle format {manifest.get('format')!r} (expected {FORMAT})")
    for name, info in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise BundleError(f"{path}: {name} is listed in the manifest but missing")
        if (digest := sha256_file(file)) != info["sha256"]:
            raise BundleError(f"{file}: sha256 {digest[:12]}… does not match the manifest's {info['sha256'][:12]}…")
    return manifest


def load_part(path: str | Path, name: str) -> dict[str, torch.Tensor]:
    """Tensors of ``name.safetensors`` from a verified bundle."""
    manifest = read_manifest(path)
    if f"{name}.safetensors" not in manifest["files"]:
        raise BundleError(f"{path}: the bundle has no {name}.safetensors")
    return load_file(str(Path(path) / f"{name}.safetensors"))


def load_sigma_pre(path: str | Path) -> torch.Tensor:
    """Sigma_pre [D, D] float64 from a bundle folder, or from a MePo release ``cov_*.npy`` file."""
    path = Path(path)
    if path.suffix == ".npy":
        cov = torch.from_numpy(np.load(path, allow_pickle=False)).double()
    else:
        cov = load_part(path, SIGMA_PRE)[SIGMA_PRE].double()
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1]:
        raise BundleError(f"{path}: Sigma_pre must be a square matrix, got shape {tuple(cov.shape)}")
    return cov


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape an artifact's numbers, for its manifest."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("mepo-stream", "torch", "torchvision", "timm", "safetensors", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out
