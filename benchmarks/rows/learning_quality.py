"""Learning quality of the service's default configuration: A_last against the offline probe of its features.

Why: speed rows say nothing about whether the learner learns. This row runs the service's default host and
learner (``ServeConfig.method`` and ``ServeConfig.learner``, no MePo bundle, as ``mepo serve`` starts) through the
Si-Blurry protocol of ``mepo evaluate`` on a stream, over seeds, and divides its A_last by the ceiling ``evaluate``
reports: a linear probe trained offline on all the stream's training images' frozen features. The README's
headline table reads its numbers from these results (``tests/test_numbers.py`` checks them).

Usage:
    python -m benchmarks.rows.learning_quality --spec.train_per_class 100 --test_per_class 50 --seeds 1-3
    python -m benchmarks.rows.learning_quality --spec.dataset tinyimagenet-downstream --spec.train_per_class 25 \
        --test_per_class 10 --seeds 1-3 --out benchmarks/results/learning_quality_tinyimagenet.json
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.tools.common import mean_std
from benchmarks.tools.service import ServiceSpec, write_result
from benchmarks.tools.table import Row
from mepo_stream.anytime import ProtocolConfig
from mepo_stream.backbone import BackboneConfig
from mepo_stream.data import DataConfig
from offline.evaluate import evaluate


def main(spec: ServiceSpec = ServiceSpec(), test_per_class: int = 50, seeds: str = "1-3", eval_period: int = 250,
         work: Path = Path("benchmarks/results/work/learning_quality"),
         out: Path = Path("benchmarks/results/learning_quality.json")) -> dict:
    """Run the default configuration on one stream per seed and write A_last, the ceiling and their ratio.

    Args:
        spec: Stream and model (its ``mepo`` bundle is not used: the service's default runs without one).
        test_per_class: Test images per class.
        seeds: The stream seeds: "1", "1-3" or "1,3".
        eval_period: Any-time evaluation period in samples.
        work: The evaluate output folder (its cache makes a re-run instant).
        out: JSON result path.
    """
    data = DataConfig(spec.dataset, train_per_class=spec.train_per_class, test_per_class=test_per_class)
    backbone = BackboneConfig(spec.model, spec.weights, spec.img_size)
    result = evaluate(out=work, seed=seeds, method=spec.method, data=data, backbone=backbone,
                      learner=spec.learner, protocol=ProtocolConfig(eval_period=eval_period))
    runs = [{"seed": r["seed"], "a_last": r["curves"]["batch"]["A_last"], "a_auc": r["curves"]["batch"]["A_auc"],
             "ceiling": r["ceiling"]} for r in result["runs"]]
    a_last, a_auc = mean_std([r["a_last"] for r in runs]), mean_std([r["a_auc"] for r in runs])
    ratio = mean_std([r["a_last"] / r["ceiling"] for r in runs])
    return write_result({
        "benchmark": "learning_quality", "spec": spec.as_json(), "test_per_class": test_per_class,
        "seeds": [r["seed"] for r in runs], "runs": runs, "a_last": a_last[0], "a_last_std": a_last[1],
        "a_auc": a_auc[0], "a_auc_std": a_auc[1], "ceiling": runs[0]["ceiling"], "ratio": ratio[0],
        "ratio_std": ratio[1], "stream_samples": result["runs"][0]["stream_length"],
    }, out, *spec.placement())


def table_rows(r: dict) -> list[Row]:
    """The table's row: the default learner's A_last over the offline probe of the same features."""
    s, seeds = r["spec"], r["seeds"]
    return [(f"Learning quality: A_last ÷ offline probe ({s['method']} + {s['learner']['classifier']}, the service's "
             f"default; {s['dataset']} {r['stream_samples']}-sample stream, seeds {', '.join(map(str, seeds))})",
             f"A_last {r['a_last']:.3f}", f"probe {r['ceiling']:.3f}", r["ratio"], "≥ 0.80", r["ratio"] >= 0.8)]


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
