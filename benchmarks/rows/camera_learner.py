"""The learner on camera-size JPEGs against the same images at their own 64 px, each against a bare loop that
decodes what it learns.

Why: cameras send 640x480 to 1920x1080 JPEGs, and a service whose decode costs more than its model learns at its
decoder's pace. Two questions, answered side by side in one run on the machine at hand:

* does a camera stream cost little more than thumbnails? The service's rate on a 1280x960 stream over its rate on
  the same images at 64 px (``benchmarks.tools.camera_streams`` builds both from the bundled data);
* does the service add little to decode and model? Each service against a bare loop that decodes the same JPEGs
  with the same decoder (``decode_images``, at the model's size) and then learns them
  (``benchmarks.rows.learner_throughput``'s bare loop with ``bare_decodes``).

Usage:
    python -m benchmarks.rows.camera_learner --images_per_class 50
Writes ``benchmarks/results/camera_learner.json``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from benchmarks.rows.learner_throughput import measure
from benchmarks.tools.camera_streams import SIZES, camera_folder
from benchmarks.tools.service import ServiceSpec, write_result
from benchmarks.tools.table import Row, fmt, spread
from mepo_stream.data import DataConfig


def main(spec: ServiceSpec = ServiceSpec(), source: str = "tinyimagenet-downstream", classes: int = 10,
         images_per_class: int = 50, camera: str = "1280x960", prequential: bool = True, bare_batches: int = 8,
         rounds: int = 5, work: Path = Path("benchmarks/results/work/camera_learner"),
         out: Path = Path("benchmarks/results/camera_learner.json")) -> dict:
    """Measure the service and its decoding bare loop on the camera stream and on its 64-px source.

    Args:
        spec: The model and learner (its dataset and stream size are set here).
        source: The bundled dataset the streams are built from.
        classes: Classes of the stream.
        images_per_class: Stream images per class.
        camera: The camera size (640x480, 1280x960 or 1920x1080).
        prequential: Test-then-train prediction (the service's default), in the service and the bare loop alike.
        bare_batches: Timed mini-batches of each bare run.
        rounds: Service runs per stream, each between two bare runs; the median round is reported.
        work: Broker and service logs and checkpoints.
        out: JSON result path.
    """
    data = DataConfig(dataset=source, num_classes=classes, train_per_class=images_per_class, test_per_class=5)
    streams = {"64x64": camera_folder(data, 64, 64), camera: camera_folder(data, *SIZES[camera])}
    measured = {}
    for name, folder in streams.items():
        s = replace(spec, dataset=str(folder), train_per_class=images_per_class)
        measured[name] = {"folder": str(folder),
                          **measure(s, prequential, bare_batches, rounds, work / name, bare_decodes=True)}
    rate = {name: m["service_samples_per_s"] for name, m in measured.items()}
    paired = [c["service_samples_per_s"] / t["service_samples_per_s"]  # round i of each stream
              for c, t in zip(measured[camera]["rounds"], measured["64x64"]["rounds"], strict=True)]
    return write_result({"benchmark": "camera_learner", "spec": spec.as_json(), "camera": camera,
                         "stream_samples": classes * images_per_class, "streams": measured,
                         "camera_over_64px": rate[camera] / rate["64x64"],
                         "camera_over_64px_range": [min(paired), max(paired)]}, out, *spec.placement())


def table_rows(r: dict) -> list[Row]:
    """The table's rows: the camera stream over the same images at 64 px, and each stream against its bare loop."""
    camera, streams = r["camera"], r["streams"]
    low, high = r.get("camera_over_64px_range", [r["camera_over_64px"]] * 2)
    rows: list[Row] = [(f"Learner on a {camera} JPEG stream ÷ on the same images at 64 px (samples/s, "
                        f"{r['stream_samples']} images; rounds' ratios {low:.2f}–{high:.2f})",
                        fmt(streams[camera]["service_samples_per_s"], "/s"),
                        fmt(streams["64x64"]["service_samples_per_s"], "/s") + " (64 px)", r["camera_over_64px"],
                        "≥ 0.75", r["camera_over_64px"] >= 0.75)]
    for name, c in streams.items():
        rows.append((f"Learner throughput from Kafka, {name} JPEGs, against a bare loop that decodes them too "
                     f"(samples/s{spread(c)})", fmt(c["service_samples_per_s"], "/s"),
                     fmt(c["bare_samples_per_s"], "/s") + " (decode + its loop)", c["ratio"], "≥ 0.90",
                     c["ratio"] >= 0.9))
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
