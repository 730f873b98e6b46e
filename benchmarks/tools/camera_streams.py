"""Camera-size image streams built from the bundled data, for the benchmarks and tests that stream real images.

Why: every bundled dataset is 32 or 64 px, while users stream camera JPEGs of 640x480 to 1920x1080, whose decode
costs more than the model's forward unless it is cut to the model's size. These folders put such images through
the same paths (``mepo produce --data.dataset FOLDER``, uploads, ``load_split``).

A stream is an ImageFolder (``train/`` and ``test/`` class folders) of a bundled dataset's images upscaled
(bicubic) to ``width`` x ``height`` and saved as JPEG (quality 90), PNG or WebP (quality 90), built once into the
cache (``$MEPO_CACHE/camera/...``) and reused: the same sources and settings give the same bytes, and nothing is
committed.

Example:
    python -m benchmarks.tools.camera_streams --width 1280 --height 960 --data.dataset cifar10 --data.train_per_class 5
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from mepo_stream.cache import cache_dir
from mepo_stream.data import DataConfig, list_files
from mepo_stream.files import atomic_path

SIZES = {"640x480": (640, 480), "1280x960": (1280, 960), "1920x1080": (1920, 1080)}
"""The camera sizes the benchmarks stream."""
FORMATS = {"JPEG": ".jpg", "PNG": ".png", "WEBP": ".webp"}
QUALITY = 90


def camera_folder(data: DataConfig, width: int, height: int, fmt: str = "JPEG") -> Path:
    """The ImageFolder of ``data``'s train and test images at ``width`` x ``height`` in ``fmt``, built once."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose from {', '.join(FORMATS)}")
    name = (f"{Path(data.dataset).name}-c{data.num_classes}-tr{data.train_per_class}-te{data.test_per_class}-"
            f"{width}x{height}-{fmt.lower()}")
    root = cache_dir() / "camera" / name
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(root, replace=False) as tmp:
        for split in ("train", "test"):
            listing = list_files(data, split)
            jobs = [(path, tmp / split / listing.classes[label] / f"{i:05d}{FORMATS[fmt]}")
                    for i, (path, label) in enumerate(zip(listing.files, listing.targets, strict=True))]
            for folder in {out.parent for _, out in jobs}:
                folder.mkdir(parents=True, exist_ok=True)
            with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
                list(pool.map(lambda job: _write(*job, (width, height), fmt), jobs))
    return root


def _write(source: Path, out: Path, size: tuple[int, int], fmt: str) -> None:
    with Image.open(source) as img:
        big = img.convert("RGB").resize(size, Image.BICUBIC)
    options = {"quality": QUALITY} if fmt in ("JPEG", "WEBP") else {}
    big.save(out, format=fmt, **options)


def main(data: DataConfig = DataConfig(dataset="cifar10", train_per_class=10, test_per_class=5),
         width: int = 1280, height: int = 960, fmt: str = "JPEG") -> Path:
    """Build (or find) one camera-size stream and print its folder.

    Args:
        data: The bundled (or any ImageFolder) images to upscale.
        width: Width of every image, in pixels.
        height: Height of every image, in pixels.
        fmt: JPEG, PNG or WEBP.
    """
    root = camera_folder(data, width, height, fmt)
    print(root)
    return root


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
