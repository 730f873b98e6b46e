"""Image decode to the model's size, one thread: the scaled JPEG decode against a full decode, per camera size.

Why: a camera JPEG decoded whole costs more than the model's forward (a 1920x1080 one, tens of milliseconds), and
most of its pixels are thrown away by the resize to the model's size. ``mepo_stream.images`` decodes JPEGs at
libjpeg's smallest fast downscale that still covers the size (``jpeg_scale``); this measures what that saves on
real-size images (``benchmarks.tools.camera_streams``: bundled images upscaled to 640x480, 1280x960 and 1920x1080, JPEG
quality 90; and PNG and WebP at 1280x960, which keep the full decode), and how far its pixels are from the full
decode's. The bare path is the full decode then the same resize (what the decode did before the scaled decode).

Usage:
    python -m benchmarks.rows.decode --size 84 --images 40
Writes ``benchmarks/results/decode.json``.
"""

from __future__ import annotations

import io
import os
import statistics
import time
from pathlib import Path

import numpy as np
import simplejpeg
import torch
from PIL import Image

from benchmarks.tools.camera_streams import SIZES, camera_folder
from benchmarks.tools.service import write_result
from benchmarks.tools.table import Row
from mepo_stream.data import DataConfig, list_files
from mepo_stream.images import ImageLimits, decode_image, rgb_array


def full_decode(data: bytes, size: int) -> np.ndarray:
    """The whole image decoded (libjpeg-turbo for a JPEG, PIL otherwise), then resized: the bare path."""
    if data.startswith(b"\xff\xd8\xff"):
        return rgb_array(Image.fromarray(simplejpeg.decode_jpeg(data, colorspace="RGB")), size)
    with Image.open(io.BytesIO(data)) as img:
        return rgb_array(img, size)


def median_ms(fn, blobs: list[bytes], rounds: int) -> float:
    """The median over ``rounds`` of the mean time per image of ``fn`` over ``blobs``."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for blob in blobs:
            fn(blob)
        times.append((time.perf_counter() - start) / len(blobs))
    return 1000 * statistics.median(times)


def measure(folder: Path, size: int, images: int, rounds: int) -> dict:
    """Scaled and full decode of the first ``images`` test images of ``folder``, and their pixels apart."""
    files = list_files(DataConfig(dataset=str(folder)), "test").files[:images]
    blobs = [f.read_bytes() for f in files]
    limits = ImageLimits(size=size)
    ours = median_ms(lambda b: decode_image(b, limits), blobs, rounds)
    bare = median_ms(lambda b: full_decode(b, size), blobs, rounds)
    apart = np.concatenate([np.abs(decode_image(b, limits).numpy().astype(int) - full_decode(b, size).astype(int))
                            .ravel() for b in blobs])
    return {"folder": str(folder), "images": len(blobs), "bytes_mean": int(np.mean([len(b) for b in blobs])),
            "scaled_ms": ours, "full_ms": bare, "speedup": bare / ours,
            "pixels_apart_max": int(apart.max()), "pixels_apart_mean": float(apart.mean())}


def main(size: int = 84, images: int = 40, rounds: int = 5, dataset: str = "tinyimagenet-downstream",
         out: Path = Path("benchmarks/results/decode.json")) -> dict:
    """Time the decode of each camera size (and PNG and WebP at 1280x960) to ``size`` px, one thread.

    Args:
        size: The model's input size the images are decoded to.
        images: Test images per stream (one per class first: the first ``images`` of the class-sorted split).
        rounds: Timed passes over them (the median is kept).
        dataset: The bundled dataset the camera streams are built from.
        out: JSON result path.
    """
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    data = DataConfig(dataset=dataset, num_classes=images, train_per_class=1, test_per_class=1)
    kinds = {"source (64 px JPEG)": camera_folder(data, *_native(dataset), "JPEG")}
    kinds |= {f"{name} JPEG": camera_folder(data, *wh, "JPEG") for name, wh in SIZES.items()}
    kinds |= {f"1280x960 {fmt}": camera_folder(data, 1280, 960, fmt) for fmt in ("PNG", "WEBP")}
    streams = {kind: measure(folder, size, images, rounds) for kind, folder in kinds.items()}
    return write_result({"benchmark": "decode", "size": size, "threads": 1, "streams": streams},
                        out, torch.device("cpu"), torch.float32)


def _native(dataset: str) -> tuple[int, int]:
    """The bundled dataset's own image size (its first training image's)."""
    with Image.open(list_files(DataConfig(dataset=dataset, num_classes=1, train_per_class=1), "train").files[0]) as img:
        return img.size


def table_rows(r: dict) -> list[Row]:
    """The table's rows: each stream's scaled decode against the full decode (the goal: for camera JPEGs)."""
    rows: list[Row] = []
    for kind, s in r["streams"].items():
        camera_jpeg = kind in ("1280x960 JPEG", "1920x1080 JPEG")
        ratio = s["scaled_ms"] / s["full_ms"]
        rows.append((f"Decode to {r['size']} px, {kind} ({s['bytes_mean'] / 1024:.0f} KB), one thread, ms an image "
                     f"(pixels apart from the full decode: max {s['pixels_apart_max']}, mean "
                     f"{s['pixels_apart_mean']:.2f} of 255)",
                     f"{s['scaled_ms']:.2f} ms", f"{s['full_ms']:.2f} ms (full decode, then resize)", ratio,
                     "≤ 0.2 (5× faster)" if camera_jpeg else "–", ratio <= 0.2 if camera_jpeg else None))
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
