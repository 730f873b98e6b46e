"""Staging a mini-batch in host memory for the learner's device.

``OnlineLearner.observe`` copies the uint8 batch to its device with ``non_blocking=True`` and only then runs
the batch-wise augmentation (one random draw per mini-batch, torchvision v2 on the device tensor). From
ordinary (pageable) memory CUDA makes that copy synchronous; from page-locked memory it is queued on the
stream behind the previous step's kernels, so the transfer overlaps them instead of waiting for them.
"""

from __future__ import annotations

import torch


def stack_images(images: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The images as one uint8 batch [B, 3, S, S], stacked straight into pinned memory when ``device`` is CUDA.

    Stacking into a pinned buffer costs no extra copy over a plain stack; on a CPU learner pinning buys
    nothing (and needs CUDA), so the batch is an ordinary tensor there.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return torch.stack(images)
    out = torch.empty((len(images), *images[0].shape), dtype=images[0].dtype, pin_memory=True)
    return torch.stack(images, out=out)
