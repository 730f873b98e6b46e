"""Learning quality of the service's default configuration: A_last against the offline probe of its features.

Why: speed rows say nothing about whether the learner learns. This row runs the service's default host and
learner (``ServeConfig.method`` and ``ServeConfig.learner``, no MePo bundle, as ``mepo serve`` starts) through the
Si-Blurry protocol of ``mepo evaluate`` on a CIFAR-10 stream, and divides its A_last by the ceiling ``evaluate``
reports: a linear probe trained offline on all the stream's training images' frozen features.

Usage:
    python -m benchmarks.learning_quality --spec.train_per_class 100 --test_per_class 50
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.service import ServiceSpec, write_result
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.backbone import BackboneConfig
from mepo_stream.data import DataConfig
from offline.evaluate import evaluate


def main(spec: ServiceSpec = ServiceSpec(), test_per_class: int = 50, seed: int = 1, eval_period: int = 250,
         work: Path = Path("benchmarks/results/work/learning_quality"),
         out: Path = Path("benchmarks/results/learning_quality.json")) -> dict:
    """Run the default configuration on one stream and write A_last, the ceiling and their ratio.

    Args:
        spec: Stream and model (its ``mepo`` bundle is not used: the service's default runs without one).
        test_per_class: Test images per class.
        seed: Stream seed.
        eval_period: Any-time evaluation period in samples.
        work: The evaluate output folder (its cache makes a re-run instant).
        out: JSON result path.
    """
    data = DataConfig(spec.dataset, train_per_class=spec.train_per_class, test_per_class=test_per_class)
    backbone = BackboneConfig(spec.model, spec.weights, spec.img_size)
    result = evaluate(out=work, seed=str(seed), method=spec.method, data=data, backbone=backbone,
                      learner=spec.learner, protocol=ProtocolConfig(eval_period=eval_period))
    run = result["runs"][0]
    a_last = run["curves"]["batch"]["A_last"]
    return write_result({
        "benchmark": "learning_quality", "spec": spec.as_json(), "test_per_class": test_per_class, "seed": seed,
        "a_last": a_last, "a_auc": run["curves"]["batch"]["A_auc"], "ceiling": run["ceiling"],
        "ratio": a_last / run["ceiling"], "stream_samples": run["stream_length"],
    }, out, *spec.placement())


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
