"""``mepo covariance``: compute Sigma_pre with a backbone over a reference set and write it as a bundle.

Matches the reference notebook: CLS features after the final norm of the (frozen, eval-mode) backbone, on
augmented training images (``augment``; the reference uses its train transforms), averaged per class, then
the ddof=1 covariance of the class means, stored float64.

Example:
    mepo covariance --data.dataset tinyimagenet-pretrain --out runs/sigma_pre
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from timm.models.vision_transformer import VisionTransformer
from tqdm import tqdm

from mepo_stream.artifacts import SIGMA_PRE, library_versions, write_bundle
from mepo_stream.backbone import (
    BackboneConfig,
    cls_feature,
    create_backbone,
    device,
    input_size,
    normalization,
    provenance,
)
from mepo_stream.class_means import ClassMeans
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.transforms import test_transform, train_transform

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CovarianceConfig:
    """How Sigma_pre is estimated."""

    data: DataConfig = field(default_factory=lambda: DataConfig(dataset="tinyimagenet-pretrain"))
    """Reference set: by default the Tiny-ImageNet half reserved for pretraining, all its train images."""
    augment: bool = True
    """Use the training augmentation (crop, flip) as the reference does; false uses the test transform."""
    batch_size: int = 128
    """Images per forward pass."""
    seed: int = 1
    """Seed of the augmentation draws."""


@torch.no_grad()
def sigma_pre(backbone: VisionTransformer, images: ImageSet, cfg: CovarianceConfig, desc: str = "Sigma_pre"
              ) -> torch.Tensor:
    """Sigma_pre [D, D] float64 of ``backbone`` over ``images`` (class means of CLS features)."""
    torch.manual_seed(cfg.seed)
    dev = next(backbone.parameters()).device
    img_size, (mean, std) = input_size(backbone), normalization(backbone)
    tf = train_transform(img_size, mean, std, None) if cfg.augment else test_transform(img_size, mean, std)
    backbone.eval()
    means = ClassMeans(len(images.classes), backbone.num_features)
    for start in tqdm(range(0, len(images), cfg.batch_size), desc=desc, unit="batch"):
        x = images.images[start : start + cfg.batch_size].to(dev)
        means.update(cls_feature(backbone, tf(x)), images.targets[start : start + cfg.batch_size])
    return means.covariance()


def covariance(out: Path, backbone: BackboneConfig = BackboneConfig(), cov: CovarianceConfig = CovarianceConfig()
               ) -> Path:
    """Compute Sigma_pre (MePo's meta covariance) and write it as a bundle folder.

    Args:
        out: Bundle folder to write (sigma_pre.safetensors + manifest.json).
        backbone: The backbone whose features define Sigma_pre.
        cov: Reference set and estimation settings.
    """
    start = time.time()
    model = create_backbone(backbone).to(device())
    images = load_split(cov.data, "train")
    sigma = sigma_pre(model, images, cov)
    manifest = {
        "kind": "covariance",
        "backbone": provenance(backbone),
        "covariance": {**asdict(cov), "n_classes": len(images.classes), "n_images": len(images),
                       "classes": images.classes, "dim": sigma.shape[0]},
        "wall_time_s": round(time.time() - start, 1),
        "versions": library_versions(),
    }
    write_bundle(out, {SIGMA_PRE: {SIGMA_PRE: sigma}}, manifest)
    log.info("wrote Sigma_pre %s from %d images of %d classes to %s", tuple(sigma.shape), len(images),
             len(images.classes), out)
    return out
