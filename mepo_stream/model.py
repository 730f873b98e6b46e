"""One place that turns configs and a MePo bundle into a ready host method.

A MePo bundle may carry up to three parts, each optional: a (meta-refined) backbone (Meta Rep), Sigma_pre
(Meta Cov), and ISA-warmed prompts (MISA's initial session adaptation). ``build_method`` applies what the
bundle has; the service, ``mepo evaluate`` and the benchmarks all build their model through it, so they run
the same model for the same flags.

Example:
    >>> from mepo_stream.backbone import BackboneConfig
    >>> m = build_method("linear_probe", 10, BackboneConfig(name="test_vit", weights=None, img_size=32))
    >>> type(m).__name__, m.alignment is None
    ('LinearProbe', True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from timm.models.vision_transformer import VisionTransformer

from mepo_stream.alignment import AlignmentConfig, FeatureAlignment
from mepo_stream.artifacts import BACKBONE, PROMPTS, SIGMA_PRE, load_part, load_sigma_pre, read_manifest
from mepo_stream.backbone import BackboneConfig, create_backbone
from mepo_stream.methods import MethodsConfig, create_method
from mepo_stream.methods.base import ContinualMethod


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
