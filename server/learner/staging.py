"""Staging a mini-batch in host memory for the learner's device: ``OnlineLearner.observe`` copies it with
``non_blocking=True``, which CUDA makes synchronous from pageable memory but queues behind the previous step's
kernels from page-locked memory, so the transfer overlaps them."""

from __future__ import annotations

import torch


def stack_images(images: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The images as one uint8 batch [B, 3, S, S], stacked straight into pinned memory when ``device`` is CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return torch.stack(images)
    out = torch.empty((len(images), *images[0].shape), dtype=images[0].dtype, pin_memory=True)
    return torch.stack(images, out=out)
