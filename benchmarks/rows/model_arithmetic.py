"""The backbone's own arithmetic: FLOPs per image, and the bare forward's speed in each precision the device has.

What every other row is measured against: the fastest way this device runs the model's forward. The forward of a
batch (``batch`` images) and of one image are timed, under ``inference_mode``, in

* ``fp32``: fp32 weights, no autocast;
* ``bf16_autocast``: fp32 weights under bf16 autocast (a bf16 copy of every weight on every forward);
* ``bf16_weights``: the weights stored in bf16, under autocast (what the learner does with a frozen plain
  backbone at bf16, ``--learner.cast_frozen_backbone``),

the bf16 ones only where the hardware multiplies bf16 natively; and two candidates beyond them (docs/performance.md
says where they pay and what they cost; int8 is an option of the learner, compile is not):

* ``bf16_weights_compiled``: ``bf16_weights`` through ``torch.compile`` (Inductor; compile time excluded);
* ``int8_dynamic``: the Linear layers' weights quantised to int8 per output channel, activations per row (per
  token) on every call, integer products summed in int32 (``mepo_stream.precision.quantize_int8``,
  ``--learner.precision int8``; ``torch._int_mm``, VNNI/AMX int8 units where the CPU has them), CPU only.

Each variant's CLS features of real test images are compared with fp32's (``feature_cosine_min``). FLOPs are
counted by ``torch.utils.flop_counter`` (a multiply-add is 2 FLOPs); achieved FLOP/s = FLOPs per image x images
per second, against the device's peak where it is known (``PEAK_FLOPS``; for CPUs it is not recorded, so none is
claimed) and, on every device, against the device's own large matmul in the same dtype (``matmul_flops``: the
practical ceiling of a forward made of matrix products, measured, not typed; not for int8, whose products run in
another type than its autocast dtype). The native precision with the most images per second is ``fastest``
(what the bare loops run in), the fastest variant of all ``fastest_of_all``.

Each variant is timed back to back, as the learner runs its one model. Timing the variants in turns instead
(a a a, b b b, a a a, ...: drift spread over all of them) was tried on the EPYC and not kept: a model's forward
right after another model's ran slower, int8 most (174 images/s in turns against 187-281 alone, and 207-285 in
the int8 learner's own bare loops), so turns measured the switching, not the learner's steady state.

Usage:
    python -m benchmarks.rows.model_arithmetic --spec.model vit_small_patch14_dinov2 --spec.img_size 84
Writes ``benchmarks/results/model_arithmetic.json``.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.tools.service import ServiceSpec, timed, write_result
from benchmarks.tools.table import Row, fmt
from mepo_stream.backbone import BackboneConfig, create_backbone, device, normalization
from mepo_stream.data import load_split
from mepo_stream.precision import autocast, native_bf16, quantize_int8
from mepo_stream.transforms import test_transform

PEAK_FLOPS = {"H100": {"bfloat16": 989e12, "float32": 67e12}, "H200": {"bfloat16": 989e12, "float32": 67e12}}
"""Dense peak FLOP/s by device name (NVIDIA's SXM data sheets); devices not listed get no peak."""
MATMUL_SIZE = 2048
"""Side of the square matrices whose product is the device's own matmul rate (``matmul_flops``)."""


def flops_per_image(model: torch.nn.Module, img_size: int) -> int:
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(torch.zeros(1, 3, img_size, img_size, device=next(model.parameters()).device))
    return counter.get_total_flops()


def variants(model: torch.nn.Module, dev: torch.device, compiled: bool = True
             ) -> dict[str, tuple[torch.nn.Module, torch.dtype]]:
    """Each precision this device runs natively, and the candidates (``compiled``: with the compiled one): the model
    and the autocast dtype."""
    out = {"fp32": (model, torch.float32)}
    if native_bf16(dev):
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        out["bf16_autocast"] = (model, torch.bfloat16)
        out["bf16_weights"] = (bf16, torch.bfloat16)
        if compiled:
            out["bf16_weights_compiled"] = (torch.compile(bf16), torch.bfloat16)
    if dev.type == "cpu":
        out["int8_dynamic"] = (quantize_int8(copy.deepcopy(model)), torch.float32)
    return out


@torch.inference_mode()
def feature_cosine(model: torch.nn.Module, dtype: torch.dtype, reference: torch.Tensor, images: torch.Tensor,
                   dev: torch.device) -> float:
    """The smallest cosine between ``model``'s CLS features of ``images`` and the fp32 ``reference`` [N, D]."""
    with autocast(dev, dtype):
        features = model(images).float()  # [N, D]
    return float(torch.nn.functional.cosine_similarity(features, reference, dim=1).min())


def test_images(spec: ServiceSpec, model: torch.nn.Module, n: int, dev: torch.device) -> torch.Tensor:
    """``n`` real test images of the spec's dataset, as the learner feeds them to the backbone [n, 3, S, S]."""
    data = load_split(replace(spec.data, test_per_class=max(1, n // 10)), "test")
    return test_transform(spec.img_size, *normalization(model))(data.images[:n].to(dev))


def matmul_flops(dev: torch.device, dtype: torch.dtype, n: int = MATMUL_SIZE, repeats: int = 10) -> float:
    """FLOP/s of this device's own ``n`` x ``n`` matrix product in ``dtype`` (2 n^3 FLOPs a product): how fast it
    multiplies matrices when nothing else is in the way. The best of ``repeats``, because it is a ceiling: a median
    taken in a slow spell of a drifting machine has come out below the forward measured a minute later."""
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))  # [n, n] each
    with torch.inference_mode():
        return 2 * n**3 / min(timed(lambda: a @ b, repeats, dev))


def measure(model: torch.nn.Module, dtype: torch.dtype, dev: torch.device, img_size: int, batch: int,
            repeats: int, flops: int, matmul: float | None) -> dict:
    images = {n: torch.randn(n, 3, img_size, img_size, device=dev) for n in (batch, 1)}

    def forward(n: int):
        return lambda: model(images[n])

    with torch.inference_mode(), autocast(dev, dtype):
        batch_s = statistics.median(timed(forward(batch), repeats, dev))
        single = timed(forward(1), repeats * 5, dev)
    rate = batch / batch_s
    achieved, peak = flops * rate, peak_flops(dev, dtype)
    return {"batch_images_per_s": rate, "single_image_p50_s": statistics.median(single),
            "achieved_flops_per_s": achieved, "peak_flops_per_s": peak,
            "share_of_peak": None if peak is None else achieved / peak, "matmul_flops_per_s": matmul,
            "share_of_matmul": None if matmul is None else achieved / matmul}


def peak_flops(dev: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak at ``dtype`` where ``PEAK_FLOPS`` knows it."""
    if dev.type != "cuda":
        return None
    name, key = torch.cuda.get_device_name(dev), str(dtype).removeprefix("torch.")
    return next((p[key] for n, p in PEAK_FLOPS.items() if n in name and key in p), None)


def main(spec: ServiceSpec = ServiceSpec(), batch: int = 32, repeats: int = 10, compiled: bool = True,
         out: Path = Path("benchmarks/results/model_arithmetic.json")) -> dict:
    """Measure the backbone forward in every native precision; write the JSON result.

    Args:
        spec: Model and resolution (its learner settings are not used).
        batch: Images per batched forward (the learner's mini-batch).
        repeats: Timed batched forwards per precision (five times as many single-image ones).
        compiled: Also time ``bf16_weights_compiled`` where bf16 is native (Inductor compiles for most of a minute on
            two cores: the smoke run leaves it out).
        out: JSON result path.
    """
    torch.manual_seed(0)
    dev = device()
    model = create_backbone(BackboneConfig(name=spec.model, weights=spec.weights, img_size=spec.img_size))
    model = model.to(dev).eval()
    flops = flops_per_image(model, spec.img_size)
    native = variants(model, dev, compiled)
    images = test_images(spec, model, batch, dev)
    with torch.inference_mode():
        reference = model(images).float()  # [N, D] fp32 features
    matmul = {dtype: matmul_flops(dev, dtype) for _, dtype in native.values()}
    rows = {name: {**measure(m, dtype, dev, spec.img_size, batch, repeats, flops,
                             None if name.startswith("int8") else matmul[dtype]),
                   "feature_cosine_min": feature_cosine(m, dtype, reference, images, dev)}
            for name, (m, dtype) in native.items()}
    fastest = max((k for k in ("fp32", "bf16_autocast", "bf16_weights") if k in rows),
                  key=lambda k: rows[k]["batch_images_per_s"])
    return write_result({"benchmark": "model_arithmetic", "spec": spec.as_json(), "batch": batch,
                         "flops_per_image": flops, "matmul_size": MATMUL_SIZE, "precisions": rows, "fastest": fastest,
                         "fastest_of_all": max(rows, key=lambda k: rows[k]["batch_images_per_s"])},
                        out, dev, native[fastest][1])


def table_rows(r: dict) -> list[Row]:
    """Each native precision's bare forward against the fastest one; FLOP/s against the peak where known and
    against the device's own large matmul (not for int8, whose matmul is not timed)."""
    rows: list[Row] = []
    fastest = r["precisions"][r["fastest"]]
    for name, p in r["precisions"].items():
        share = "" if p["share_of_peak"] is None else f", {100 * p['share_of_peak']:.1f} % of peak"
        if p["share_of_matmul"] is not None:
            share += (f", {100 * p['share_of_matmul']:.0f} % of this device's {r['matmul_size']}² matmul "
                      f"({p['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s)")
        share += f"; features' cosine to fp32 ≥ {p['feature_cosine_min']:.4f}"
        rows.append((f"Backbone forward, batch {r['batch']}, {name} (images/s; {r['flops_per_image'] / 1e9:.2f} "
                     f"GFLOP per image: {p['achieved_flops_per_s'] / 1e9:.0f} GFLOP/s achieved{share})",
                     fmt(p["batch_images_per_s"], "/s"), fmt(fastest["batch_images_per_s"], "/s") +
                     f" ({r['fastest']})", p["batch_images_per_s"] / fastest["batch_images_per_s"], "–", None))
    rows.append((f"Backbone forward, one image, p50 ({r['fastest']})", fmt(fastest["single_image_p50_s"], "ms"), "–",
                 None, "–", None))
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
