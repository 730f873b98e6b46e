"""Predict latency while learning: ``POST /v1/predict`` with one image over real HTTP against a bare forward.

The service learns a stream from Kafka while the client sends single-image requests one after another (one
JPEG, decoded, validated, micro-batched, forwarded by the published snapshot, answered as JSON). The bare
reference is the snapshot's own forward (``Snapshot.probabilities``: encode under the learner's autocast dtype,
aligned logits with running statistics, softmax over the seen classes) of the same decoded image, already on
the device, in this process, on the same device as the service (the same GPU where there is one) while nothing
else runs on it: the issue's ratio, which therefore includes the cost of sharing the device with training.
Once the stream is learned, ``idle_requests`` more requests with the learner idle separate the service's own
overhead from that sharing; they are also compared with the backbone's own forward of the image in the learner's
precision, the floor of any prediction: ``ratio_idle_p50_backbone`` times them with the standard library's
keep-alive connection (``RawClient``: the service's latency), ``ratio_idle_p50_backbone_httpx`` with httpx.

(A bare forward timed in this process *while* the service trains is no reference: two processes each running
a 2-thread OpenMP pool on 2 cores slow each other down many times over, 1.7 s instead of 34 ms here.)

Any-time evaluation is switched off (``--protocol.eval_period 0``): it is extra model work on a test set.
"""

from __future__ import annotations

import http.client
import io
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import torch
from PIL import Image

from benchmarks.rows.decode import full_decode
from benchmarks.rows.learner_throughput import stream_batches
from benchmarks.tools.camera_streams import QUALITY, SIZES
from benchmarks.tools.common import wait_until
from benchmarks.tools.service import ServiceSpec, bare_learner, quantiles, running_service, seconds, timed, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.backbone import cls_feature
from mepo_stream.data import list_files
from mepo_stream.images import decode_image
from mepo_stream.precision import autocast
from server.config import ServeConfig
from server.snapshot import take_snapshot


def bare_predictor(spec: ServiceSpec, n_classes: int) -> Callable[[torch.Tensor], float]:
    """A function timing the snapshot's forward of uint8 images [B, 3, S, S], after the learner has learned one
    mini-batch (so there are classes to predict, and running statistics for the alignment and classifier)."""
    learner = bare_learner(spec, n_classes)
    learner.observe(*stream_batches(spec, 1, learner.device)[0])
    snapshot = take_snapshot(learner, 1, ServeConfig.alignment.inference_mode)

    def forward(images: torch.Tensor) -> float:
        images = images.to(learner.device)
        return seconds(lambda: snapshot.probabilities(images), learner.device)

    return forward


def backbone_forward(spec: ServiceSpec, n_classes: int) -> Callable[[torch.Tensor], float]:
    """A function timing the backbone's own forward of uint8 images [B, 3, S, S], normalised beforehand, in the
    learner's precision: the floor of any prediction."""
    model = bare_learner(spec, n_classes).method

    @torch.inference_mode()
    def forward(images: torch.Tensor) -> float:
        x = model.transform(images.to(model.device))  # [B, 3, S, S] normalised

        def run() -> None:
            with autocast(model.device, model.dtype):
                cls_feature(model.backbone, x)

        return seconds(run, model.device)

    return forward


def sample_jpeg(spec: ServiceSpec, camera: str | None = None) -> bytes:
    """A test image of the dataset re-encoded as JPEG (what a client uploads); ``camera`` ("1920x1080"): upscaled
    to that size first, as ``benchmarks.tools.camera_streams`` builds camera images (bicubic, quality 90)."""
    with Image.open(list_files(spec.data, "test").files[0]) as img:
        img = img.convert("RGB")
        if camera is not None:
            img = img.resize(SIZES[camera], Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=95 if camera is None else QUALITY)
        return buf.getvalue()


def _post(service, jpeg: bytes) -> float:
    start = time.perf_counter()
    service.http.post("/v1/predict", content=jpeg, headers={"content-type": "image/jpeg"}).raise_for_status()
    return time.perf_counter() - start


class RawClient:
    """The standard library's keep-alive HTTP/1.1 connection: the service's latency with the least of a client's
    own on top (httpx spends about 1 ms of Python per request on this 2-core machine, where it also takes CPU
    from the service)."""

    def __init__(self, url: str):
        self.connection = http.client.HTTPConnection(urlsplit(url).hostname, urlsplit(url).port, timeout=120)

    def post(self, jpeg: bytes) -> float:
        start = time.perf_counter()
        self.connection.request("POST", "/v1/predict", body=jpeg, headers={"content-type": "image/jpeg"})
        response = self.connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"POST /v1/predict answered {response.status}")
        return time.perf_counter() - start


def idle_latencies(service, jpeg: bytes, requests: int, block: int = 20) -> tuple[list[float], list[float]]:
    """``requests`` timed requests with each client (httpx, raw), in alternating blocks so that both see the
    same machine (its speed drifts by 10-20 % between minutes)."""
    raw, httpx_s, raw_s = RawClient(service.url), [], []
    while len(raw_s) < requests:
        httpx_s += [_post(service, jpeg) for _ in range(min(block, requests - len(httpx_s)))]
        raw_s += [raw.post(jpeg) for _ in range(min(block, requests - len(raw_s)))]
    raw.connection.close()
    return httpx_s, raw_s


def main(spec: ServiceSpec = ServiceSpec(), requests: int = 300, idle_requests: int = 100, camera: str | None = None,
         work: Path = Path("benchmarks/results/work/latency"),
         out: Path = Path("benchmarks/results/predict_latency.json")) -> dict:
    """Measure p50/p99 of single-image predictions while the learner trains; write the JSON result.

    Args:
        spec: Stream, model and MePo bundle of the service under test (the stream should outlast the requests;
            requests stop early when it ends).
        requests: Requests to time while learning.
        idle_requests: Requests to time after the stream is learned.
        camera: Upload the test image upscaled to this camera size (640x480, 1280x960, 1920x1080); the bare path
            then includes the image's decode (the scaled decode the service runs, one thread), and the result also
            times the full decode it replaced.
        work: Broker and service logs and the service's checkpoint.
        out: JSON result path.
    """
    jpeg = sample_jpeg(spec, camera)
    image = decode_image(jpeg, spec.limits)[None]  # [1, 3, S, S] uint8, as the service decodes it
    n_classes = len(list_files(spec.data, "train").classes)
    bare, backbone = bare_predictor(spec, n_classes), backbone_forward(spec, n_classes)
    idle = [bare(image) for _ in range(idle_requests + 5)][5:]
    floor = [backbone(image) for _ in range(idle_requests + 5)][5:]
    decoding = camera_decodes(jpeg, spec, idle_requests) if camera is not None else None
    spec = replace(spec, extra=(*spec.extra, "--protocol.eval_period", "0"))
    http_s = []
    with running_service(spec, work) as service:

        def predicts() -> bool:  # a snapshot with a class is published
            return service.status()["classes_seen"] > 0 and service.http.post(
                "/v1/predict", content=jpeg, headers={"content-type": "image/jpeg"}).status_code == 200

        wait_until(predicts, "a first prediction", poll=0.2, processes=[service.process], transient=())
        learned = [service.status()["samples_seen"]]
        while len(http_s) < requests and learned[-1] < service.stream_length:
            http_s.append(_post(service, jpeg))
            if len(http_s) % 10 == 0:
                learned.append(service.status()["samples_seen"])
        service.wait_learned(service.stream_length)
        http_idle, raw_idle = idle_latencies(service, jpeg, idle_requests)
    h, hi, ri = quantiles(http_s), quantiles(http_idle), quantiles(raw_idle)
    bi, fl = quantiles(idle), quantiles(floor)
    return write_result({
        "benchmark": "predict_latency", "spec": spec.as_json(),
        "requests_while_learning": len(http_s), "learned_during_requests": [learned[0], learned[-1]],
        "http": h, "bare_forward_idle": bi, "ratio_p50": h["p50_s"] / bi["p50_s"],
        "ratio_p99": h["p99_s"] / bi["p99_s"],
        "http_idle": hi, "ratio_idle_p50": hi["p50_s"] / bi["p50_s"], "ratio_idle_p99": hi["p99_s"] / bi["p99_s"],
        "http_idle_raw_client": ri, "backbone_forward_idle": fl,
        "ratio_idle_p50_backbone": ri["p50_s"] / fl["p50_s"],
        "ratio_idle_p50_backbone_httpx": hi["p50_s"] / fl["p50_s"],
        **({} if decoding is None else camera_result(camera, jpeg, decoding, idle, ri)),
    }, out, *spec.placement())


def camera_decodes(jpeg: bytes, spec: ServiceSpec, repeats: int) -> dict[str, list[float]]:
    """Seconds of the service's scaled decode of ``jpeg`` and of the full decode it replaced (one thread each, the
    first 5 of each left out)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scaled = timed(lambda: decode_image(jpeg, spec.limits), repeats + 5, torch.device("cpu"))[5:]
        full = timed(lambda: full_decode(jpeg, spec.limits.size), repeats + 5, torch.device("cpu"))[5:]
    finally:
        torch.set_num_threads(threads)
    return {"scaled": scaled, "full": full}


def camera_result(camera: str, jpeg: bytes, decoding: dict[str, list[float]], forward: list[float],
                  raw_idle: dict) -> dict:
    """The camera upload's bare paths (decode + the snapshot's forward, each quantile a sum of the parts'), and
    the service's idle p50 against the scaled one."""
    f = quantiles(forward)
    bare = {name: {q: quantiles(times)[q] + f[q] for q in f} for name, times in decoding.items()}
    return {"camera": camera, "camera_bytes": len(jpeg), "bare_scaled_decode_and_forward_idle": bare["scaled"],
            "bare_full_decode_and_forward_idle": bare["full"],
            "ratio_idle_p50_camera": raw_idle["p50_s"] / bare["scaled"]["p50_s"]}


def table_rows(r: dict) -> list[Row]:
    """The table's rows: latency while learning and idle against the bare forward, and idle against the
    backbone's own forward with each client."""
    rows: list[Row] = []
    for q, goal in (("p50", 1.3), ("p99", 3.0)):
        ratio = r[f"ratio_{q}"]
        rows.append((f"Predict latency {q}, one image while learning (bare: idle device)",
                     fmt(r["http"][f"{q}_s"], "ms"), fmt(r["bare_forward_idle"][f"{q}_s"], "ms"), ratio,
                     f"≤ {goal}", ratio <= goal))
    for q in ("p50", "p99"):
        rows.append((f"Predict latency {q}, one image, learner idle", fmt(r["http_idle"][f"{q}_s"], "ms"),
                     fmt(r["bare_forward_idle"][f"{q}_s"], "ms"), r[f"ratio_idle_{q}"], "–", None))
    floor = fmt(r["backbone_forward_idle"]["p50_s"], "ms")
    ratio = r["ratio_idle_p50_backbone"]
    rows.append(("Predict latency p50, one image, learner idle, stdlib client (bare: the backbone's own forward)",
                 fmt(r["http_idle_raw_client"]["p50_s"], "ms"), floor, ratio, "≤ 1.3", ratio <= 1.3))
    rows.append(("Predict latency p50, one image, learner idle, httpx client (bare: the backbone's own forward)",
                 fmt(r["http_idle"]["p50_s"], "ms"), floor, r["ratio_idle_p50_backbone_httpx"], "–", None))
    return rows


def camera_rows(r: dict) -> list[Row]:
    """The table's row of a camera upload (``--camera``): against its scaled decode and the snapshot's forward."""
    scaled, full = r["bare_scaled_decode_and_forward_idle"], r["bare_full_decode_and_forward_idle"]
    ours, ratio = r["http_idle_raw_client"]["p50_s"], r["ratio_idle_p50_camera"]
    return [(f"Predict latency p50, one {r['camera']} JPEG ({r['camera_bytes'] / 1024:.0f} KB), learner idle, stdlib "
             f"client (bare: its scaled decode + the snapshot's forward; with the full decode it replaced: "
             f"{fmt(full['p50_s'], 'ms')})", fmt(ours, "ms"), fmt(scaled["p50_s"], "ms"), ratio, "≤ 1.3",
             ratio <= 1.3)]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
