"""Request-side prediction shared by the v1 and Open Inference Protocol routes: validate, decode, predict."""

from __future__ import annotations

import math
import time

import torch

from mepo_stream.images import ImageError, ImageLimits, decode_image
from server.config import ServeConfig
from server.serving import ServingModel
from server.web.dependencies import ApiError

STATUS_BY_REASON = {"too_large": 413, "too_many_pixels": 413}


def decode_all(items: list[tuple[str, bytes]], settings: ServeConfig, limits: ImageLimits) -> list[torch.Tensor]:
    """uint8 images [3, S, S] each, unstacked (the model thread stacks); the first bad one fails the request."""
    if not items:
        raise ApiError(400, "no image in the request", "no_image")
    if len(items) > settings.max_files:
        raise ApiError(413, f"{len(items)} images in one request; the limit is {settings.max_files}", "too_many_files")
    images = []
    for name, data in items:
        try:
            images.append(decode_image(data, limits))
        except ImageError as e:
            raise ApiError(STATUS_BY_REASON.get(e.reason, 422), f"{name}: {e.message}", e.reason) from e
    return images


def predict_uploads(service: ServingModel, items: list[tuple[str, bytes]], settings: ServeConfig,
                    top_k: int) -> tuple[dict, list[dict]]:
    """Decode and predict in one call: one hand-over to a worker thread, one wake-up of the event loop."""
    return predict_images(service, decode_all(items, settings, upload_limits(service, settings)), top_k)


def upload_limits(service: ServingModel, settings: ServeConfig) -> ImageLimits:
    """The upload limits, their size the model's input size unless --limits.size gives one."""
    if settings.limits.size is not None:
        return settings.limits
    model = service.snapshot.model
    if model is None:  # a replica before its first snapshot
        raise ApiError(503, "the model has not learned any class yet", "no_classes_yet")
    return settings.limits.at(model.input_size)


def predict_images(service: ServingModel, images: list[torch.Tensor], top_k: int) -> tuple[dict, list[dict]]:
    """The answering snapshot's identity, and per image its top-k labels, novelty score and flag."""
    start = time.perf_counter()
    try:
        answers = service.predict(images)
    except LookupError as e:
        raise ApiError(503, str(e), "no_classes_yet") from e
    finally:
        service.metrics.predict_seconds.observe(time.perf_counter() - start)
    service.metrics.observe_novelty(answers.novelty, answers.novel, answers.snapshot.novelty_threshold)
    snapshot, threshold = answers.snapshot, answers.snapshot.novelty_threshold
    meta = {"model_version": snapshot.version, "samples_seen": snapshot.samples_seen,
            "novelty_threshold": round(threshold, 6) if math.isfinite(threshold) else None}
    return meta, answers.rows(top_k, service.class_names)
