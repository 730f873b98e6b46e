"""Predict throughput: 16 concurrent clients against the bare batched forward of the same model.

The service first learns a short stream (so it has classes to predict), then ``clients`` concurrent clients
each send single-image ``POST /v1/predict`` requests back to back for ``seconds``; images answered per second
is the service's rate. The bare reference is the snapshot's forward of batches of ``clients`` images (the
largest batch that many single-image clients can form) through the same model in this process, on the same
device and under the same autocast dtype as the service, with the service stopped, right before and after the
service run. The clients are asyncio tasks in this process (one core's worth of HTTP work at most), which on a
small machine competes with the server for the CPU: that is part of what is measured.

Usage:
    python -m benchmarks.rows.predict_throughput --spec.mepo runs/refined_dinov2_84
Writes ``benchmarks/results/predict_throughput.json``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import httpx
import torch

from benchmarks.rows.predict_latency import bare_predictor, sample_jpeg
from benchmarks.tools.service import ServiceSpec, running_service, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.data import list_files
from mepo_stream.images import decode_image


def bare_rate(spec: ServiceSpec, batch: int, seconds: float) -> float:
    """Images/s of the bare eval forward on batches of ``batch`` images, over about ``seconds``."""
    forward = bare_predictor(spec, len(list_files(spec.data, "train").classes))
    images = decode_image(sample_jpeg(spec), spec.limits)[None].expand(batch, -1, -1, -1).contiguous()
    forward(images)  # warm-up
    spent, n = 0.0, 0
    while spent < seconds:
        spent += forward(images)
        n += batch
    return n / spent


async def hammer(url: str, jpeg: bytes, clients: int, seconds: float) -> tuple[int, int, float]:
    """(answered, failed, elapsed) for ``clients`` tasks posting one image at a time until ``seconds`` pass."""
    answered = failed = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        deadline = time.monotonic() + seconds

        async def client() -> None:
            nonlocal answered, failed
            while time.monotonic() < deadline:
                r = await http.post("/v1/predict", content=jpeg, headers={"content-type": "image/jpeg"})
                answered, failed = answered + (r.status_code == 200), failed + (r.status_code != 200)

        start = time.monotonic()
        await asyncio.gather(*(client() for _ in range(clients)))
        return answered, failed, time.monotonic() - start


def main(spec: ServiceSpec = ServiceSpec(train_per_class=10), clients: int = 16, seconds: float = 30.0,
         bare_seconds: float = 10.0, work: Path = Path("benchmarks/results/work/throughput"),
         out: Path = Path("benchmarks/results/predict_throughput.json")) -> dict:
    """Measure images/s answered by ``clients`` concurrent clients against the bare batched forward.

    Args:
        spec: Stream (learned before the clients start), model and MePo bundle of the service under test.
        clients: Concurrent clients, one image per request.
        seconds: Duration of the client run.
        bare_seconds: Duration of each bare run (before and after).
        work: Broker and service logs and the service's checkpoint.
        out: JSON result path.
    """
    torch.manual_seed(0)
    jpeg = sample_jpeg(spec)
    before = bare_rate(spec, clients, bare_seconds)
    spec = replace(spec, extra=(*spec.extra, "--protocol.eval_period", "0"))  # no evaluation competing with clients
    with running_service(spec, work) as service:
        service.wait_learned(service.stream_length)
        answered, failed, elapsed = asyncio.run(hammer(service.url, jpeg, clients, seconds))
    after = bare_rate(spec, clients, bare_seconds)
    rate, bare = answered / elapsed, (before + after) / 2
    return write_result({
        "benchmark": "predict_throughput", "spec": spec.as_json(), "clients": clients,
        "seconds": elapsed, "answered": answered, "failed": failed, "service_images_per_s": rate,
        "bare_batch": clients, "bare_images_per_s": bare, "bare_before_after": [before, after], "ratio": rate / bare,
    }, out, *spec.placement())


def table_rows(r: dict) -> list[Row]:
    """The table's row: images/s of the service's clients against the bare batched forward."""
    return [(f"Predict throughput, {r['clients']} clients (images/s)", fmt(r["service_images_per_s"], "/s"),
             fmt(r["bare_images_per_s"], "/s"), r["ratio"], "≥ 0.70", r["ratio"] >= 0.7)]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
