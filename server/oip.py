"""The Open Inference Protocol as this server speaks it over HTTP (``server.web.routers.inference_v2``) and gRPC
(``server.grpc_service``): its one input and four outputs, the raw tensor layout, and the errors' meanings.

The input is one ``BYTES`` tensor ``image`` of shape ``[N]``: N encoded JPEG/PNG files, each in raw form (Triton's
binary extension, gRPC's ``raw_input_contents``) a 4-byte little-endian length and its bytes. The outputs are
``label`` (INT64 ``[N, k]``), ``probability`` (FP32 ``[N, k]``), ``novelty`` (FP32 ``[N]``, NaN where the model
scores none) and ``novel`` (BOOL ``[N]``), raw as little-endian arrays (a BOOL as one byte).

Example:
    >>> raw = serialize_bytes([b"ab", b""])
    >>> raw, deserialize_bytes(raw, 2)
    (b'\\x02\\x00\\x00\\x00ab\\x00\\x00\\x00\\x00', [b'ab', b''])
    >>> deserialize_bytes(raw[:5], 1)
    Traceback (most recent call last):
    ...
    server.oip.TensorError: BYTES element 0 says 2 bytes but 1 remain
"""

from __future__ import annotations

import struct

import numpy as np

from server.config import ServeConfig

INPUT_NAME = "image"
MAX_TOP_K = 100
"""The most labels an image may be answered with."""
OUTPUTS = {"label": "INT64", "probability": "FP32", "novelty": "FP32", "novel": "BOOL"}
"""Each output's OIP datatype."""
SHAPES = {"label": [-1, -1], "probability": [-1, -1], "novelty": [-1], "novel": [-1]}
"""Each output's shape: ``[N, k]`` per image's top k, or ``[N]``."""
NUMPY: dict[str, np.dtype] = {"INT64": np.dtype("<i8"), "FP32": np.dtype("<f4"), "BOOL": np.dtype("?")}
TRITON_TYPES = {"BYTES": "TYPE_STRING", "INT64": "TYPE_INT64", "FP32": "TYPE_FP32", "BOOL": "TYPE_BOOL"}
"""The datatype names of Triton's model-configuration extension."""


class TensorError(ValueError):
    """A tensor whose shape, data or raw bytes disagree: HTTP 400, gRPC INVALID_ARGUMENT."""


def serialize_bytes(items: list[bytes]) -> bytes:
    """A ``BYTES`` tensor's raw form: each element as a 4-byte little-endian length and its bytes."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def deserialize_bytes(raw: bytes | memoryview, count: int) -> list[bytes]:
    """The ``count`` elements of a raw ``BYTES`` tensor; ``TensorError`` if the bytes do not hold exactly them."""
    view, at = memoryview(raw), 0
    items: list[bytes] = []
    for i in range(count):
        if at + 4 > len(view):
            raise TensorError(f"BYTES element {i} is missing: the raw data ends after {len(items)} of {count}")
        (size,) = struct.unpack_from("<I", view, at)
        if at + 4 + size > len(view):
            raise TensorError(f"BYTES element {i} says {size} bytes but {len(view) - at - 4} remain")
        items.append(bytes(view[at + 4:at + 4 + size]))
        at += 4 + size
    if at != len(view):
        raise TensorError(f"{len(view) - at} bytes follow the {count} BYTES elements of shape [{count}]")
    return items


def raw_request_limit(settings: ServeConfig, json_bytes: int = 64 * 1024) -> int:
    """The most bytes of a request with ``max_files`` raw images, and ``json_bytes`` of anything else."""
    return settings.max_files * (settings.limits.max_bytes + 4) + json_bytes


def output_arrays(rows: list[dict]) -> dict[str, np.ndarray]:
    """The outputs of a prediction's rows (``Answers.rows``), as arrays."""
    nan = float("nan")
    return {"label": np.array([[c["label"] for c in r["top_k"]] for r in rows], dtype=NUMPY["INT64"]),
            "probability": np.array([[c["probability"] for c in r["top_k"]] for r in rows], dtype=NUMPY["FP32"]),
            "novelty": np.array([nan if r["novelty"] is None else r["novelty"] for r in rows], dtype=NUMPY["FP32"]),
            "novel": np.array([bool(r["novel"]) for r in rows], dtype=NUMPY["BOOL"])}


def model_metadata(name: str) -> dict:
    """What ``GET /v2/models/{name}`` and gRPC's ``ModelMetadata`` answer."""
    return {"name": name, "versions": [], "platform": "pytorch",
            "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": out, "datatype": kind, "shape": SHAPES[out]} for out, kind in OUTPUTS.items()]}
