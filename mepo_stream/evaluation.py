"""Any-time evaluation: accuracy on the test images of the classes seen so far (the Si-Blurry protocol).

Shared by ``mepo evaluate`` (offline) and the streaming server, so both report the same number.
"""

from __future__ import annotations

import torch

from mepo_stream.alignment import AlignMode
from mepo_stream.data import ImageSet
from mepo_stream.learner import OnlineLearner
from mepo_stream.metrics import per_class_accuracy


@torch.no_grad()
def evaluate_seen(learner: OnlineLearner, test: ImageSet, batch_size: int = 128,
                  modes: tuple[AlignMode, ...] = ("batch", "running")) -> dict[AlignMode, tuple[float, dict]]:
    """Micro accuracy and per-class accuracy on the seen-class test images, per alignment mode.

    Test images are taken in dataset order and batches of ``batch_size`` (this matters for the ``batch``
    mode, whose statistics come from the test batch, as in the reference). One forward pass serves all modes.
    """
    seen = torch.tensor(learner.exposed, dtype=torch.long)
    keep = torch.isin(test.targets, seen).nonzero().squeeze(1)
    if len(keep) == 0:
        return {m: (float("nan"), {}) for m in modes}
    preds: dict[AlignMode, list[torch.Tensor]] = {m: [] for m in modes}
    for start in range(0, len(keep), batch_size):
        for mode, p in learner.predict(test.images[keep[start : start + batch_size]], modes).items():
            preds[mode].append(p)
    target = test.targets[keep]
    out = {}
    for mode, p in preds.items():
        p = torch.cat(p)
        out[mode] = ((p == target).float().mean().item(), per_class_accuracy(p, target))
    return out
