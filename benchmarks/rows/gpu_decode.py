"""Camera JPEGs to the model's size on a GPU (nvJPEG, batched, resized there) against the CPU's scaled decode.

Why: beside a GPU model the learner decodes each poll's images either one by one on the CPU (libjpeg's
scaled decode, ``mepo_stream.images.decode_image``) or, with ``--gpu_decode``, on the GPU in one batch
(``decode_images``). This measures both, in images/s, on the same camera streams (``benchmarks.tools.camera_streams``):
the CPU path in 1 thread and in pools of threads, the GPU path at a poll's batch size, each image ending as uint8
at the model's size on the CPU, as the intake books it. It also reports how far the GPU's pixels are from the CPU's.

Usage:
    python -m benchmarks.rows.gpu_decode --sizes '[84, 224]' --images 256
Writes ``benchmarks/results/gpu_decode.json``.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.tools.camera_streams import SIZES, camera_folder
from benchmarks.tools.service import write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.backbone import device
from mepo_stream.data import DataConfig, list_files
from mepo_stream.images import ImageLimits, decode_image, decode_images


def rate(fn, blobs: list[bytes], rounds: int) -> float:
    """Images/s of ``fn(blobs)`` (after a warm-up call), the median over ``rounds``."""
    fn(blobs)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(blobs)
        times.append(time.perf_counter() - start)
    return len(blobs) / statistics.median(times)


def cpu_decoder(limits: ImageLimits, threads: int):
    """The CPU path: ``decode_image`` on each, in ``threads`` threads."""
    def decode(blobs: list[bytes]) -> list[torch.Tensor]:
        if threads == 1:
            return [decode_image(b, limits) for b in blobs]
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(lambda b: decode_image(b, limits), blobs))
    return decode


def gpu_decoder(limits: ImageLimits, dev: torch.device, batch: int):
    """``--gpu_decode``'s path: ``decode_images`` on polls of ``batch`` images."""
    def decode(blobs: list[bytes]) -> list:
        return [image for i in range(0, len(blobs), batch) for image in decode_images(blobs[i:i + batch], limits, dev)]
    return decode


def measure(blobs: list[bytes], size: int, dev: torch.device, threads: list[int], batch: int, rounds: int) -> dict:
    limits = ImageLimits(size=size)
    cpu = {str(t): rate(cpu_decoder(limits, t), blobs, rounds) for t in threads}
    gpu = rate(gpu_decoder(limits, dev, batch), blobs, rounds)
    ours, theirs = gpu_decoder(limits, dev, batch)(blobs), cpu_decoder(limits, 1)(blobs)
    apart = torch.cat([(a.int() - b.int()).abs().flatten() for a, b in zip(ours, theirs, strict=True)]).float()
    return {"cpu_images_per_s": cpu, "gpu_images_per_s": gpu, "gpu_over_best_cpu": gpu / max(cpu.values()),
            "pixels_apart_mean": float(apart.mean()), "pixels_apart_max": int(apart.max())}


def main(sizes: tuple[int, ...] = (84, 224), images: int = 256, batch: int = 64, threads: tuple[int, ...] | None = None,
         rounds: int = 3, dataset: str = "cifar10", out: Path = Path("benchmarks/results/gpu_decode.json")) -> dict:
    """Time both decode paths on the 1280x960 and 1920x1080 JPEG streams, to each model size.

    Args:
        sizes: Model input sizes the images are decoded to.
        images: Images per stream (the first of each class in turn).
        batch: Images per GPU call (a poll's records).
        threads: CPU decode threads to time (null: 1, 4 and every core).
        rounds: Timed passes (the median is kept).
        dataset: The bundled dataset the camera streams are built from.
        out: JSON result path.
    """
    dev = device()  # on a CPU the "GPU" path is decode_images there, decode_image on each: a smoke run
    threads = sorted(set(threads or (1, 4, os.cpu_count() or 1)))
    per_class = -(-images // 10)
    data = DataConfig(dataset=dataset, train_per_class=1, test_per_class=per_class)
    streams = {}
    for name in ("1280x960", "1920x1080"):
        files = list_files(DataConfig(dataset=str(camera_folder(data, *SIZES[name]))), "test").files[:images]
        blobs = [f.read_bytes() for f in files]
        streams[name] = {str(size): measure(blobs, size, dev, threads, batch, rounds) for size in sizes}
        streams[name]["images"] = len(blobs)
    return write_result({"benchmark": "gpu_decode", "batch": batch, "threads": threads, "streams": streams},
                        out, dev, torch.uint8)


def table_rows(r: dict) -> list[Row]:
    """The table's rows: each stream and size on the GPU against the CPU's best pool of threads."""
    rows: list[Row] = []
    for name, stream in r["streams"].items():
        for size, m in ((k, v) for k, v in stream.items() if k != "images"):
            threads, cpu = max(m["cpu_images_per_s"].items(), key=lambda kv: kv[1])
            rows.append((f"{name} JPEG to {size} px on the GPU, batches of {r['batch']} (images/s; pixels apart from "
                         f"the CPU's decode: mean {m['pixels_apart_mean']:.2f}, max {m['pixels_apart_max']})",
                         fmt(m["gpu_images_per_s"], "/s"), f"{fmt(cpu, '/s')} (CPU scaled decode, {threads} threads)",
                         m["gpu_over_best_cpu"], "–", None))
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
