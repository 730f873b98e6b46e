"""``mepo evaluate``: the paper's Si-Blurry protocol offline (no Kafka), over several seeds.

For each seed: build the Si-Blurry stream, learn it in one pass in mini-batches (never across a task
boundary, as the reference's per-task loader), run an any-time evaluation whenever
``samples_seen + batch > next_eval`` (then ``next_eval += eval_period``) on the test images of the classes
seen so far, and an end-of-task evaluation after each task. Every evaluation is scored under both alignment
statistics (``batch``: the reference's transductive test-batch statistics, 128 images in dataset order;
``running``: the learner's running training statistics), sharing one forward pass.

Writes ``results.json`` (every run's curves and metrics), ``table.md`` (mean ± std over seeds) and
``anytime_accuracy.png`` into ``out``.

Example:
    mepo evaluate --data.dataset cifar10 --seeds 1-3 --mepo runs/refined --out runs/eval-cifar10
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from mepo_stream.alignment import AlignmentConfig, AlignMode, FeatureAlignment
from mepo_stream.artifacts import load_sigma_pre
from mepo_stream.backbone import BackboneConfig, create_backbone, device, provenance
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.evaluation import evaluate_seen
from mepo_stream.learner import LearnerConfig, OnlineLearner
from mepo_stream.methods import MethodsConfig, create_method
from mepo_stream.metrics import AnytimeCurve
from mepo_stream.sampler import SiBlurryConfig, si_blurry_stream

log = logging.getLogger(__name__)
MODES: tuple[AlignMode, ...] = ("batch", "running")


@dataclass(frozen=True)
class ProtocolConfig:
    """The evaluation protocol."""

    eval_period: int = 1000
    """Any-time evaluation every this many stream samples."""
    eval_batch_size: int = 128
    """Test batch size (the reference's 2 x batchsize; it matters for batch-statistics alignment)."""


def parse_seeds(spec: str) -> list[int]:
    """``"1-5"`` -> [1, 2, 3, 4, 5]; ``"1,3,7"`` -> [1, 3, 7]."""
    seeds: list[int] = []
    for part in str(spec).split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


def run_seed(seed: int, base_backbone, train: ImageSet, test: ImageSet, sigma: torch.Tensor | None,
             stream_cfg: SiBlurryConfig, method: str, methods: MethodsConfig, learner_cfg: LearnerConfig,
             alignment: AlignmentConfig, protocol: ProtocolConfig) -> dict:
    """One seed of the protocol; returns the curves per alignment mode and the wall time."""
    torch.manual_seed(seed)
    stream = si_blurry_stream(train.targets.tolist(), stream_cfg.n_tasks, stream_cfg.n, stream_cfg.m, seed)
    align = None if sigma is None else FeatureAlignment(sigma, alignment.alpha, alignment.eps, alignment.momentum)
    model = create_method(method, copy.deepcopy(base_backbone), len(train.classes), align, methods)
    learner = OnlineLearner(model, len(train.classes), learner_cfg, device())
    curves = {m: AnytimeCurve() for m in MODES}
    next_eval, start = protocol.eval_period, time.time()
    bar = tqdm(total=len(stream.order), desc=f"seed {seed}", unit="img", leave=False)
    for task in stream.tasks:
        for b in range(0, len(task), learner_cfg.batch_size):
            idx = torch.tensor(task[b : b + learner_cfg.batch_size])
            stats = learner.observe(train.images[idx], train.targets[idx])
            bar.update(len(idx))
            bar.set_postfix(loss=f"{stats.loss:.3f}", classes=len(learner.exposed))
            if learner.samples_seen + len(idx) > next_eval:
                for mode, (acc, _) in evaluate_seen(learner, test, protocol.eval_batch_size, MODES).items():
                    curves[mode].add_anytime(next_eval, acc)
                next_eval += protocol.eval_period
        if learner.exposed:
            for mode, (acc, class_acc) in evaluate_seen(learner, test, protocol.eval_batch_size, MODES).items():
                curves[mode].add_end_of_task(acc, class_acc)
    bar.close()
    return {"seed": seed, "wall_time_s": round(time.time() - start, 1), "stream_length": len(stream.order),
            "curves": {m: c.to_dict() for m, c in curves.items()}}


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.2f} ± {100 * std:.2f}"


def write_table(runs: list[dict], modes: tuple[AlignMode, ...], path: Path, title: str) -> str:
    """Markdown table of A_auc / A_last / A_avg / F_last (percent, mean ± std over seeds) per mode."""
    lines = [f"### {title}", "", f"Seeds: {', '.join(str(r['seed']) for r in runs)}", "",
             "| alignment statistics at test | A_auc | A_last | A_avg | F_last |", "|---|---|---|---|---|"]
    for mode in modes:
        cells = [_mean_std([r["curves"][mode][k] for r in runs]) for k in ("A_auc", "A_last", "A_avg", "F_last")]
        lines.append(f"| {mode} | {' | '.join(cells)} |")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot_curves(runs: list[dict], modes: tuple[AlignMode, ...], path: Path, title: str) -> None:
    """Any-time accuracy vs samples seen: mean over seeds with a ±1 std band, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in modes:
        n = min(len(r["curves"][mode]["accuracy"]) for r in runs)
        if n == 0:
            continue
        x = runs[0]["curves"][mode]["samples"][:n]
        acc = torch.tensor([r["curves"][mode]["accuracy"][:n] for r in runs]) * 100  # [seeds, n]
        mean, std = acc.mean(0), acc.std(0) if len(runs) > 1 else torch.zeros(n)
        ax.plot(x, mean, marker="o", ms=3, label=f"{mode} (A_auc {mean.mean():.1f})")
        ax.fill_between(x, mean - std, mean + std, alpha=0.2)
    ax.set(xlabel="samples seen", ylabel="any-time accuracy on seen classes (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate(
    out: Path = Path("runs/evaluate"),
    seeds: str = "1-5",
    method: str = "misa",
    mepo: Path | None = None,
    mepo_rep: Path | None = None,
    mepo_cov: Path | None = None,
    data: DataConfig = DataConfig(),
    stream: SiBlurryConfig = SiBlurryConfig(),
    backbone: BackboneConfig = BackboneConfig(),
    methods: MethodsConfig = MethodsConfig(),
    learner: LearnerConfig = LearnerConfig(),
    alignment: AlignmentConfig = AlignmentConfig(),
    protocol: ProtocolConfig = ProtocolConfig(),
) -> dict:
    """Run the Si-Blurry protocol offline over seeds; write results.json, table.md and a plot.

    Args:
        out: Output folder.
        seeds: Seeds to run, e.g. "1-5" or "1,3" (each seed gives its own stream order).
        method: Host method: misa, linear_probe, seq_ft, seq_ft_sl.
        mepo: A MePo bundle (mepo refine): Meta Rep (its backbone) and Meta Cov (its Sigma_pre) together.
        mepo_rep: Meta Rep only: a bundle whose backbone replaces --backbone.weights (ablation).
        mepo_cov: Meta Cov only: a bundle holding Sigma_pre, or a MePo release cov_*.npy (ablation).
            Without any of the three the host runs alone.
        data: Downstream dataset.
        stream: Si-Blurry stream settings (the seed field is replaced by each of --seeds).
        backbone: Pretrained backbone.
        methods: Per-method hyperparameters (--methods.misa.e_pool, --methods.seq_ft_sl.backbone_lr_scale, ...).
        learner: Online learning settings.
        alignment: Meta Cov alignment settings (used only with --mepo_cov).
        protocol: Evaluation protocol settings.
    """
    mepo_rep, mepo_cov = mepo_rep or mepo, mepo_cov or mepo
    if mepo_rep is not None:
        backbone = replace(backbone, weights=str(mepo_rep))
    out.mkdir(parents=True, exist_ok=True)
    train, test = load_split(data, "train"), load_split(data, "test")
    base = create_backbone(backbone)
    sigma = None if mepo_cov is None else load_sigma_pre(mepo_cov)
    if sigma is not None and sigma.shape[0] != base.num_features:
        raise ValueError(f"Sigma_pre is {tuple(sigma.shape)} but {backbone.name} has {base.num_features} features")
    modes = MODES if sigma is not None else MODES[:1]  # without Meta Cov both modes are the same model
    runs = []
    for seed in tqdm(parse_seeds(seeds), desc="seeds", unit="run"):
        runs.append(run_seed(seed, base, train, test, sigma, replace(stream, seed=seed), method, methods, learner,
                             alignment, protocol))
        log.info("seed %d: %s", seed, {m: {k: round(runs[-1]["curves"][m][k], 4) for k in ("A_auc", "A_last")}
                                       for m in modes})
    parts = [p for p, on in (("Meta Rep", mepo_rep), ("Meta Cov", mepo_cov)) if on is not None]
    title = f"{' + '.join([method, *parts])} on {data.dataset} ({backbone.name} @ {backbone.img_size}px)"
    result = {
        "config": {"method": method, "mepo_rep": None if mepo_rep is None else str(mepo_rep),
                   "mepo_cov": None if mepo_cov is None else str(mepo_cov), "data": asdict(data),
                   "stream": asdict(stream), "backbone": provenance(backbone), "methods": asdict(methods),
                   "learner": asdict(learner), "alignment": asdict(alignment), "protocol": asdict(protocol),
                   "n_train": len(train), "n_test": len(test)},
        "runs": runs,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    print(write_table(runs, modes, out / "table.md", title))
    plot_curves(runs, modes, out / "anytime_accuracy.png", title)
    return result
