"""Datasets: the bundled archives (verified, extracted once into the cache) and any ImageFolder.

Bundled names (archives in ``../shared/data`` or ``$MEPO_DATA_DIR``):

* ``cifar10``: CIFAR-10, 10 classes, train/test.
* ``tinyimagenet-downstream``: the Tiny-ImageNet classes at sorted-wnid positions 100-199 (the Si-Blurry
  downstream half; 250 train / 50 val each).
* ``tinyimagenet-pretrain``: positions 0-99, reserved for ``refine`` and the Sigma_pre reference set. The
  two halves are disjoint, so no refinement class ever appears downstream. Its training split has all 500 images
  of each class when the data folder also holds ``tinyimagenet200_pretrain_extra.tar.gz`` (the other 250 of the
  original 500; each class's base images first), else the base archive's 250;
  ``tinyimagenet-pretrain-base`` is the 250 alone.

Anything else is a path to an ImageFolder root with ``train/`` and ``test/`` (or ``val/``) class folders.
A split is decoded once into a uint8 tensor [N, 3, H, W] in memory (25k 64x64 images are 300 MB), because
the online protocol revisits the test set at every evaluation.
"""

from __future__ import annotations

import os
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mepo_stream.cache import cache_dir
from mepo_stream.files import atomic_path, sha256_file
from mepo_stream.images import decode_file

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}


@dataclass(frozen=True)
class Archive:
    file: str
    sha256: str
    top: str


ARCHIVES = {
    "cifar10": Archive(
        "cifar10-jpg.tar.gz", "f36e439358bb6e69c9b50b6bb1f0516ce3ac1a421774cd098d466b68096a9a02", "cifar10-jpg"
    ),
    "tinyimagenet": Archive(
        "tinyimagenet200.tar.gz", "3dd1a2c1ad23a477e7e0eaa5c5c1b35cd71fe4f2270551fa61844d5f5b73b1b4",
        "tinyimagenet200",
    ),
    "tinyimagenet_pretrain_extra": Archive(
        "tinyimagenet200_pretrain_extra.tar.gz", "a1a96599dec9395ec6e6bacc05ba3ecce1cef9c8f0a3158915f49d06ed0b9155",
        "tinyimagenet200_pretrain_extra",
    ),
}


@dataclass(frozen=True)
class Bundled:
    """A bundled dataset: its archive, the slice of its sorted class folders, and an optional archive of more
    training images of the same classes, used when the data folder holds it."""

    archive: str
    classes: slice
    extra_train: str | None = None


BUNDLED = {
    "cifar10": Bundled("cifar10", slice(None)),
    "tinyimagenet-downstream": Bundled("tinyimagenet", slice(100, 200)),
    "tinyimagenet-pretrain": Bundled("tinyimagenet", slice(0, 100), extra_train="tinyimagenet_pretrain_extra"),
    "tinyimagenet-pretrain-base": Bundled("tinyimagenet", slice(0, 100)),
}


@dataclass(frozen=True)
class DataConfig:
    """Which images to stream and evaluate on."""

    dataset: str = "tinyimagenet-downstream"
    """A bundled name (cifar10, tinyimagenet-downstream, tinyimagenet-pretrain) or an ImageFolder root."""
    num_classes: int | None = None
    """Keep only the first N classes (sorted folder order), for a smaller stream; null keeps all."""
    train_per_class: int | None = None
    """Keep only the first N training images of each class (dataset order); null keeps all."""
    test_per_class: int | None = None
    """Keep only the first N test images of each class; null keeps all."""
    load_size: int | None = None
    """Resize every image to this square size when decoding; null keeps the native size (where images are decoded
    together, as ``mepo evaluate`` does, they must then share it; a stream's images are each resized to the model's
    input and may differ)."""
    data_dir: Path | None = None
    """Folder holding the bundled archives (default: $MEPO_DATA_DIR, else ../shared/data)."""


@dataclass(frozen=True)
class ImageSet:
    """A decoded split: ``images`` uint8 [N, 3, H, W], ``targets`` [N] in ``0..C-1``, class folder names."""

    images: torch.Tensor
    targets: torch.Tensor
    classes: list[str]
    class_names: list[str]

    def __len__(self) -> int:
        return len(self.targets)


def data_dir(configured: Path | None = None) -> Path:
    """Where the bundled archives are: the argument, ``$MEPO_DATA_DIR``, or ``../shared/data``."""
    candidates: list[str | Path | None] = [configured, os.environ.get("MEPO_DATA_DIR"),
                  Path(__file__).resolve().parents[2] / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for c in candidates:
        if c is not None and any((Path(c) / ARCHIVES[a].file).is_file() for a in ("cifar10", "tinyimagenet")):
            return Path(c)
    raise FileNotFoundError(
        "bundled dataset archives not found: pass --data.data_dir or set MEPO_DATA_DIR to the folder holding "
        f"{ARCHIVES['cifar10'].file} and {ARCHIVES['tinyimagenet'].file}"
    )


def extract(name: str, source_dir: Path | None = None) -> Path:
    """Extract a bundled archive into the cache once (sha256 verified) and return its top folder."""
    archive = ARCHIVES[name]
    root = cache_dir() / "datasets" / name
    if (root / archive.top).is_dir():
        return root / archive.top
    src = data_dir(source_dir) / archive.file
    digest = sha256_file(src)
    if digest != archive.sha256:
        raise ValueError(f"{src}: sha256 {digest} does not match the expected {archive.sha256}")
    root.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(root, replace=False) as tmp, tarfile.open(src) as tar:
        tar.extractall(tmp, filter="data")
    return root / archive.top


def _class_names(root: Path, folders: list[str]) -> list[str]:
    words = root / "words.txt"  # Tiny-ImageNet: wnid -> human-readable names
    if not words.is_file():
        return folders
    table = dict(line.rstrip("\n").split("\t", 1) for line in words.read_text().splitlines() if "\t" in line)
    return [table.get(f, f).split(",")[0] for f in folders]


def _resolve(cfg: DataConfig, split: str) -> tuple[list[Path], slice]:
    """The dataset's roots (the first one's class folders name the classes; the others add images to them) and the
    slice of its sorted class folders."""
    if cfg.dataset in BUNDLED:
        bundled = BUNDLED[cfg.dataset]
        roots = [extract(bundled.archive, cfg.data_dir)]
        extra = bundled.extra_train
        if split == "train" and extra and (data_dir(cfg.data_dir) / ARCHIVES[extra].file).is_file():
            roots.append(extract(extra, cfg.data_dir))
        return roots, bundled.classes
    root = Path(cfg.dataset)
    if not root.is_dir():
        raise FileNotFoundError(f"dataset {cfg.dataset!r} is neither a bundled name ({', '.join(BUNDLED)}) "
                                "nor an ImageFolder root")
    return [root], slice(None)


def _split_dir(root: Path, split: str) -> Path:
    names = {"train": ["train"], "test": ["test", "val"]}[split]
    for n in names:
        if (root / n).is_dir():
            return root / n
    raise FileNotFoundError(f"{root} has no {' or '.join(names)}/ folder")


@dataclass(frozen=True)
class FileList:
    """A split as image files in dataset order (class-sorted), before decoding."""

    files: list[Path]
    targets: list[int]
    classes: list[str]
    class_names: list[str]
    names: list[str]
    """Each file relative to its dataset's root (``train/cat/0001.jpg``): what its owner calls it, on any machine."""


def list_files(cfg: DataConfig, split: str) -> FileList:
    """The ``train`` or ``test`` split of ``cfg`` as files, in dataset order (what the producer replays)."""
    roots, class_slice = _resolve(cfg, split)
    split_roots = [_split_dir(root, split) for root in roots]
    folders = sorted(p.name for p in split_roots[0].iterdir() if p.is_dir())[class_slice][: cfg.num_classes]
    per_class = cfg.train_per_class if split == "train" else cfg.test_per_class
    files, targets, names = [], [], []
    for label, folder in enumerate(folders):
        found = [(path, root) for root, split_root in zip(roots, split_roots, strict=True)
                 for path in _images(split_root / folder, per_class)][:per_class]
        files += [path for path, _ in found]
        names += [path.relative_to(root).as_posix() for path, root in found]
        targets += [label] * len(found)
    if not files:
        raise ValueError(f"{split_roots[0]}: no images found")
    return FileList(files, targets, folders, _class_names(roots[0], folders), names)


def _images(folder: Path, first: int | None) -> list[Path]:
    """The ``first`` images of a class folder (all: None), names sorted as strings: Paths are made only for those
    kept (comparing or making a Path for each file of a large dataset is slow); none when the folder is absent (an
    extra archive without that class)."""
    if not folder.is_dir():
        return []
    names = sorted(e.name for e in os.scandir(folder) if os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES)
    return [folder / name for name in names[:first]]


def load_split(cfg: DataConfig, split: str) -> ImageSet:
    """Decode the ``train`` or ``test`` split of ``cfg`` into memory (class-sorted dataset order)."""
    listing = list_files(cfg, split)
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        arrays = list(pool.map(lambda p: decode_file(p, cfg.load_size), listing.files))
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"{cfg.dataset}: images have different sizes {sorted(shapes)[:3]}; set --data.load_size")
    return ImageSet(torch.from_numpy(np.stack(arrays)), torch.tensor(listing.targets), listing.classes,
                    listing.class_names)
