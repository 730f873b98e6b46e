"""Decoding untrusted image bytes (Kafka records, HTTP uploads) with explicit limits.

Every failure is an ``ImageError`` with a short machine-readable ``reason`` (used as the dead-letter header
and in HTTP 4xx bodies) and a human message. Limits guard against oversize payloads and decompression bombs:
the pixel count is checked from the header *before* any pixel is decoded.

Example:
    >>> decode_image(b"not an image", ImageLimits())  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    mepo_stream.images.ImageError: not_an_image: cannot identify the image format
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")


@dataclass(frozen=True)
class ImageLimits:
    """What an accepted image may be."""

    max_bytes: int = 10 * 1024 * 1024
    """Largest encoded image accepted, in bytes."""
    max_pixels: int = 16 * 1024 * 1024
    """Largest width x height accepted (decompression-bomb guard)."""
    size: int | None = None
    """Side of the square every image is decoded and resized to (a JPEG at its smallest fast DCT scale that still
    covers it). None: the model's own input size, so the backbone sees its resolution, decoded from the source."""

    def at(self, model_size: int) -> ImageLimits:
        """These limits with ``size`` resolved: the one given, else the model's ``model_size``.

        Example:
            >>> ImageLimits().at(224).size, ImageLimits(size=64).at(224).size
            (224, 64)
        """
        return self if self.size is not None else replace(self, size=model_size)


class ImageError(ValueError):
    """An image that cannot be accepted; ``reason`` is a short code."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


def rgb_array(img: Image.Image | np.ndarray, size: int | None) -> np.ndarray:
    """The one conversion every image takes, a dataset file or a record's bytes: RGB, resized (bicubic) to a
    ``size`` square unless it is that already (None: as it is), as contiguous uint8 [3, H, W]. ``img``: a PIL
    image, or RGB pixels [H, W, 3] as libjpeg gives them (an image already at ``size`` never goes through PIL)."""
    if isinstance(img, Image.Image):
        img = img.convert("RGB")
    elif size is None or img.shape[:2] == (size, size):
        return np.ascontiguousarray(img.transpose(2, 0, 1))  # [3, H, W]
    else:
        img = Image.fromarray(img)
    if size is not None and img.size != (size, size):
        img = img.resize((size, size), Image.Resampling.BICUBIC)
    return np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1))  # [3, H, W]


def jpeg_rgb(data: bytes, max_pixels: int | None, size: int | None = None) -> np.ndarray | None:
    """A JPEG decoded by libjpeg-turbo directly (``simplejpeg``: the same pixels as PIL's plugin machinery, at a
    fraction of its cost on small images), as RGB pixels [H, W, 3]; None for anything it does not take (not a
    JPEG, not YCbCr or grey (PIL converts CMYK its own way), corrupt, truncated: ``strict`` refuses what libjpeg
    only warns about), which PIL then decodes or refuses with its reason. Its pixel limit is checked from the
    header, before any pixel is decoded.

    With a ``size``, libjpeg decodes at the smallest of its fast DCT scales (1/2, 1/4, 1/8) whose image still
    covers ``size`` on both sides (``jpeg_scale``): a camera JPEG costs a fraction of its full decode, and the
    resize that follows starts from those pixels. An image under twice ``size`` decodes whole."""
    if (header := _jpeg_size(data)) is None:
        return None
    height, width = header
    if max_pixels is not None and width * height > max_pixels:
        raise ImageError("too_many_pixels", f"{width}x{height} exceeds the limit of {max_pixels} pixels")
    scale = jpeg_scale(width, height, size)
    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True, min_height=-(-height // scale),
                                      min_width=-(-width // scale))  # [H / scale, W / scale, 3]
    except ValueError:
        return None


def jpeg_scale(width: int, height: int, size: int | None) -> int:
    """The largest of libjpeg's fast downscales (8, 4, 2; 1: none) that leaves a ``width`` x ``height`` JPEG at
    least ``size`` on both sides (libjpeg rounds a scaled side up).

    Example (1920x1080 for an 84-px model, for a 224-px one; a 64-px image):
        >>> jpeg_scale(1920, 1080, 84), jpeg_scale(1920, 1080, 224), jpeg_scale(64, 64, 84)
        (8, 4, 1)
    """
    if size is None:
        return 1
    return next((f for f in (8, 4, 2) if -(-width // f) >= size and -(-height // f) >= size), 1)


def decode_file(path: Path, size: int | None) -> np.ndarray:
    """A dataset file as uint8 [3, H, W], through the same decoder as a record's bytes (``decode_image``)."""
    data = path.read_bytes()
    if (pixels := jpeg_rgb(data, None, size)) is not None:
        return rgb_array(pixels, size)
    with Image.open(io.BytesIO(data)) as img:
        return rgb_array(img, size)


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Parse the header and check format and size; any parser failure on untrusted bytes becomes an
    ``ImageError``. Nothing is decoded yet."""
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as e:
        raise ImageError("not_an_image", "cannot identify the image format") from e
    except Image.DecompressionBombError as e:
        raise ImageError("too_many_pixels", str(e)) from e
    except Exception as e:  # PIL raises OSError, SyntaxError, AttributeError... on malformed headers
        raise ImageError("corrupt_image", str(e) or type(e).__name__) from e
    if img.format not in ALLOWED_FORMATS:
        raise ImageError("unsupported_format", f"{img.format} is not one of {', '.join(ALLOWED_FORMATS)}")
    width, height = img.size
    if width * height > max_pixels:
        raise ImageError("too_many_pixels", f"{width}x{height} exceeds the limit of {max_pixels} pixels")
    return img


def decode_image(data: bytes, limits: ImageLimits) -> torch.Tensor:
    """Validated RGB image as uint8 [3, size, size] (``limits.size`` None: at its own size)."""
    if not data:
        raise ImageError("empty", "the image is empty")
    if len(data) > limits.max_bytes:
        raise ImageError("too_large", f"{len(data)} bytes exceeds the limit of {limits.max_bytes}")
    if (pixels := jpeg_rgb(data, limits.max_pixels, limits.size)) is not None:
        return torch.from_numpy(rgb_array(pixels, limits.size))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel limit decides
        img = _open(data, limits.max_pixels)
        try:
            return torch.from_numpy(rgb_array(img, limits.size))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # truncated or corrupt
            raise ImageError("corrupt_image", str(e) or type(e).__name__) from e


def decode_images(datas: list[bytes], limits: ImageLimits, device: torch.device | str = "cpu"
                  ) -> list[torch.Tensor | ImageError]:
    """Many images, each as ``decode_image`` gives it (uint8 [3, size, size], on the CPU) or its ``ImageError``.

    On a CUDA ``device`` the JPEGs a GPU can take decode there together (nvjpeg, one batched call) and resize there
    (bicubic, antialiased), so a camera stream costs the CPU only the header checks; the rest, and any batch the
    GPU refuses, take ``decode_image``. The byte and pixel limits hold before any pixel is decoded, on both paths.
    Elsewhere it is ``decode_image`` on each.
    """
    device = torch.device(device)
    on_device = [i for i, data in enumerate(datas) if device.type == "cuda" and _device_jpeg(data, limits)]
    out: list[torch.Tensor | ImageError | None] = [None] * len(datas)
    if on_device and limits.size is not None:
        for i, image in zip(on_device, decode_jpegs([datas[i] for i in on_device], limits.size, device),
                            strict=True):
            out[i] = image
    return [decoded if decoded is not None else _decode_or_error(data, limits)
            for decoded, data in zip(out, datas, strict=True)]


def _decode_or_error(data: bytes, limits: ImageLimits) -> torch.Tensor | ImageError:
    try:
        return decode_image(data, limits)
    except ImageError as e:
        return e


def _device_jpeg(data: bytes, limits: ImageLimits) -> bool:
    """Whether the GPU should decode ``data``: a whole (it ends with its EOI marker, so a truncated one takes the
    strict CPU path, which refuses it) YCbCr or grey JPEG within the limits. Anything else, including one over a
    limit, goes to ``decode_image``, which names the reason."""
    if not data.endswith(b"\xff\xd9") or len(data) > limits.max_bytes or (header := _jpeg_size(data)) is None:
        return False
    return header[0] * header[1] <= limits.max_pixels


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """Height and width from the header of a YCbCr or grey JPEG, the kinds libjpeg and nvJPEG decode as PIL would
    (PIL converts CMYK its own way); None for anything else."""
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return (height, width) if colorspace in ("YCbCr", "Gray") else None


def decode_jpegs(datas: list[bytes], size: int, device: torch.device) -> list[torch.Tensor | None]:
    """JPEGs decoded in one batch on ``device`` (nvjpeg on CUDA, libjpeg on the CPU) and resized there to ``size``
    x ``size``, back on the CPU as uint8 [3, size, size] each; all None when the decoder refuses the batch. No
    limit is checked here: ``decode_images`` hands it only JPEGs within them."""
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in datas]
    try:
        decoded = batch_jpeg_decoder()(encoded, mode="RGB", device=device)  # [3, H_i, W_i] each
    except RuntimeError:
        return [None] * len(datas)
    resized = torch.empty((len(datas), 3, size, size), dtype=torch.uint8, device=device)  # [N, 3, S, S]
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, image in enumerate(decoded):
        by_shape.setdefault(tuple(image.shape), []).append(i)
    for indices in by_shape.values():  # one camera's images share a shape: one resize for all of them
        batch = torch.stack([decoded[i] for i in indices]).float()  # [n, 3, H, W]
        if batch.shape[-2:] != (size, size):
            batch = F.interpolate(batch, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
        resized[indices] = batch.round_().clamp_(0, 255).to(torch.uint8)
    return list(resized.cpu().unbind(0))


@functools.cache
def batch_jpeg_decoder() -> Callable:
    """TorchCodec's ``decode_jpeg``, which decodes a list of JPEGs in one nvJPEG call on CUDA; torchvision's (the
    same call, deprecated there) where TorchCodec is missing or does not load beside this torch."""
    try:
        from torchcodec.decoders import decode_jpeg
    except (ImportError, OSError, RuntimeError):  # its native library is built for particular torch versions
        from torchvision.io import decode_jpeg as torchvision_decode_jpeg

        return torchvision_decode_jpeg
    return decode_jpeg
