"""The converted DINOv2 ViT-S/14 must reproduce the ONNX model's features (onnxruntime as the oracle)."""

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from mepo_stream.backbone import BackboneConfig, create_backbone  # noqa: E402
from mepo_stream.dinov2 import find_onnx  # noqa: E402

FEATURES = "/backbone/layernorm/Add_1_output_0"  # the backbone's final LayerNorm output inside the graph


def onnx_features(x: np.ndarray) -> np.ndarray:
    model = onnx.load(str(find_onnx()))
    model.graph.output.append(onnx.helper.make_tensor_value_info(FEATURES, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run([FEATURES], {"input_image": x})[0]


def test_converted_weights_match_onnxruntime(cifar_small):
    from mepo_stream.data import load_split
    from mepo_stream.transforms import test_transform

    images = load_split(cifar_small, "test").images[::25][:4]  # 4 real images
    x = test_transform(224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))(images)  # the ONNX input is 224 px
    model = create_backbone(BackboneConfig(img_size=224)).eval()
    with torch.no_grad():
        ours = model.forward_features(x).numpy()
    assert np.abs(ours - onnx_features(x.numpy())).max() < 1e-4
