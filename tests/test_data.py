import numpy as np
import pytest
import torch
from PIL import Image

from mepo_stream.data import DataConfig, list_files, load_split
from mepo_stream.images import ImageLimits, decode_image


def test_tinyimagenet_halves_are_disjoint():
    down = load_split(DataConfig("tinyimagenet-downstream", train_per_class=2), "train")
    pre = load_split(DataConfig("tinyimagenet-pretrain", train_per_class=2), "train")
    assert len(down.classes) == len(pre.classes) == 100
    assert not set(down.classes) & set(pre.classes)
    assert down.images.shape == (200, 3, 64, 64) and down.targets.tolist()[:4] == [0, 0, 1, 1]
    assert down.class_names[0] != down.classes[0]  # human-readable names from words.txt
    first = load_split(DataConfig("tinyimagenet-downstream", num_classes=3, train_per_class=2), "train")
    assert first.classes == down.classes[:3] and first.targets.tolist() == [0, 0, 1, 1, 2, 2]


def test_per_class_subsampling_and_test_split(cifar_small):
    test = load_split(cifar_small, "test")
    assert test.images.shape == (100, 3, 32, 32)
    assert test.targets.bincount().tolist() == [10] * 10
    assert test.classes[0] == "airplane"


def test_any_imagefolder(tmp_path):
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(3):
                size = 20 + i  # mixed sizes need load_size
                Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(
                    tmp_path / split / cls / f"{i}.png")
    with pytest.raises(ValueError, match="load_size"):
        load_split(DataConfig(str(tmp_path)), "train")
    data = load_split(DataConfig(str(tmp_path), load_size=16), "test")  # val/ serves as the test split
    assert data.images.shape == (6, 3, 16, 16) and data.classes == ["cat", "dog"]


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="neither a bundled name"):
        load_split(DataConfig("no-such-dataset"), "train")


def test_a_dataset_file_and_the_same_files_bytes_from_kafka_decode_to_the_same_tensor():
    """The service's held-out images (``load_split``) and its stream's (``decode_image``) take one decode and
    resize path, so the any-time accuracy measures the model on images prepared as the stream's are."""
    cfg = DataConfig(dataset="cifar10", num_classes=2, test_per_class=3, load_size=112)
    loaded, files = load_split(cfg, "test"), list_files(cfg, "test").files
    for image, path in zip(loaded.images, files, strict=True):
        assert torch.equal(image, decode_image(path.read_bytes(), ImageLimits(size=112)))
