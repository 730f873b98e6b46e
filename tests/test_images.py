import io

import numpy as np
import pytest
import torch
from PIL import Image

from mepo_stream import images
from mepo_stream.images import ImageError, ImageLimits, decode_image, rgb_array


def encode(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_valid_images_are_resized_rgb():
    for fmt, mode in (("PNG", "RGBA"), ("JPEG", "L"), ("GIF", "P")):
        out = decode_image(encode(Image.new(mode, (50, 30)), fmt), ImageLimits(size=16))
        assert out.shape == (3, 16, 16) and out.dtype.is_floating_point is False


@pytest.mark.parametrize("data, reason", [
    (b"", "empty"),
    (b"\x89PNG\r\n\x1a\nnot really", "corrupt_image"),  # a PNG signature, then garbage
    (b"hello world", "not_an_image"),
])
def test_garbage_is_rejected_with_a_reason(data, reason):
    with pytest.raises(ImageError) as e:
        decode_image(data, ImageLimits())
    assert e.value.reason == reason


def test_truncated_jpeg_is_corrupt():
    data = encode(Image.new("RGB", (64, 64), "red"), "JPEG")
    with pytest.raises(ImageError) as e:
        decode_image(data[: len(data) // 2], ImageLimits())
    assert e.value.reason == "corrupt_image"


def noise(mode: str, size=(50, 30)) -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if mode == "L" else pixels, mode)


@pytest.mark.parametrize("mode, options", [("RGB", {}), ("RGB", {"subsampling": 0}), ("RGB", {"progressive": True}),
                                           ("L", {}), ("CMYK", {})])
def test_a_jpeg_decodes_to_the_pixels_pil_gives(mode, options, monkeypatch):
    """The fast path (libjpeg-turbo through simplejpeg, for YCbCr and grey JPEGs) and PIL's give the same image,
    so a record and a dataset file decoded either way are the same tensor; CMYK goes through PIL."""
    buf = io.BytesIO()
    noise(mode).save(buf, format="JPEG", quality=90, **options)
    data = buf.getvalue()
    fast_path_taken = []
    jpeg_rgb = images.jpeg_rgb
    monkeypatch.setattr(images, "jpeg_rgb", lambda *a: fast_path_taken.append(r := jpeg_rgb(*a)) or r)
    out = decode_image(data, ImageLimits(size=40))
    assert torch.equal(out, torch.from_numpy(rgb_array(Image.open(io.BytesIO(data)), 40).copy()))
    assert (fast_path_taken[0] is not None) == (mode != "CMYK")


def test_a_jpeg_truncated_inside_its_pixels_is_corrupt():
    data = encode(noise("RGB", (300, 200)), "JPEG")
    with pytest.raises(ImageError) as e:
        decode_image(data[: int(len(data) * 0.9)], ImageLimits())
    assert e.value.reason == "corrupt_image"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_limits(fmt):
    data = encode(Image.new("RGB", (200, 200)), fmt)
    with pytest.raises(ImageError, match="too_large"):
        decode_image(data, ImageLimits(max_bytes=10))
    with pytest.raises(ImageError, match="too_many_pixels"):
        decode_image(data, ImageLimits(max_pixels=100 * 100))


def test_decompression_bomb_is_refused_before_decoding():
    """A PNG declaring 30000 x 30000 pixels (a small file, ~1 GB decoded) fails on the header check."""
    bomb = encode(Image.new("1", (30000, 30000)))
    assert len(bomb) < 1_000_000
    with pytest.raises(ImageError, match="too_many_pixels"):
        decode_image(bomb, ImageLimits())


def test_unsupported_format():
    with pytest.raises(ImageError, match="unsupported_format"):
        decode_image(encode(Image.new("RGB", (8, 8)), "TIFF"), ImageLimits())


def camera_jpeg(width: int, height: int) -> bytes:
    """A smooth, photo-like JPEG (gradients and waves, quality 90) of a camera's size."""
    x, y = np.linspace(0, 1, width), np.linspace(0, 1, height)
    planes = [np.outer(np.sin(7 * y), np.cos(5 * x)), np.outer(y, x), np.outer(np.cos(3 * y), x)]
    return encode(Image.fromarray((np.stack(planes, -1) * 127 + 128).astype(np.uint8)), "JPEG")


@pytest.mark.parametrize("size", [84, 224])
def test_a_camera_jpeg_decodes_at_the_smallest_scale_that_still_covers_the_models_size(size):
    """1280x960 for an 84-px model decodes at 1/8 (160x120), for a 224-px one at 1/4 (320x240), never below the
    model's size, and the resized pixels stay within a few levels of a full decode's."""
    assert images.jpeg_scale(1280, 960, 121) == 4 and images.jpeg_scale(1280, 960, 120) == 8  # 120 still covers
    data = camera_jpeg(1280, 960)
    decoded = images.jpeg_rgb(data, None, size)
    assert decoded.shape == {84: (120, 160, 3), 224: (240, 320, 3)}[size]
    full = torch.from_numpy(rgb_array(Image.open(io.BytesIO(data)), size).copy())
    scaled = decode_image(data, ImageLimits(size=size))
    assert scaled.shape == full.shape == (3, size, size)
    apart = (scaled.int() - full.int()).abs()
    assert apart.float().mean() < 1.0 and apart.max() <= 16, (apart.float().mean(), apart.max())


def test_an_image_under_twice_the_models_size_decodes_whole_as_before():
    data = camera_jpeg(150, 100)
    assert images.jpeg_rgb(data, None, 84).shape == (100, 150, 3)
    assert torch.equal(decode_image(data, ImageLimits(size=84)),
                       torch.from_numpy(rgb_array(Image.open(io.BytesIO(data)), 84).copy()))


def batch_decode_cases() -> list[bytes]:
    """Two camera shapes, a thumbnail, and bad or odd inputs: one of each path and each reason."""
    png = encode(Image.new("RGB", (300, 200), (9, 99, 199)), "PNG")
    return [camera_jpeg(1280, 960), camera_jpeg(640, 480), camera_jpeg(1280, 960), camera_jpeg(64, 64), png,
            camera_jpeg(640, 480)[:-5000], b"not an image", camera_jpeg(4000, 4100)]


def test_a_batch_of_jpegs_decodes_and_resizes_together_near_one_at_a_time():
    """The batched path (nvjpeg's, run here by libjpeg on the CPU) resizes each shape group at once, with an
    antialiased bicubic: within about a level of ``decode_image``'s scaled decode and PIL resize."""
    datas = [camera_jpeg(1280, 960), camera_jpeg(640, 480), camera_jpeg(1280, 960), camera_jpeg(64, 64)]
    batched = images.decode_jpegs(datas, 84, torch.device("cpu"))
    for data, image in zip(datas, batched, strict=True):
        one = decode_image(data, ImageLimits(size=84))
        assert image.dtype == torch.uint8 and image.shape == one.shape == (3, 84, 84)
        apart = (image.int() - one.int()).abs()
        assert apart.float().mean() < 1.5 and apart.max() <= 24, (apart.float().mean(), apart.max())
    assert torch.equal(batched[0], batched[2])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_many_images_decode_each_as_alone_or_with_its_own_error(device):
    """``decode_images`` on the CPU is ``decode_image`` on each; on a GPU the whole JPEGs within the limits decode
    there (pixels within about a level), and every other input keeps its own path and its own reason: a PNG, a
    truncated JPEG, bytes that are no image, and a JPEG over the pixel limit (refused from its header)."""
    limits = ImageLimits(size=84, max_pixels=4000 * 4000)
    datas = batch_decode_cases()
    out = images.decode_images(datas, limits, device)
    assert len(out) == len(datas)
    assert [e.reason for e in out if isinstance(e, ImageError)] == ["corrupt_image", "not_an_image",
                                                                    "too_many_pixels"]
    for data, image in zip(datas[:5], out[:5], strict=True):
        one = decode_image(data, limits)
        assert image.device.type == "cpu" and image.shape == one.shape
        apart = (image.int() - one.int()).abs()
        assert apart.float().mean() < 1.5, apart.float().mean()
        if device == "cpu" or data is datas[4]:  # a PNG never leaves the CPU
            assert torch.equal(image, one)
