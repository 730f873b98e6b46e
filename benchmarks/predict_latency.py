"""Predict latency while learning: ``POST /v1/predict`` with one image over real HTTP against a bare forward.

The service learns a stream from Kafka while the client sends single-image requests one after another (one
JPEG, decoded, validated, micro-batched, forwarded by the published snapshot, answered as JSON). The bare
reference is one eval forward of the same image through the same model in this process (``encode`` + aligned
``logits`` with running statistics, as the snapshot does) on an otherwise idle machine: the issue's ratio, which
therefore includes the cost of sharing the CPU with training. Once the stream is learned, ``idle_requests``
more requests with the learner idle separate the service's own overhead from that sharing.

(A bare forward timed in this process *while* the service trains is no reference: two processes each running
a 2-thread OpenMP pool on 2 cores slow each other down many times over, 1.7 s instead of 34 ms here.)

Any-time evaluation is switched off (``--cfg.eval_period 0``): it is extra model work on a test set.
"""

from __future__ import annotations

import io
import time
from dataclasses import replace
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


def _post(service, jpeg: bytes) -> float:
    start = time.perf_counter()
    service.http.post("/v1/predict", content=jpeg, headers={"content-type": "image/jpeg"}).raise_for_status()
    return time.perf_counter() - start


def main(spec: ServiceSpec = ServiceSpec(), requests: int = 300, idle_requests: int = 100,
         work: Path = Path("benchmarks/results/work/latency"),
         out: Path = Path("benchmarks/results/predict_latency.json")) -> dict:
    """Measure p50/p99 of single-image predictions while the learner trains; write the JSON result.

    Args:
        spec: Stream, model and MePo bundle of the service under test (the stream should outlast the requests;
            requests stop early when it ends).
        requests: Requests to time while learning.
        idle_requests: Requests to time after the stream is learned.
        work: Broker and service logs and the service's checkpoint.
        out: JSON result path.
    """
    jpeg = sample_jpeg(spec)
    image = decode_image(jpeg, ImageLimits())[None]  # [1, 3, 64, 64] uint8, as the service decodes it
    bare = bare_predictor(spec, len(list_files(spec.data, "train").classes))
    idle = [bare(image) for _ in range(idle_requests + 5)][5:]
    spec = replace(spec, extra=(*spec.extra, "--cfg.eval_period", "0"))
    http_s = []
    with running_service(spec, work) as service:
        while service.status()["classes_seen"] == 0 or service.http.post(
                "/v1/predict", content=jpeg, headers={"content-type": "image/jpeg"}).status_code != 200:
            time.sleep(0.2)
        learned = [service.status()["samples_seen"]]
        while len(http_s) < requests and learned[-1] < service.stream_length:
            http_s.append(_post(service, jpeg))
            if len(http_s) % 10 == 0:
                learned.append(service.status()["samples_seen"])
        service.wait_learned(service.stream_length)
        http_idle = [_post(service, jpeg) for _ in range(idle_requests)]
    h, hi, bi = quantiles(http_s), quantiles(http_idle), quantiles(idle)
    return write_result({
        "benchmark": "predict_latency", "spec": {**spec.__dict__, "mepo": str(spec.mepo)},
        "requests_while_learning": len(http_s), "learned_during_requests": [learned[0], learned[-1]],
        "http": h, "bare_forward_idle": bi, "ratio_p50": h["p50_s"] / bi["p50_s"],
        "ratio_p99": h["p99_s"] / bi["p99_s"],
        "http_idle": hi, "ratio_idle_p50": hi["p50_s"] / bi["p50_s"], "ratio_idle_p99": hi["p99_s"] / bi["p99_s"],
    }, out)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
