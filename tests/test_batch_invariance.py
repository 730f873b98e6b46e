"""One image, one feature: an image's feature does not depend on the mini-batch it is encoded in.

What a group of learners needs to build one learner's model (docs/scale-out.md): partitions make different
mini-batches (a partition's last, partial batch; a rebalance; an idle topic), so the sums add up to the single
learner's only if each image's feature is the same bits in all of them.

Seen failing without the fix: int8 on a 2-core AMD EPYC (AVX512-BF16), features up to 7e-2 apart between batch
sizes (one activation scale per batch); bf16 on a 2-core Xeon with AMX, up to 7.3e-3 (issue 40). bf16 on that EPYC
was invariant with and without it. The shape-dependent backbone below stands in for such a kernel on any machine.
"""

from __future__ import annotations

import pytest
import torch

from mepo_stream.backbone import BackboneConfig
from mepo_stream.learner import LearnerConfig
from mepo_stream.methods.base import Encoded
from mepo_stream.model import ModelConfig, create_model
from mepo_stream.precision import native_bf16

BATCH = 24
"""The learner's mini-batch: not a multiple of 16 or 8, so chunks of those cross its fixed shape's edges."""


def precisions(device: torch.device) -> list[str]:
    """The precisions the learner offers on ``device`` that this machine runs natively (int8: the CPU only)."""
    return ["fp32"] + (["bf16"] if native_bf16(device) else []) + (["int8"] if device.type == "cpu" else [])


def cases() -> list:
    """Each precision the CPU offers natively, and fp32 and bf16 on CUDA (marked ``cuda``: skipped without one)."""
    gpu = [pytest.param("cuda", p, marks=pytest.mark.cuda) for p in ("fp32", "bf16")]
    return [("cpu", p) for p in precisions(torch.device("cpu"))] + gpu


def features_by_split(model, images: torch.Tensor, size: int) -> torch.Tensor:
    """The features [N, D] of ``images`` encoded ``size`` at a time."""
    return torch.cat([model.encode_images(chunk).feature for chunk in images.split(size)])


@pytest.mark.parametrize("device,precision", cases())
def test_the_same_images_give_the_same_features_at_every_batch_size(device, precision):
    """DINOv2 ViT-S/14's shapes at 84 px (random weights: kernels are chosen by shape, not by values)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = ModelConfig(backbone=BackboneConfig(name="vit_small_patch14_dinov2", weights=None, img_size=84),
                      learner=LearnerConfig(precision=precision, batch_size=BATCH))
    model = create_model(cfg, 10, torch.device(device))
    model.backbone.blocks = model.backbone.blocks[:1]  # every block has the same shapes: one holds them all
    images = torch.randint(0, 256, (BATCH, 3, 84, 84), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    full = model.encode_images(images).feature  # [BATCH, D]
    for size in (16, 8, 3):
        assert torch.equal(features_by_split(model, images, size), full), f"batches of {size}"
    for i in (0, 7, BATCH - 1):  # alone, at three positions of the full batch
        assert torch.equal(model.encode_images(images[i:i + 1]).feature, full[i:i + 1]), f"image {i} alone"


class ShapeDependentNorm(torch.nn.Module):
    """A final norm whose output moves with the batch size, as another kernel's rounding does."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) + 1e-3 * len(x)


def test_every_forward_runs_in_the_learners_fixed_shape_whatever_the_kernels_do():
    """With a backbone whose output depends on the batch size, features still agree between batch sizes, and with
    ``invariant_predictions`` a prediction does not depend on what else was asked with it; without, it does."""
    tiny = BackboneConfig(name="test_vit", weights=None, img_size=32)
    images = torch.randint(0, 256, (10, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for invariant in (False, True):
        learner = LearnerConfig(batch_size=8, precision="fp32", classifier="linear", invariant_predictions=invariant)
        model = create_model(ModelConfig(backbone=tiny, learner=learner), 3)
        model.backbone.norm = ShapeDependentNorm(model.backbone.norm)
        full = model.encode_images(images).feature
        for size in (1, 3, 8):
            assert torch.equal(features_by_split(model, images, size), full), f"batches of {size}"
        assert torch.equal(model.encode_images(images[:3], fixed_shape=False).feature, full[:3]) is False
        alone = model.predict_proba(images[:1], n_seen=3)
        among = model.predict_proba(images[:3], n_seen=3)[:1]
        assert torch.equal(alone, among) is invariant


@pytest.mark.parametrize("classifier", ["slda", "ncm", "linear"])
def test_a_features_readout_does_not_depend_on_the_rows_read_out_with_it(classifier):
    """Every head reads a row out in the learner's fixed shape: a matrix product of 1 row takes another kernel than
    one of many, and rounds differently (seen on every CPU here, fp32 and fp64), so without the blocks one image's
    logits alone differ in the last bits from its logits among a full batch."""
    learner = LearnerConfig(batch_size=BATCH, precision="fp32", classifier=classifier)
    cfg = ModelConfig(backbone=BackboneConfig(name="test_vit", weights=None, img_size=32), learner=learner)
    model = create_model(cfg, 5)
    features = torch.randn(BATCH + 5, model.backbone.num_features, generator=torch.Generator().manual_seed(2))
    labels = torch.arange(BATCH + 5) % 5
    if model.classifier is not None:
        model.classifier.update(features, labels)
    model.eval()

    def logits(rows: torch.Tensor) -> torch.Tensor:
        return model.predict_logits(Encoded(rows, torch.zeros(())), n_seen=5)

    everything = logits(features)  # [BATCH + 5, 5]: a full block and a padded one
    for i in (0, 3, BATCH - 1, BATCH + 4):
        assert torch.equal(logits(features[i:i + 1]), everything[i:i + 1]), f"row {i} alone"
    assert torch.equal(logits(features[:3]), everything[:3])

