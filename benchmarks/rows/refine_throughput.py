"""Refine throughput: ``mepo refine``'s training step against a bare PyTorch SGD loop on the same machine.

Both loops train the same backbone + meta head with the same SGD optimizer, batch size and resolution, side
by side in one process (alternating rounds, so drift in machine load hits both equally), on the device
``mepo refine`` trains on, with its frozen stem and in its precision (bf16 autocast where the hardware has it).
The bare loop feeds pre-normalised float tensors already on the
device and does forward, cross-entropy, backward and step only; the refine step also indexes uint8 images,
moves them to the device, augments them, masks the logits to the group and does the DDP-ready loss scaling.
The ratio refine/bare is the cost of everything around the model's own compute.

Usage:
    python -m benchmarks.rows.refine_throughput --img_size 84 --batch_size 64 --steps 10
Writes ``benchmarks/results/refine_throughput.json``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.tools.service import seconds, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.backbone import BackboneConfig, create_backbone, device, normalization
from mepo_stream.data import ImageSet
from mepo_stream.meta import freeze
from mepo_stream.precision import autocast, resolve_precision
from mepo_stream.transforms import test_transform
from offline.optim import create_optimizer, param_groups
from offline.refine import Distributed, MetaModel, RefineConfig, Trainer


def _loops(backbone: BackboneConfig, batch_size: int, steps: int, n_classes: int, dev: torch.device
           ) -> tuple[Callable[[], None], Callable[[], None], torch.dtype]:
    """``steps`` refine steps (``Trainer.step``) and ``steps`` bare SGD steps of the same model (the same frozen
    stem, optimizer groups and autocast precision), as two closures, and that precision."""
    cfg, img_size = RefineConfig(batch_size=batch_size), backbone.img_size
    images = ImageSet(torch.randint(0, 256, (batch_size * 4, 3, 64, 64), dtype=torch.uint8),
                      torch.randint(0, n_classes, (batch_size * 4,)), [str(c) for c in range(n_classes)], [])
    trainer = Trainer.create(backbone, images, cfg, Distributed())
    group = torch.arange(n_classes)
    bare = MetaModel(create_backbone(backbone), n_classes).to(dev)
    freeze(bare.backbone, cfg.freeze)
    groups = param_groups(bare.backbone, bare.head, cfg.lr_backbone, cfg.lr_head, cfg.layer_decay, cfg.weight_decay)
    bare_opt = create_optimizer(groups, cfg.optimizer, cfg.momentum)
    dtype = resolve_precision(cfg.precision, dev)
    mean, std = normalization(bare.backbone)
    x = test_transform(img_size, mean, std)(images.images[:batch_size].to(dev))  # [B, 3, S, S] float, on dev
    y = images.targets[:batch_size].to(dev)

    def run_ours() -> None:
        for s in range(steps):
            trainer.step(list(range(s % 4 * batch_size, (s % 4 + 1) * batch_size)), group, trainer.train_tf)

    def run_bare() -> None:
        for _ in range(steps):
            with autocast(dev, dtype):
                loss = F.cross_entropy(bare(x).float(), y)
            bare_opt.zero_grad(set_to_none=True)
            loss.backward()
            bare_opt.step()

    return run_ours, run_bare, dtype


def main(model: str = "vit_small_patch14_dinov2", weights: str | None = None, img_size: int = 84,
         batch_size: int = 64, steps: int = 10, rounds: int = 3, n_classes: int = 100,
         out: Path = Path("benchmarks/results/refine_throughput.json")) -> dict:
    """Measure images/s of the refine step and of a bare SGD loop; write the JSON result.

    Args:
        model: timm ViT name.
        weights: Backbone weights (null = random init; speed does not depend on the values).
        img_size: Input resolution.
        batch_size: Global batch size.
        steps: Timed steps per round and loop.
        rounds: Alternating rounds (the best round of each loop is reported).
        n_classes: Meta-head outputs.
        out: JSON result path.
    """
    torch.manual_seed(0)
    dev = device()
    run_ours, run_bare, dtype = _loops(BackboneConfig(model, weights, img_size), batch_size, steps, n_classes, dev)
    timings: dict[str, list[float]] = {"refine": [], "bare": []}
    run_ours(), run_bare()  # warm-up
    for _ in range(rounds):
        for name, fn in (("refine", run_ours), ("bare", run_bare)):
            timings[name].append(steps * batch_size / seconds(fn, dev))
    return write_result({
        "benchmark": "refine_throughput", "model": model, "img_size": img_size, "batch_size": batch_size,
        "steps_per_round": steps, "rounds": rounds,
        "refine_images_per_s": max(timings["refine"]), "bare_images_per_s": max(timings["bare"]),
        "ratio": max(timings["refine"]) / max(timings["bare"]), "all_rounds": timings,
    }, out, dev, dtype)


def table_rows(r: dict) -> list[Row]:
    """The table's row: the refine step's images/s against the bare SGD loop."""
    return [("Refine throughput (images/s)", fmt(r["refine_images_per_s"], "/s"), fmt(r["bare_images_per_s"], "/s"),
             r["ratio"], "–", None)]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
