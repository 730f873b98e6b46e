"""The model factory (timm's ``create_model``): a ``ModelConfig`` and a MePo bundle in, a complete model out.

A MePo bundle may carry up to three parts, each optional: a (meta-refined) backbone (Meta Rep), Sigma_pre
(Meta Cov), and ISA-warmed prompts (MISA's initial session adaptation). ``build_method`` builds the host method
with what the bundle has; ``complete`` finishes it into the model a learner trains and a snapshot serves
(statistics classifier, standardisation, what trains, precision, the eval transform); ``create_model`` is the
two in one. The service, its replicas, ``mepo evaluate`` and the benchmarks all build their model here, so they
run the same model for the same configuration, and a snapshot's ``ModelConfig`` is all a replica needs to
rebuild it.

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
    PROMPTS,
    SIGMA_PRE,
    BundleError,
    load_part,
    load_sigma_pre,
    read_manifest,
)
from mepo_stream.backbone import BackboneConfig, create_backbone, normalization
from mepo_stream.errors import ConfigError
from mepo_stream.heads import NearestClassMean, RunningStandardize, StreamingLDA
from mepo_stream.learner import LearnerConfig
from mepo_stream.methods import MethodsConfig, create_method
from mepo_stream.methods.base import ContinualMethod
from mepo_stream.precision import quantize_int8, resolve_precision
from mepo_stream.transforms import test_transform


@dataclass(frozen=True)
class BundleParts:
    """Which parts of MePo to take, and from which bundle (None: that part is off)."""

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
        files = read_manifest(bundle)["files"]
        has = {name: f"{name}.safetensors" in files for name in (BACKBONE, SIGMA_PRE, PROMPTS)}
        return cls(rep=bundle if has[BACKBONE] else None, cov=bundle if has[SIGMA_PRE] else None,
                   prompts=bundle if has[PROMPTS] else None)


def check_bundle(bundle: Path, backbone: BackboneConfig, needs: dict[str, str] | None = None) -> None:
    """Refuse, before any work, a bundle that lacks a part the caller ``needs`` (part -> what to do instead), or
    whose refined backbone is another architecture or resolution than ``backbone``.

    Example:
        >>> check_bundle(Path("/nonexistent"), BackboneConfig())
        Traceback (most recent call last):
        ...
        mepo_stream.artifacts.BundleError: /nonexistent is not a bundle: manifest.json is missing
    """
    manifest = read_manifest(bundle)
    have = [part for part in (BACKBONE, SIGMA_PRE, PROMPTS) if f"{part}.safetensors" in manifest["files"]]
    for part, instead in (needs or {}).items():
        if part not in have:
            raise BundleError(f"{bundle} has {', '.join(have) or 'no parts'} but no {part}: {instead}")
    made = manifest.get("backbone", {})
    if BACKBONE not in have:
        return
    if made.get("name") not in (None, backbone.name):
        raise ConfigError(f"{bundle} holds a {made['name']} backbone, not {backbone.name}: pass --backbone.name "
                          f"{made['name']}")
    refined = manifest.get("kind") != "imported"  # an imported checkpoint has its architecture's size, not a refine's
    if refined and made.get("img_size") not in (None, backbone.img_size) and not backbone.allow_resample:
        raise ConfigError(f"{bundle} was refined at {made['img_size']} px, not {backbone.img_size} px: pass "
                          f"--backbone.img_size {made['img_size']}, or --backbone.allow_resample true to resample "
                          f"its position table")


def backbone_config(backbone: BackboneConfig, parts: BundleParts) -> BackboneConfig:
    """The backbone to build: the bundle's refined one under Meta Rep, else the configured one."""
    return backbone if parts.rep is None else replace(backbone, weights=str(parts.rep))


def assemble(method: str, n_classes: int, backbone: VisionTransformer, parts: BundleParts = BundleParts(),
             method_config: MethodsConfig = MethodsConfig(), alignment: AlignmentConfig = AlignmentConfig()
             ) -> ContinualMethod:
    """The host method around an already built ``backbone``, with Meta Cov and ISA prompts if ``parts`` say so."""
    align = None
    if parts.cov is not None:
        sigma = load_sigma_pre(parts.cov)
        if sigma.shape[0] != backbone.num_features:
            raise ValueError(f"Sigma_pre is {tuple(sigma.shape)} but the backbone has {backbone.num_features} "
                             f"features")
        align = FeatureAlignment.from_config(sigma, alignment)
    model = create_method(method, backbone, n_classes, align, method_config)
    if parts.prompts is not None:
        load_initial_prompts(model, parts.prompts)
    return model


def load_initial_prompts(model: ContinualMethod, bundle: Path) -> None:
    """Start a prompt-based host from the bundle's ISA prompts; other hosts have none to start from."""
    loader = getattr(model, "load_initial_prompts", None)
    if loader is None:
        return
    loader(load_part(bundle, PROMPTS))


def build_method(method: str, n_classes: int, backbone: BackboneConfig, parts: BundleParts = BundleParts(),
                 method_config: MethodsConfig = MethodsConfig(), alignment: AlignmentConfig = AlignmentConfig(),
                 device: torch.device | None = None) -> ContinualMethod:
    """Build the backbone (the bundle's under Meta Rep) and the host method around it."""
    model = assemble(method, n_classes, create_backbone(backbone_config(backbone, parts)), parts, method_config,
                     alignment)
    return model if device is None else model.to(device)


def make_classifier(cfg: LearnerConfig, method: ContinualMethod) -> torch.nn.Module | None:
    """The statistics classifier ``cfg`` asks for (None for the linear head)."""
    dim, n_classes = method.backbone.num_features, method.n_classes
    if cfg.classifier == "ncm":
        return NearestClassMean(dim, n_classes)
    if cfg.classifier == "linear":
        return None
    prior = None
    if cfg.slda_prior == "sigma_pre":
        if method.alignment is None:
            raise ValueError("slda_prior=sigma_pre needs Sigma_pre: give a MePo bundle with Meta Cov")
        prior = method.alignment.sigma_pre()
    return StreamingLDA(dim, n_classes, cfg.slda_shrinkage, prior)


def plain_frozen_backbone(method: ContinualMethod) -> bool:
    """The method encodes with its backbone alone (no prompts mixed into its layers), and nothing trains it: its
    weights may then be cast to bf16 (prompts in fp32 would meet bf16 LayerNorm weights outside autocast's casts)."""
    names = [n for n, _ in method.named_parameters()]
    backbone_trains = any(p.requires_grad for p in method.backbone.parameters())
    return not backbone_trains and all(n.startswith(("backbone.", "head.")) for n in names)


def quantize_frozen_backbone(method: ContinualMethod) -> None:
    """``--learner.precision int8``: the backbone's Linear layers in int8, where nothing trains through them."""
    if method.device.type != "cpu":
        raise ValueError(f"precision int8 runs on the CPU only (the model is on {method.device}); use auto or bf16")
    if not plain_frozen_backbone(method):
        raise ValueError("precision int8 needs a frozen backbone without prompts (--method frozen, the default): "
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



def complete(method: ContinualMethod, cfg: LearnerConfig, device: torch.device | None = None) -> ContinualMethod:
    """Finish a host method into the model: the statistics classifier and standardisation ``cfg`` asks for, only
    the head trainable when the encoder does not train, on ``device``, in its precision (a frozen plain backbone
    stored in bf16 at bf16), with the eval transform and mask its predictions use, and the sha256 of its backbone
    as built (before any cast: a replica in another precision checks the same weights)."""
    method.backbone_sha256 = weights_sha256(method.backbone)
    method.classifier = make_classifier(cfg, method)
    if not cfg.train_encoder:
        for name, p in method.named_parameters():
            p.requires_grad_(p.requires_grad and name.startswith("head."))
    method.standardize = RunningStandardize(method.backbone.num_features) if cfg.standardize else None
    method.to(device or torch.device("cpu"))
    method.dtype = resolve_precision(cfg.precision, method.device)
    if cfg.cast_frozen_backbone and method.dtype != torch.float32 and plain_frozen_backbone(method):
        method.backbone.to(method.dtype)  # read under autocast as it is: no per-forward weight cast
    if cfg.precision == "int8":
        quantize_frozen_backbone(method)
    method.transform = test_transform(method.backbone.patch_embed.img_size[0], *normalization(method.backbone))
    method.eval_mask = cfg.eval_mask
    return method


@dataclass(frozen=True)
class ModelConfig:
    """What defines a model: its host, backbone, bundle, Meta Cov settings and head (the learner's settings ride
    along; only the head's and the precision's shape the model). A snapshot carries it, so a replica rebuilds the
    model it serves from the snapshot alone."""

    method: str = "frozen"
    """Host method (``mepo_stream.methods.METHODS``)."""
    method_config: MethodsConfig = MethodsConfig()
    """Per-method hyperparameters."""
    backbone: BackboneConfig = BackboneConfig()
    """Pretrained backbone (replaced by the bundle's under Meta Rep)."""
    mepo: Path | None = None
    """MePo bundle: its backbone, Sigma_pre and ISA prompts, where it has them."""
    alignment: AlignmentConfig = AlignmentConfig()
    """Meta Cov settings (used when the bundle has Sigma_pre)."""
    learner: LearnerConfig = LearnerConfig()
    """Classifier, precision, what trains (and the training settings, which do not shape the model)."""
    seed: int = 0
    """Seed of the random initialisation (prompts, head; the backbone too without weights)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str, sort_keys=True)

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def from_json(text: str) -> ModelConfig:
        """The configuration ``to_json`` wrote (nested dataclasses and tuples restored by their types). Cached: a
        replica reads the same configuration with every snapshot, and parsing it takes 40-60 ms."""
        from jsonargparse import ArgumentParser  # the CLI's typed parser: nested dataclasses, tuples, paths

        parser = ArgumentParser()
        parser.add_class_arguments(ModelConfig, nested_key="model")
        return parser.instantiate_classes(parser.parse_object({"model": json.loads(text)})).model


def create_model(cfg: ModelConfig, n_classes: int, device: torch.device | None = None) -> ContinualMethod:
    """The complete model for ``n_classes`` classes: seeded, built with what the bundle has, and finished."""
    if cfg.mepo is not None:
        check_bundle(cfg.mepo, cfg.backbone)
    torch.manual_seed(cfg.seed)
    method = build_method(cfg.method, n_classes, cfg.backbone, BundleParts.of(cfg.mepo), cfg.method_config,
                          cfg.alignment)
    return complete(method, cfg.learner, device)
