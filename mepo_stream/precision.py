"""Which precision the model runs in: bf16 where the hardware multiplies bf16 natively, fp32 elsewhere.

Statistics, the alignment and the LDA stay in fp32/fp64 whatever is chosen here; only the backbone and the
prompts run under autocast (and a frozen plain backbone may store its weights in bf16, ``mepo_stream.model``).

Example:
    >>> resolve_precision("fp32", torch.device("cpu"))
    torch.float32
    >>> with autocast(torch.device("cpu"), torch.float32):  # fp32: a no-op
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.float32
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from pathlib import Path

import torch


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware: a CUDA GPU that supports bf16, or a CPU with AMX
    or AVX512-BF16 (there bf16 autocast runs the backbone 2.5-3x faster than fp32; README "Benchmarks")."""
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


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """The autocast dtype: bf16 where asked (or, for auto, where the hardware has native bf16), else fp32."""
    if precision == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """Mixed precision for the backbone and prompts (a no-op at fp32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
