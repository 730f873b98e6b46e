"""Predict latency while learning: ``POST /v1/predict`` with one image over real HTTP against a bare forward.

The service learns a stream from Kafka the whole time. The client alternates one HTTP request (one JPEG,
decoded, validated, micro-batched, forwarded by the published snapshot, answered as JSON) with one bare
forward of the same image through the same model in this process: ``encode`` + aligned ``logits`` with
running statistics, as the snapshot does. Alternating puts both under the same load from the learner, so the
ratio is the cost of the service around the forward, not of sharing two cores with training.

Usage:
    python -m benchmarks.predict_latency --spec.mepo runs/refined_dinov2_84
Writes ``benchmarks/results/predict_latency.json``.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import torch
from PIL import Image

from benchmarks.service import ServiceSpec, bare_method, quantiles, running_service, write_result
from mepo_stream.backbone import normalization
from mepo_stream.data import list_files
from mepo_stream.images import ImageLimits, decode_image
from mepo_stream.methods.base import ContinualMethod
from mepo_stream.transforms import test_transform


def bare_predictor(spec: ServiceSpec, n_classes: int):
    """A function timing one eval-mode forward of a uint8 image [1, 3, S, S], as the snapshot runs it."""
    method: ContinualMethod = bare_method(spec, n_classes).eval()
    if method.alignment is not None:  # running statistics as after training, so the alignment does its work
        method.alignment.update_running(torch.randn(64, method.backbone.num_features))
        method.alignment.running_factor()
    tf = test_transform(spec.img_size, *normalization(method.backbone))

    @torch.no_grad()
    def forward(image: torch.Tensor) -> float:
        start = time.perf_counter()
        method.logits(method.encode(tf(image)), "running").softmax(1)
        return time.perf_counter() - start

    return forward


def sample_jpeg(spec: ServiceSpec) -> bytes:
    """A test image of the dataset re-encoded as JPEG (what a client uploads)."""
    with Image.open(list_files(spec.data, "test").files[0]) as img:
        buf = io.BytesIO()
        img.convert("RGB").save(buf, format="JPEG", quality=95)
        return buf.getvalue()


def main(spec: ServiceSpec = ServiceSpec(), requests: int = 300, work: Path = Path("benchmarks/results/work/latency"),
         out: Path = Path("benchmarks/results/predict_latency.json")) -> dict:
    """Measure p50/p99 of single-image predictions while the learner trains; write the JSON result.

    Args:
        spec: Stream, model and MePo bundle of the service under test (the stream must outlast the requests).
        requests: Requests (and as many bare forwards) to time.
        work: Broker and service logs and the service's checkpoint.
        out: JSON result path.
    """
    jpeg = sample_jpeg(spec)
    image = decode_image(jpeg, ImageLimits())[None]  # [1, 3, 64, 64] uint8, as the service decodes it
    bare = bare_predictor(spec, len(list_files(spec.data, "train").classes))
    idle = [bare(image) for _ in range(30)][5:]
    http_s, bare_s = [], []
    with running_service(spec, work) as service:
        while service.status()["classes_seen"] == 0 or service.http.post(
                "/v1/predict", content=jpeg, headers={"content-type": "image/jpeg"}).status_code != 200:
            time.sleep(0.2)
        learned_at_start = service.status()["samples_seen"]
        for _ in range(requests):
            start = time.perf_counter()
            r = service.http.post("/v1/predict", content=jpeg, headers={"content-type": "image/jpeg"})
            http_s.append(time.perf_counter() - start)
            r.raise_for_status()
            bare_s.append(bare(image))
        status = service.status()
    still_learning = status["samples_seen"] < service.stream_length
    h, b = quantiles(http_s), quantiles(bare_s)
    return write_result({
        "benchmark": "predict_latency", "spec": {**spec.__dict__, "mepo": str(spec.mepo)}, "requests": requests,
        "http": h, "bare_forward_while_learning": b, "bare_forward_idle": quantiles(idle),
        "ratio_p50": h["p50_s"] / b["p50_s"], "ratio_p99": h["p99_s"] / b["p99_s"],
        "learned_during_requests": [learned_at_start, status["samples_seen"]],
        "learner_busy_throughout": still_learning,
    }, out)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
