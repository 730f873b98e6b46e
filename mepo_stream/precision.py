"""Which precision the model runs in: bf16 where the hardware multiplies bf16 natively, fp32 elsewhere.

Statistics, the alignment and the LDA stay in fp32/fp64 whatever is chosen here; only the backbone and the
prompts run under autocast (and a frozen plain backbone may store its weights in bf16, ``mepo_stream.model``).
``int8`` (never chosen by ``auto``) quantises a frozen plain backbone's Linear layers on the CPU and runs the rest
in fp32 (``quantize_int8``).

Example:
    >>> resolve_precision("fp32", torch.device("cpu"))
    torch.float32
    >>> with autocast(torch.device("cpu"), torch.float32):  # fp32: a no-op
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.float32
"""

from __future__ import annotations

import functools
import warnings
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Literal

import torch


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware: a CUDA GPU that supports bf16, or a CPU with AMX
    or AVX512-BF16 (there bf16 autocast runs the backbone 2.5-3x faster than fp32; docs/performance.md)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


Precision = Literal["auto", "fp32", "bf16", "int8"]
"""The precisions every ``--*.precision`` option offers (``--learner.precision``, ``--loop.precision``)."""


def resolve_precision(precision: Precision, device: torch.device) -> torch.dtype:
    """The autocast dtype: bf16 where asked (or, for auto, where the hardware has native bf16), else fp32 (int8
    included: its quantised layers take fp32 activations)."""
    if precision == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}[precision]


def quantize_int8(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its Linear layers' weights in int8 and their activations quantised per batch (dynamic
    quantisation, in place; CPU only, for inference: nothing trains through it).

    Why ``torch.ao.quantization.quantize_dynamic``, which torch deprecates in favour of torchao: on the CPU it runs
    fbgemm's int8 kernels in eager mode, and torchao's eager replacement (``Int8DynamicActivationInt8WeightConfig``)
    ran DINOv2 ViT-S/14 no faster than bf16 weights (160 against 262 images/s on a 2-core AMD EPYC;
    docs/performance.md). The pinned torch still ships it; its deprecation warnings are silenced here only.

    Example:
        >>> quantize_int8(torch.nn.Sequential(torch.nn.Linear(4, 2)))[0]._get_name()
        'DynamicQuantizedLinear'
    """
    with warnings.catch_warnings():  # the API's and its quantized tensors' deprecation notices, here only
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions", category=UserWarning)
        return torch.ao.quantization.quantize_dynamic(module, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """Mixed precision for the backbone and prompts (a no-op at fp32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
