"""A learned model taken away: one graph from uint8 images to class probabilities, as ONNX or a Triton repository.

Why: teams that serve with ONNX Runtime or Triton cannot run ``mepo serve`` there. The graph is the model's one
prediction path (``ContinualMethod.predict_proba``) frozen at one version, in fp32: the eval transform (scale and
normalise, at the backbone's resolution), the host's encoder, Meta Cov's running
alignment, and the classifier. A streaming LDA enters as its solved linear form (``w_k = Sigma^-1 mu_k`` and its
bias, in float64 as the learner scores, unseen classes at -inf): the Cholesky solve is done here, once. The output
holds the classes seen so far only, in the learner's head order, as ``/v1/predict`` answers.

* ``image``: uint8 RGB images ``[N, 3, S, S]`` (not normalised: the graph normalises), ``N`` dynamic;
* ``probability``: float32 ``[N, K]`` over the K classes seen, their names in the model's metadata
  (``labels``, JSON) and, in a Triton repository, in ``labels.txt`` (``label_filename``), for Triton's
  classification extension;
* ``novelty``: float32 ``[N, 1]``, each image's novelty score (``mepo_stream.novelty``: its factorisations are
  constants here too); the threshold it was answered against is in the metadata (``novelty_threshold``).

Example:
    >>> from mepo_stream.backbone import BackboneConfig
    >>> from mepo_stream.model import ModelConfig, create_model
    >>> model = create_model(ModelConfig(backbone=BackboneConfig(name="test_vit", weights=None, img_size=32)), 3)
    >>> _ = model.classifier.update(torch.randn(4, 64), torch.tensor([0, 1, 0, 1]))
    >>> graph = ProbabilityGraph(model.inference_copy(), n_seen=2)
    >>> [t.shape for t in graph(torch.zeros(5, 3, 32, 32, dtype=torch.uint8))]
    [torch.Size([5, 2]), torch.Size([5, 1])]
    >>> print(triton_config("mepo", image_size=32, n_classes=2, max_batch_size=8))  # doctest: +ELLIPSIS
    name: "mepo"
    platform: "onnxruntime_onnx"
    max_batch_size: 8
    input [
      {
        name: "image"
        data_type: TYPE_UINT8
        dims: [ 3, 32, 32 ]
    ...
"""

from __future__ import annotations

import copy
import io
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mepo_stream.alignment import AlignMode
from mepo_stream.backbone import input_size
from mepo_stream.files import atomic_path
from mepo_stream.heads import StreamingLDA
from mepo_stream.methods.base import ContinualMethod, Encoded
from mepo_stream.novelty import DEFAULT_SCORE, NoveltyScore, novelty_scores

if TYPE_CHECKING:
    import onnx

INPUT, OUTPUT, NOVELTY = "image", "probability", "novelty"
LABELS_FILE = "labels.txt"
OPSET = 18


def onnx_package():
    """The ``onnx`` package, the ``export`` extra (a bare install serves without it)."""
    try:
        import onnx
    except ImportError as e:
        raise ImportError("mepo export writes its model with the onnx package, which is not installed: "
                          "pip install 'mepo-stream[export]'") from e
    return onnx


class SolvedLDA(nn.Module):
    """A streaming LDA's chosen solution as constants: logits ``h W^T + b`` [B, C] in float64, unseen at -inf."""

    weights: torch.Tensor
    bias: torch.Tensor

    def __init__(self, lda: StreamingLDA):
        super().__init__()
        weights, bias = lda.solve(lda.chosen)  # [C, D], [C] float64
        unseen = lda.counts.to(bias.device) == 0
        self.register_buffer("weights", weights.clone())
        self.register_buffer("bias", bias.masked_fill(unseen, float("-inf")))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h.double() @ self.weights.T + self.bias).to(h.dtype)  # [B, C]


class ProbabilityGraph(nn.Module):
    """uint8 images [B, 3, S, S] at the backbone's resolution S -> probabilities [B, n_seen] of an inference copy
    (``inference_copy``), in fp32."""

    def __init__(self, model: ContinualMethod, n_seen: int, align_mode: AlignMode = "running",
                 novelty: NoveltyScore = DEFAULT_SCORE):
        super().__init__()
        if n_seen < 1:
            raise ValueError("the model has not learned any class yet: nothing to export")
        if any(not p.dtype.is_floating_point for p in model.backbone.state_dict().values()):
            raise ValueError("an int8 backbone (--learner.precision int8) cannot be exported: export in fp32 or bf16")
        on_cpu = copy.deepcopy(model).cpu()  # traced on the CPU, whatever device the model served on
        on_cpu.load_state_dict(on_cpu.state_dict())  # drops the caches made on that device (a solved LDA, ...)
        on_cpu.backbone.float()  # a frozen backbone stored in bf16 (cast_frozen_backbone): fp32 in the graph
        self.model = on_cpu.inference_copy()  # solved and factorised again, here: constants, not traced steps
        lda = self.model.classifier if isinstance(self.model.classifier, StreamingLDA) else None
        self.solved = None if lda is None or not lda.seen else SolvedLDA(lda)
        self.n_seen, self.align_mode, self.novelty = n_seen, align_mode, novelty

    @property
    def image_size(self) -> int:
        return input_size(self.model.backbone)

    def logits(self, encoded: Encoded) -> torch.Tensor:
        """The classifier's logits [B, C], as ``ContinualMethod.logits`` gives them in eval mode."""
        if self.solved is None:
            return self.model.logits(encoded, self.align_mode)
        return self.solved(self.model.aligned(encoded, self.align_mode))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.model.transform is not None  # a learner's model normalises its own input (``create_model``)
        x = self.model.transform(images)  # [B, 3, S, S] normalised, at the backbone's resolution
        encoded = self.model.encode(x)
        encoded.feature = encoded.feature.float()  # [B, D]
        logits = self.logits(encoded).float()[:, : self.n_seen]  # [B, K]
        h = self.model.aligned(encoded, self.align_mode)  # [B, D]
        return F.softmax(logits, dim=1), novelty_scores(self.model.classifier, h, logits, self.novelty)[:, None]


def onnx_model(graph: ProbabilityGraph, metadata: dict[str, str]) -> onnx.ModelProto:
    """``graph`` as an ONNX model with a dynamic batch dimension, ``metadata`` in its properties.

    The TorchScript exporter (``dynamo=False``): it needs no ``onnxscript``, and the graph is a fixed model whose
    Python branches (nothing learned yet, batch statistics) are decided once, when it is traced.
    """
    size = graph.image_size
    example = torch.zeros(2, 3, size, size, dtype=torch.uint8)  # [B, 3, S, S]
    buffer = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes on those Python branches
        torch.onnx.export(graph, (example,), buffer,  # type: ignore[arg-type]  # a file object: the TorchScript exporter writes to it
                          input_names=[INPUT], output_names=[OUTPUT, NOVELTY], opset_version=OPSET,
                          dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}, NOVELTY: {0: "batch"}},
                          dynamo=False)
    onnx = onnx_package()
    model = onnx.load_from_string(buffer.getvalue())
    onnx.helper.set_model_props(model, metadata)
    onnx.checker.check_model(model)
    return model


def write_onnx(model: onnx.ModelProto, path: Path) -> Path:
    """Write ``model`` to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        onnx_package().save(model, tmp)
    return path


def triton_config(name: str, image_size: int, n_classes: int, max_batch_size: int) -> str:
    """Triton's ``config.pbtxt`` for the ONNX model: uint8 images in, probabilities out (named by ``labels.txt``),
    dynamic batching up to ``max_batch_size`` (dims without the batch dimension, as Triton wants them)."""
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch_size}\n'
            f'input [\n  {{\n    name: "{INPUT}"\n    data_type: TYPE_UINT8\n'
            f"    dims: [ 3, {image_size}, {image_size} ]\n  }}\n]\n"
            f'output [\n  {{\n    name: "{OUTPUT}"\n    data_type: TYPE_FP32\n    dims: [ {n_classes} ]\n'
            f'    label_filename: "{LABELS_FILE}"\n  }},\n'
            f'  {{\n    name: "{NOVELTY}"\n    data_type: TYPE_FP32\n    dims: [ 1 ]\n  }}\n]\n'
            f"dynamic_batching {{ }}\n")


def write_triton_repository(out: Path, name: str, model: onnx.ModelProto, labels: list[str], image_size: int,
                            max_batch_size: int) -> Path:
    """A Triton model repository at ``out`` holding model ``name``: ``config.pbtxt``, ``1/model.onnx`` and
    ``labels.txt`` (one class name a line, in output order), written whole or not at all (``atomic_path``)."""
    if any("\n" in label for label in labels):
        raise ValueError("a class name holds a line break: labels.txt has one name a line")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        folder = tmp / name
        (folder / "1").mkdir(parents=True)
        onnx_package().save(model, folder / "1" / "model.onnx")
        (folder / LABELS_FILE).write_text("".join(f"{label}\n" for label in labels))
        (folder / "config.pbtxt").write_text(triton_config(name, image_size, len(labels), max_batch_size))
    return out


def labels_metadata(labels: list[str], exposed: list[int], version: int, samples_seen: int,
                    novelty_threshold: float = float("inf")) -> dict[str, str]:
    """What the ONNX model says of itself: class names and original labels of its outputs, the model version, and
    the threshold above which a novelty score answers "not learned yet" (inf: not calibrated)."""
    return {"labels": json.dumps(labels), "exposed": json.dumps(exposed), "model_version": str(version),
            "samples_seen": str(samples_seen), "input": "uint8 RGB images [N, 3, S, S], not normalised",
            "novelty_threshold": repr(novelty_threshold)}
