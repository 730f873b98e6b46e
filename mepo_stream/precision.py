"""Which precision the model runs in: bf16 where the hardware multiplies bf16 natively, fp32 elsewhere.

Statistics, the alignment and the LDA stay in fp32/fp64 whatever is chosen here; only the backbone and the
prompts run under autocast (and a frozen plain backbone may store its weights in bf16, ``mepo_stream.model``).
``int8`` (never chosen by ``auto``) quantises a frozen plain backbone's Linear layers on the CPU, activations per
token, and runs the rest in fp32 (``quantize_int8``).

Example:
    >>> resolve_precision("fp32", torch.device("cpu"))
    torch.float32
    >>> with autocast(torch.device("cpu"), torch.float32):  # fp32: a no-op
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.float32
"""

from __future__ import annotations

import functools
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Literal

import torch

_ONEDNN_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"})
"""Values of ``ONEDNN_MAX_CPU_ISA`` that keep oneDNN, which runs the CPU's bf16 matrix products, off bf16 hardware."""


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware: a CUDA GPU that supports bf16, or a CPU with AMX
    or AVX512-BF16 (there bf16 autocast runs the backbone much faster than fp32; docs/performance.md) whose
    oneDNN is not capped below them (``ONEDNN_MAX_CPU_ISA=AVX2``: how a bf16 machine acts like one without)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in _ONEDNN_WITHOUT_BF16
    return device.type == "cpu" and not capped and bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


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


_ROUND = 1.5 * 2**23
"""Added to and taken from an fp32 of magnitude below 2**22, it rounds it to the nearest integer, half to even, as
``torch.round`` does, in two vectorised in-place passes (cheaper on the CPU than ``torch.round``)."""


class Int8Linear(torch.nn.Module):
    """A frozen ``nn.Linear`` in int8: weights quantised once per output channel, activations per row (per token)
    on every call, their products summed exactly in int32 (``torch._int_mm``), then scaled back to fp32.

    Why per row and not per batch: a scale shared by the whole batch (``torch.ao``'s dynamic quantisation) makes an
    image's feature depend on the other images of its mini-batch. Here a row's
    output depends on that row alone, bit for bit, whatever the batch and whatever kernel sums it (integer sums are
    exact), which is what lets a group of learners build one learner's model in int8 (docs/scale-out.md).

    Example:
        >>> layer = Int8Linear(torch.nn.Linear(4, 2))
        >>> x = torch.randn(3, 4)
        >>> torch.equal(layer(x)[:1], layer(x[:1]))  # one row alone: the same bits
        True
    """

    weight_t: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scale = w.abs().amax(1).clamp_min(1e-12) / 127  # [N]
        self.register_buffer("weight_t", (w / scale[:, None]).round().to(torch.int8).t().contiguous())  # [K, N]
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        peak = rows.abs().amax(1, keepdim=True).clamp_min_(1e-12)  # [M, 1] (aminmax and vector_norm are much slower)
        q = (rows * (127 / peak)).add_(_ROUND).sub_(_ROUND).to(torch.int8)  # round half to even, |q| <= 127
        y = torch._int_mm(q, self.weight_t).float().mul_(peak / 127)  # [M, N]
        y = y.mul_(self.weight_scale) if self.bias is None else y.mul_(self.weight_scale).add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every Linear layer replaced by an ``Int8Linear``, in place (CPU, for inference: nothing
    trains through it).

    Example:
        >>> quantize_int8(torch.nn.Sequential(torch.nn.Linear(4, 2)))[0]
        Int8Linear(in_features=4, out_features=2, bias=True)
    """
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            quantize_int8(child)
    return module


def autocast(device: torch.device, dtype: torch.dtype) -> AbstractContextManager:
    """Mixed precision for the backbone and prompts (a no-op at fp32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
