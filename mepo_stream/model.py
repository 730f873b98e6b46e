"""The model factory (timm's ``create_model``): a ``ModelConfig`` in, a finished model out.

A ``ModelConfig`` says everything a model is made of: the host method, the backbone, which MePo parts to take
from which bundle (``BundleParts``: a (meta-refined) backbone for Meta Rep, Sigma_pre for Meta Cov, ISA-warmed
prompts), the Meta Cov settings and the learner's readout (statistics classifier, standardisation, precision).
``create_model`` checks every bundle against the model before any work, builds the backbone, and constructs the
host with its ``Readout``, so nothing is set on the model once it is built. The service, its replicas,
``mepo evaluate``, ``mepo isa``, the benchmarks and the test helpers all build here, so they run the same model
for the same configuration, and a snapshot's ``ModelConfig`` is all a replica needs to rebuild it.

Example:
    >>> from mepo_stream.backbone import BackboneConfig
    >>> model = create_model(ModelConfig(backbone=BackboneConfig(name="test_vit", weights=None, img_size=32)), 10)
    >>> type(model).__name__, type(model.classifier).__name__, model.alignment is None
    ('LinearProbe', 'StreamingLDA', True)
    >>> ModelConfig.from_json(model_config_json := ModelConfig().to_json()).to_json() == model_config_json
    True
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mepo_stream.alignment import AlignmentConfig, FeatureAlignment
from mepo_stream.artifacts import (
    BACKBONE,
    MANIFEST,
    PROMPTS,
    SIGMA_PRE,
    BundleError,
    load_part,
    load_sigma_pre,
    read_manifest,
)
from mepo_stream.backbone import BackboneConfig, create_backbone, input_size, normalization, sized
from mepo_stream.errors import ConfigError
from mepo_stream.files import sha256_file
from mepo_stream.heads import NearestClassMean, RunningStandardize, StreamingLDA
from mepo_stream.learner import LearnerConfig
from mepo_stream.methods import MethodsConfig, create_method
from mepo_stream.methods.base import ContinualMethod, PromptHost, Readout
from mepo_stream.precision import quantize_int8, resolve_precision
from mepo_stream.transforms import test_transform


@dataclass(frozen=True)
class BundleParts:
    """Which parts of MePo to take, and from which bundle (None: that part is off).

    Example (``mepo serve --mepo B`` takes every part ``B`` has; ``mepo evaluate`` picks parts per variant):
        >>> BundleParts(cov=Path("cov_vit.npy")).bundles
        (PosixPath('cov_vit.npy'),)
    """

    rep: Path | None = None
    """Bundle whose backbone replaces the configured one (Meta Rep)."""
    cov: Path | None = None
    """Bundle (or MePo release ``cov_*.npy``) holding Sigma_pre (Meta Cov)."""
    prompts: Path | None = None
    """Bundle holding ISA-warmed prompts for prompt-based hosts."""

    @classmethod
    def of(cls, bundle: Path | None) -> BundleParts:
        """Every part the bundle has."""
        if bundle is None:
            return cls()
        have = bundle_parts(bundle)
        return cls(rep=bundle if BACKBONE in have else None, cov=bundle if SIGMA_PRE in have else None,
                   prompts=bundle if PROMPTS in have else None)

    @property
    def bundles(self) -> tuple[Path, ...]:
        """Each bundle (or ``.npy``) the parts come from, once, in part order."""
        return tuple(dict.fromkeys(Path(p) for p in (self.rep, self.cov, self.prompts) if p is not None))

    def sha256(self) -> str | None:
        """What a replica compares: the sha256 of the one bundle's manifest (which holds every file's sha256), of
        the manifests or ``.npy`` files of several joined, or None without MePo."""
        digests = [sha256_file(b if b.suffix == ".npy" else b / MANIFEST) for b in self.bundles]
        if len(digests) <= 1:
            return next(iter(digests), None)
        return hashlib.sha256(",".join(digests).encode()).hexdigest()


def bundle_parts(bundle: Path) -> list[str]:
    """The parts a bundle holds (``BundleError`` when it is not a bundle)."""
    files = read_manifest(bundle)["files"]
    return [part for part in (BACKBONE, SIGMA_PRE, PROMPTS) if f"{part}.safetensors" in files]


def check_bundle(bundle: Path, backbone: BackboneConfig, needs: dict[str, str] | None = None) -> None:
    """Refuse, before any work, a bundle that lacks a part the caller ``needs`` (part -> what to do instead), or
    whose refined backbone is another architecture or resolution than ``backbone``.

    Example:
        >>> check_bundle(Path("/nonexistent"), BackboneConfig())
        Traceback (most recent call last):
        ...
        mepo_stream.artifacts.BundleError: /nonexistent is not a bundle: manifest.json is missing
    """
    have = bundle_parts(bundle)
    for part, instead in (needs or {}).items():
        if part not in have:
            raise BundleError(f"{bundle} has {', '.join(have) or 'no parts'} but no {part}: {instead}")
    if BACKBONE not in have:
        return
    manifest = read_manifest(bundle)
    made = manifest.get("backbone", {})
    if made.get("name") not in (None, backbone.name):
        raise ConfigError(f"{bundle} holds a {made['name']} backbone, not {backbone.name}: pass --backbone.name "
                          f"{made['name']}")
    refined = manifest.get("kind") != "imported"  # an imported checkpoint has its architecture's size, not a refine's
    if refined and made.get("img_size") not in (None, backbone.img_size) and not backbone.allow_resample:
        raise ConfigError(f"{bundle} was refined at {made['img_size']} px, not {backbone.img_size} px: leave "
                          f"--backbone.img_size out (a bundle's resolution is the default), or pass "
                          f"--backbone.allow_resample true to resample its position table")


def check_parts(parts: BundleParts, backbone: BackboneConfig) -> None:
    """Each part's bundle holds that part and fits ``backbone`` (a ``cov_*.npy`` is Sigma_pre as is)."""
    if parts.rep is not None:
        check_bundle(parts.rep, backbone, {BACKBONE: "Meta Rep needs a refined backbone (mepo refine)"})
    if parts.cov is not None and Path(parts.cov).suffix != ".npy":
        check_bundle(parts.cov, backbone, {SIGMA_PRE: "Meta Cov needs Sigma_pre (mepo covariance, or mepo refine)"})
    if parts.prompts is not None:
        check_bundle(parts.prompts, backbone, {PROMPTS: "prompt hosts start from ISA prompts (mepo isa)"})


def backbone_config(backbone: BackboneConfig, parts: BundleParts) -> BackboneConfig:
    """The backbone to build: the bundle's refined one under Meta Rep, else the configured one."""
    return backbone if parts.rep is None else replace(backbone, weights=str(parts.rep))


def meta_cov(parts: BundleParts, backbone: VisionTransformer, cfg: AlignmentConfig) -> FeatureAlignment | None:
    """The Meta Cov alignment to Sigma_pre when the parts hold one, else None."""
    if parts.cov is None:
        return None
    sigma = load_sigma_pre(parts.cov)  # [D, D]
    if sigma.shape[0] != backbone.num_features:
        raise BundleError(f"{parts.cov}: Sigma_pre is {tuple(sigma.shape)} but the backbone has "
                          f"{backbone.num_features} features")
    return FeatureAlignment.from_config(sigma, cfg)


def make_classifier(cfg: LearnerConfig, dim: int, n_classes: int, alignment: FeatureAlignment | None
                    ) -> nn.Module | None:
    """The statistics classifier ``cfg`` asks for (None for the linear head)."""
    if cfg.classifier == "ncm":
        return NearestClassMean(dim, n_classes)
    if cfg.classifier == "linear":
        return None
    prior = None
    if cfg.slda_prior == "sigma_pre":
        if alignment is None:
            raise ConfigError("--learner.slda_prior sigma_pre needs Sigma_pre: give a MePo bundle with Meta Cov")
        prior = alignment.sigma_pre()
    return StreamingLDA(dim, n_classes, cfg.slda_shrinkage, prior, block_rows=cfg.batch_size)


def readout(cfg: LearnerConfig, backbone: VisionTransformer, n_classes: int, alignment: FeatureAlignment | None,
            device: torch.device) -> Readout:
    """How the model reads its input and its feature: the eval transform at the backbone's resolution, the
    statistics classifier and standardisation ``cfg`` asks for, the precision on ``device``, the logit mask, the
    fixed forward shape (the mini-batch size: ``ContinualMethod.encode_images``), and the sha256 of the backbone
    as built (before any cast: a replica in another precision checks the same weights)."""
    dim = backbone.num_features
    return Readout(
        classifier=make_classifier(cfg, dim, n_classes, alignment),
        standardize=RunningStandardize(dim) if cfg.standardize else None,
        transform=test_transform(input_size(backbone), *normalization(backbone)),
        dtype=resolve_precision(cfg.precision, device), eval_mask=cfg.eval_mask,
        backbone_sha256=weights_sha256(backbone), forward_batch=cfg.batch_size,
        invariant_predictions=cfg.invariant_predictions)


def plain_frozen_backbone(method: ContinualMethod) -> bool:
    """The method encodes with its backbone alone (no prompts mixed into its layers), and nothing trains it: its
    weights may then be cast to bf16 (prompts in fp32 would meet bf16 LayerNorm weights outside autocast's casts)."""
    names = [n for n, _ in method.named_parameters()]
    backbone_trains = any(p.requires_grad for p in method.backbone.parameters())
    return not backbone_trains and all(n.startswith(("backbone.", "head.")) for n in names)


def quantize_frozen_backbone(method: ContinualMethod) -> None:
    """``--learner.precision int8``: the backbone's Linear layers in int8, where nothing trains through them."""
    if method.device.type != "cpu":
        raise ConfigError(f"precision int8 runs on the CPU only (the model is on {method.device}); use auto or bf16, "
                          "or hide the GPU (CUDA_VISIBLE_DEVICES=) to run int8 on the CPU")
    if not plain_frozen_backbone(method):
        raise ConfigError("precision int8 needs a frozen backbone without prompts (--method frozen, the default): "
                          "nothing can train through its quantised layers")
    quantize_int8(method.backbone)


def weights_sha256(module: nn.Module) -> str:
    """sha256 of a module's weights as loaded (names, dtypes, shapes and bytes, in state-dict order).

    The weights as loaded, not the file they came from: the position table is resampled to the configured
    resolution and a random init depends on the seed, and either would make the same tensors mean something else.
    """
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def place(method: ContinualMethod, cfg: LearnerConfig, device: torch.device) -> ContinualMethod:
    """Only the head trainable when the encoder does not train; on ``device``; a frozen plain backbone stored at
    the model's precision (read under autocast as it is: no per-forward weight cast), or quantised for int8."""
    if not cfg.train_encoder:
        for name, p in method.named_parameters():
            p.requires_grad_(p.requires_grad and name.startswith("head."))
    method.to(device)
    if cfg.cast_frozen_backbone and method.dtype != torch.float32 and plain_frozen_backbone(method):
        method.backbone.to(method.dtype)
    if cfg.precision == "int8":
        quantize_frozen_backbone(method)
    return method


@dataclass(frozen=True)
class ModelConfig:
    """What defines a model: its host, backbone, MePo parts, Meta Cov settings and head (the learner's settings
    ride along; only the head's and the precision's shape the model). A snapshot carries it, so a replica rebuilds
    the model it serves from the snapshot alone."""

    method: str = "frozen"
    """Host method (``mepo_stream.methods.METHODS``)."""
    method_config: MethodsConfig = MethodsConfig()
    """Per-method hyperparameters."""
    backbone: BackboneConfig = BackboneConfig()
    """Pretrained backbone (replaced by the bundle's under Meta Rep)."""
    mepo: BundleParts = BundleParts()
    """The MePo parts and the bundle each comes from (``BundleParts.of(bundle)``: every part it has)."""
    alignment: AlignmentConfig = AlignmentConfig()
    """Meta Cov settings (used when the parts hold Sigma_pre)."""
    learner: LearnerConfig = LearnerConfig()
    """Classifier, precision, what trains (and the training settings, which do not shape the model)."""
    seed: int = 0
    """Seed of the random initialisation of prompts and head (a backbone without weights is always drawn with
    seed 0: ``create_backbone``)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str, sort_keys=True)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def from_json(text: str) -> ModelConfig:
        """The configuration ``to_json`` wrote (nested dataclasses and tuples restored by their types). Cached: a
        replica reads the same configuration with every snapshot, and parsing it is slow next to a snapshot's work."""
        from jsonargparse import ArgumentParser  # the CLI's typed parser: nested dataclasses, tuples, paths

        parser = ArgumentParser()
        parser.add_class_arguments(ModelConfig, nested_key="model")
        return parser.instantiate_classes(parser.parse_object({"model": json.loads(text)})).model


def create_model(cfg: ModelConfig, n_classes: int, device: torch.device | None = None) -> ContinualMethod:
    """The finished model for ``n_classes`` classes: every bundle checked first, then seeded and built with the
    parts ``cfg.mepo`` names, on ``device`` (the CPU by default)."""
    backbone_cfg = sized(cfg.backbone, cfg.mepo.bundles)
    check_parts(cfg.mepo, backbone_cfg)
    device = device or torch.device("cpu")
    torch.manual_seed(cfg.seed)
    backbone = create_backbone(backbone_config(backbone_cfg, cfg.mepo))
    alignment = meta_cov(cfg.mepo, backbone, cfg.alignment)
    method = create_method(cfg.method, backbone, n_classes, alignment, cfg.method_config,
                           readout(cfg.learner, backbone, n_classes, alignment, device))
    if cfg.mepo.prompts is not None and isinstance(method, PromptHost):  # hosts without prompts: none
        method.load_initial_prompts(load_part(cfg.mepo.prompts, PROMPTS))
    return place(method, cfg.learner, device)
