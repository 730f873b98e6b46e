import io

import pytest
from PIL import Image

from mepo_stream.images import ImageError, ImageLimits, decode_image


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


def test_limits():
    data = encode(Image.new("RGB", (200, 200)))
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
