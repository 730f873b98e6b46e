import numpy as np
import pytest
import torch
from PIL import Image

from mepo_stream.data import ARCHIVES, DataConfig, data_dir, list_files, load_split
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


def test_the_pretraining_half_has_all_500_images_a_class_when_the_extra_archive_is_there(tmp_path):
    """Each class's 250 base images first (so ``train_per_class`` up to 250 picks what it always did), then the
    extra archive's; without that archive, or by the base name, the 250 alone. The test split gains nothing."""
    if not (data_dir() / ARCHIVES["tinyimagenet_pretrain_extra"].file).is_file():
        pytest.skip("needs tinyimagenet200_pretrain_extra.tar.gz in the data folder")
    full = list_files(DataConfig(dataset="tinyimagenet-pretrain"), "train")
    base = list_files(DataConfig(dataset="tinyimagenet-pretrain-base"), "train")
    assert len(base.files) == 25_000 and len(full.files) == 49_998  # two duplicates left out of the extra archive
    assert full.classes == base.classes and full.files[:250] == base.files[:250]
    assert {int(f.stem.rsplit("_", 1)[1]) for f in full.files[250:500]} == set(range(250, 500))
    assert list_files(DataConfig(dataset="tinyimagenet-pretrain", train_per_class=7), "train").files == [
        f for c in range(100) for f in base.files[250 * c:250 * c + 7]]
    assert len(list_files(DataConfig(dataset="tinyimagenet-pretrain"), "test").files) == 5_000
    shared = data_dir()
    (tmp_path / ARCHIVES["tinyimagenet"].file).symlink_to(shared / ARCHIVES["tinyimagenet"].file)
    alone = list_files(DataConfig(dataset="tinyimagenet-pretrain", data_dir=tmp_path), "train")
    assert alone.files == base.files


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
