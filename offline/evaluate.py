"""``mepo evaluate``: the paper's Si-Blurry protocol offline (no Kafka), over several seeds.

For each seed: build the Si-Blurry stream, learn it in one pass in mini-batches (never across a task
boundary, as the reference's per-task loader), run an any-time evaluation whenever
``samples_seen + batch > next_eval`` (then ``next_eval += eval_period``) on the test images of the classes
seen so far, and an end-of-task evaluation after each task. Every evaluation is scored under both alignment
statistics (``batch``: the reference's transductive test-batch statistics, 128 images in dataset order;
``running``: the learner's running training statistics), sharing one forward pass.

Every any-time evaluation also measures the novelty AUROC (``mepo_stream.anytime``: the learner's novelty score,
not-yet-learned against learned test images of every class); the tables report its mean beside A_AUC, and the plot
its curve.

Writes ``results.json`` (every run's curves and metrics), ``table.md`` (mean ± std over seeds; for a sweep
of methods, the layout of the paper's Table 1), ``ablation.md`` (with ``--ablation``) and
``anytime_accuracy.png`` into ``out``. Finished runs are cached under ``out/cache``.

Example:
    mepo evaluate --data.dataset cifar10 --seed 1-3 --mepo runs/refined --out runs/eval-cifar10
    mepo evaluate --method all --mepo runs/refined --ablation true --seed 1-5 --out runs/table1
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from mepo_stream.alignment import AlignmentConfig, AlignMode
from mepo_stream.anytime import AnytimeEvaluation, ProtocolConfig
from mepo_stream.artifacts import BACKBONE, PROMPTS, SIGMA_PRE
from mepo_stream.backbone import BackboneConfig, create_backbone, device, provenance, sized
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.learner import LearnerConfig, OnlineLearner
from mepo_stream.methods import METHODS, MethodsConfig
from mepo_stream.model import BundleParts, ModelConfig, backbone_config, check_bundle, create_model
from mepo_stream.probe import ProbeConfig, offline_ceiling
from mepo_stream.sampler import SiBlurryConfig, SiBlurryShape, si_blurry_stream

log = logging.getLogger(__name__)
MODES: tuple[AlignMode, ...] = ("batch", "running")


def parse_seeds(spec: str) -> list[int]:
    """``"1-5"`` -> [1, 2, 3, 4, 5]; ``"1,3,7"`` -> [1, 3, 7]."""
    seeds: list[int] = []
    for part in str(spec).split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


@dataclass(frozen=True)
class SeedRun:
    """What one run of the protocol needs: the model (host, backbone, MePo parts, head; its seed is the run's), the
    data and the seed's stream.

    Example (``run_seed`` learns it; the sweep builds one per job):
        SeedRun(ModelConfig(method="misa", seed=1), train, test, SiBlurryConfig(seed=1), ProtocolConfig())
    """

    model: ModelConfig
    train: ImageSet
    test: ImageSet
    stream: SiBlurryConfig
    protocol: ProtocolConfig


def run_seed(run: SeedRun) -> dict:
    """One seed of the protocol; returns the curves per alignment mode and the wall time."""
    train, stream_cfg, cfg = run.train, run.stream, run.model.learner
    stream = si_blurry_stream(train.targets.tolist(), stream_cfg.n_tasks, stream_cfg.n, stream_cfg.m, run.model.seed)
    learner = OnlineLearner(create_model(run.model, len(train.classes), device()), cfg)
    evaluation = AnytimeEvaluation(run.test, run.protocol.eval_period, run.protocol.eval_batch_size, MODES)
    start = time.time()
    bar = tqdm(total=len(stream.order), desc=f"{run.model.method} seed {run.model.seed}", unit="img", leave=False)
    for task in stream.tasks:
        for batch in evaluation.batches(learner, task, cfg.batch_size):  # never across a task's end
            idx = torch.tensor(batch)
            loss = learner.observe(train.images[idx], train.targets[idx])
            bar.update(len(idx))
            bar.set_postfix(loss=f"{loss:.3f}", classes=len(learner.exposed))
            evaluation.after_batch(learner)
        if learner.exposed:
            evaluation.end_of_task(learner)
    bar.close()
    curves = evaluation.curves
    return {"seed": run.model.seed, "wall_time_s": round(time.time() - start, 1), "stream_length": len(stream.order),
            "curves": {m: c.to_dict() for m, c in curves.items()}}


MEPO_HOSTS = ("frozen", "misa", "dualprompt", "deep_l2p", "coda_p", "mvp")  # PTM-based: MePo plugs into them
VariantName = Literal["host", "rep", "cov", "mepo"]


@dataclass(frozen=True)
class Variant:
    """Which parts of MePo a run uses: Meta Rep (the refined backbone) and Meta Cov (alignment by Sigma_pre)."""

    rep: bool
    cov: bool
    label: str
    """Its name in the tables and the plot."""


VARIANTS: dict[VariantName, Variant] = {
    "host": Variant(rep=False, cov=False, label="w/o MePo"),
    "rep": Variant(rep=True, cov=False, label="Meta Rep"),
    "cov": Variant(rep=False, cov=True, label="Meta Cov"),
    "mepo": Variant(rep=True, cov=True, label="w/ MePo (Rep + Cov)"),
}
METRICS = ("A_auc", "A_last", "A_avg", "F_last")


@dataclass(frozen=True)
class Job:
    method: str
    variant: VariantName
    seed: int


def planned_variants(mepo: Path | None, rep: Path | None, cov: Path | None, ablation: bool
                     ) -> tuple[VariantName, ...]:
    """The variants that ``mepo evaluate``'s bundle options ask for, the baseline of the comparison first: with
    --mepo, without and with MePo (and, with --ablation, Meta Rep and Meta Cov alone); else the one variant made
    of the parts given (--mepo_rep, --mepo_cov; neither: the host alone).

    Example:
        >>> planned_variants(Path("refined"), None, None, ablation=False)
        ('host', 'mepo')
        >>> planned_variants(None, None, Path("cov.npy"), ablation=False)
        ('cov',)
    """
    if mepo is not None:
        return tuple(VARIANTS) if ablation else ("host", "mepo")
    given = (rep is not None, cov is not None)
    return tuple(name for name, v in VARIANTS.items() if (v.rep, v.cov) == given)


def plan_jobs(methods: list[str], seeds: list[int], variants: tuple[VariantName, ...]) -> list[Job]:
    """Every (method, variant, seed) to run: each PTM-based method (``MEPO_HOSTS``) runs every variant, and a
    lower bound, which MePo does not plug into, runs the first only (the baseline of the comparison).

    Example:
        >>> [(j.method, j.variant) for j in plan_jobs(["misa", "linear_probe"], [1], ("host", "mepo"))]
        [('misa', 'host'), ('misa', 'mepo'), ('linear_probe', 'host')]
    """
    return [Job(method, v, seed) for method in methods
            for v in (variants if method in MEPO_HOSTS else variants[:1]) for seed in seeds]


def job_key(job: Job, config: dict) -> str:
    """Cache key: everything that shapes the run's numbers, hashed."""
    return _cache_key(asdict(job), config)


def _cache_key(job: dict, config: dict) -> str:
    blob = json.dumps({"job": job, **config}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _cell(values: list[float], bold: bool = False) -> str:
    mean, std = _mean_std(values)
    text = f"{100 * mean:.2f} ± {100 * std:.2f}"
    return f"**{text}**" if bold else text


def _novelty_cell(rs: list[dict], mode: AlignMode) -> str:
    """The novelty AUROC's mean over the stream, mean ± std over seeds (0-1); – where no run measured it (runs
    cached before it was)."""
    values = [v for r in rs if (v := r["curves"][mode].get("novelty_auroc_mean")) is not None and v == v]
    if not values:
        return "–"
    mean, std = _mean_std(values)
    return f"{mean:.3f} ± {std:.3f}"


def group_runs(runs: list[dict]) -> dict[tuple[str, VariantName], list[dict]]:
    groups: dict[tuple[str, VariantName], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["variant"]), []).append(r)
    return groups


def _ratio(rs: list[dict], mode: AlignMode) -> str:
    """A_last as a fraction of the offline probe of the same features (mean ± std over seeds)."""
    mean, std = _mean_std([r["curves"][mode]["A_last"] / r["ceiling"] for r in rs])
    return f"{mean:.2f} ± {std:.2f}"


def _ceiling_line(runs: list[dict]) -> str:
    values = sorted({(round(100 * r["ceiling"], 2), round(100 * r["best_offline_head"], 2)) for r in runs})
    return ("Ceiling (offline heads of the same frozen features, all training images; same test images), "
            "logistic probe / best offline head (the probe or LDA at its best shrinkage): "
            f"{', '.join(f'{p:.2f} / {b:.2f}' for p, b in values)} %.")


def _single_table(rs: list[dict]) -> list[str]:
    lines = ["| alignment statistics at test | " + " | ".join(METRICS) + " | novelty AUROC (0–1) | A_last ÷ probe |",
             "|---" * (len(METRICS) + 3) + "|"]
    for m in [m for m in MODES if all(m in r["curves"] for r in rs)]:
        cells = [_cell([r["curves"][m][k] for r in rs]) for k in METRICS]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {_novelty_cell(rs, m)} | {_ratio(rs, m)} |")
    return lines


def _sweep_table(runs: list[dict], groups: dict, mode: AlignMode) -> list[str]:
    lines = [f"Alignment statistics at test: {mode}.", "",
             "| method | A_AUC w/o MePo | A_AUC w/ MePo | A_last w/o MePo | A_last w/ MePo | A_last ÷ probe w/o |"
             " A_last ÷ probe w/ | novelty AUROC w/o | novelty AUROC w/ |", "|---" * 9 + "|"]
    for method in dict.fromkeys(r["method"] for r in runs):
        cells = []
        for metric in ("A_auc", "A_last"):
            pair = [[r["curves"][mode][metric] for r in groups.get((method, v), [])] for v in ("host", "mepo")]
            means = [_mean_std(v)[0] if v else float("-inf") for v in pair]
            cells += [_cell(v, bold=len(pair[1]) > 0 and m == max(means)) if v else "–"
                      for v, m in zip(pair, means, strict=True)]
        cells += [_ratio(groups[(method, v)], mode) if (method, v) in groups else "–" for v in ("host", "mepo")]
        cells += [_novelty_cell(groups[(method, v)], mode) if (method, v) in groups else "–" for v in ("host", "mepo")]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def _ablation_table(runs: list[dict], groups: dict, mode: AlignMode) -> list[str]:
    ablated = [m for m in dict.fromkeys(r["method"] for r in runs) if (m, "rep") in groups and (m, "cov") in groups]
    if not ablated:
        return []
    rows = ["### Ablation: Meta Rep and Meta Cov", "", "| method | " + " | ".join(
        f"{v.label} A_AUC | {v.label} A_last" for v in VARIANTS.values()) + " |",
        "|---" * (1 + 2 * len(VARIANTS)) + "|"]
    for m in ablated:
        rows.append(f"| {m} | " + " | ".join(
            _cell([r["curves"][mode][k] for r in groups[(m, v)]]) for v in VARIANTS for k in ("A_auc", "A_last"))
            + " |")
    return rows


def write_tables(runs: list[dict], out: Path, title: str, mode: AlignMode = "batch") -> str:
    """table.md: per-mode metrics for one method and variant, or the paper's Table 1 layout for a sweep
    (A_AUC and A_last, mean ± std over seeds, the better of each w/o-w/ MePo pair in bold), each with A_last
    as a fraction of the offline probe; ablation.md when Meta Rep and Meta Cov also ran alone."""
    groups = group_runs(runs)
    seeds = sorted({r["seed"] for r in runs})
    lines = [f"### {title}", "", f"Seeds: {', '.join(map(str, seeds))}. Percent, mean ± std over seeds.", "",
             _ceiling_line(runs), ""]
    lines += _single_table(next(iter(groups.values()))) if len(groups) == 1 else _sweep_table(runs, groups, mode)
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    if rows := _ablation_table(runs, groups, mode):
        (out / "ablation.md").write_text("\n".join(rows) + "\n")
        text += "\n" + "\n".join(rows) + "\n"
    return text


def plot_curves(runs: list[dict], path: Path, title: str) -> None:
    """Any-time accuracy vs samples seen: mean over seeds with a ±1 std band, per method, variant and mode; beside
    it, where the runs measured it, the novelty AUROC's curve (its undefined points, no class or every class
    learned, left out).

    matplotlib is the ``plots`` extra: without it the tables are still written, and the log says how to get the plot.
    """
    try:
        import matplotlib
    except ImportError:
        log.warning("no %s: matplotlib is not installed (pip install 'mepo-stream[plots]')", path.name)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_runs(runs)
    novelty = any(c.get("novelty_auroc") for r in runs for c in r["curves"].values())
    fig, axes = plt.subplots(1, 2 if novelty else 1, figsize=(14 if novelty else 8, 4.8), squeeze=False)
    ax = axes[0, 0]
    for (method, variant), rs in groups.items():
        for mode in [m for m in MODES if all(m in r["curves"] for r in rs)]:
            n = min(len(r["curves"][mode]["accuracy"]) for r in rs)
            if n == 0:
                continue
            x = rs[0]["curves"][mode]["samples"][:n]
            acc = torch.tensor([r["curves"][mode]["accuracy"][:n] for r in rs]) * 100  # [seeds, n]
            mean, std = acc.mean(0), acc.std(0) if len(rs) > 1 else torch.zeros(n)
            label = f"{method}, {VARIANTS[variant].label}, {mode} stats (A_auc {mean.mean():.1f})"
            ax.plot(x, mean, marker="o", ms=3, label=label, linestyle="-" if mode == "batch" else "--")
            ax.fill_between(x, mean - std, mean + std, alpha=0.15)
    ax.set(xlabel="samples seen", ylabel="any-time accuracy on seen classes (%)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if novelty:
        _plot_novelty(axes[0, 1], groups)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_novelty(ax, groups: dict[tuple[str, VariantName], list[dict]]) -> None:
    """The novelty AUROC at each any-time evaluation, mean over the seeds where it is defined."""
    for (method, variant), rs in groups.items():
        for mode in [m for m in MODES if all(m in r["curves"] for r in rs)]:
            points: dict[int, list[float]] = {}
            for r in rs:
                curve = r["curves"][mode]
                for x, a in zip(curve["samples"], curve.get("novelty_auroc", []), strict=False):
                    if a is not None:
                        points.setdefault(x, []).append(a)
            if points:
                xs = sorted(points)
                ax.plot(xs, [statistics.fmean(points[x]) for x in xs], marker="o", ms=3,
                        label=f"{method}, {VARIANTS[variant].label}, {mode} stats",
                        linestyle="-" if mode == "batch" else "--")
    ax.axhline(0.5, color="grey", lw=0.8)
    ax.set(xlabel="samples seen", ylabel="novelty AUROC (not yet learned vs learned)", ylim=(0, 1),
           title="not seen yet: the novelty score's AUROC")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def parse_methods(spec: str) -> list[str]:
    names = list(METHODS) if spec == "all" else [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; available: {', '.join(METHODS)} or 'all'")
    return names


def ceiling(out: Path, bcfg: BackboneConfig, train: ImageSet, test: ImageSet, probe: ProbeConfig,
            data: DataConfig) -> dict[str, float]:
    """The offline heads of the frozen features of backbone ``bcfg`` on the whole stream: probe, LDA and the best
    of them (cached with the runs; they depend on the data, the backbone and the probe only)."""
    key = _cache_key({"method": "offline_heads", "variant": "probe", "seed": probe.seed},
                     {"data": asdict(data), "backbone": provenance(bcfg), "probe": asdict(probe)})
    cached = out / "cache" / f"ceiling-{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())["accuracy"]
    log.info("offline heads (the ceiling) on %d training images of %s", len(train), bcfg.weights)
    acc = offline_ceiling(create_backbone(bcfg).to(device()), train.images, train.targets, test.images, test.targets,
                          len(train.classes), probe)
    cached.write_text(json.dumps({"accuracy": acc, "backbone": provenance(bcfg)}, default=str))
    return acc


def variant_parts(mepo: Path | None, rep: Path | None, cov: Path | None, prompts: Path | None
                  ) -> dict[VariantName, BundleParts]:
    """The MePo parts of each variant, from --mepo, --mepo_rep, --mepo_cov and --mepo_prompts.

    Each Sigma_pre goes with its backbone's features: Meta Cov alone takes --mepo_cov (that of the untouched
    backbone), full MePo keeps --mepo's. ISA prompts start every variant.

    Example:
        >>> variant_parts(Path("refined"), None, Path("cov.npy"), None)["cov"]
        BundleParts(rep=None, cov=PosixPath('cov.npy'), prompts=None)
    """
    covs = {"cov": cov or mepo, "mepo": mepo or cov}
    return {name: BundleParts(rep=(rep or mepo) if v.rep else None, cov=covs[name] if v.cov else None,
                              prompts=prompts)
            for name, v in VARIANTS.items()}


@dataclass
class Sweep:
    """The runs of one ``mepo evaluate``: shared data and settings, the MePo parts of each variant, and the
    ceiling of each backbone (w/o and w/ Meta Rep), measured at most once. Each run builds its own model
    (``create_model``).

    ``run(job)`` answers a job from ``out/cache`` when the same settings ran before (``job_key`` of
    ``job_config(job)``), else learns it and caches it, so a re-run continues an interrupted sweep.

    Example (what ``evaluate`` does between planning and reporting):
        sweep = Sweep(out, variant_parts(mepo, None, None, None), train, test, data, stream, backbone,
                      method_config, learner, alignment, protocol, probe)
        runs = [sweep.run(job) for job in plan_jobs(["misa"], [1, 2], ("host", "mepo"))]
    """

    out: Path
    parts: dict[VariantName, BundleParts]
    """The MePo parts of each variant (``variant_parts``)."""
    train: ImageSet
    test: ImageSet
    data: DataConfig
    stream: SiBlurryConfig
    backbone: BackboneConfig
    method_config: MethodsConfig
    learner: LearnerConfig
    alignment: AlignmentConfig
    protocol: ProtocolConfig
    probe: ProbeConfig
    ceilings: dict[bool, dict[str, float]] = field(default_factory=dict)
    backbones: dict[bool, BackboneConfig] = field(init=False)
    """The backbone config w/o (False) and w/ (True) Meta Rep."""
    common: dict = field(init=False)
    """The settings every job shares, as recorded in the cache keys and results.json."""

    def __post_init__(self) -> None:
        self.backbones = {False: self.backbone, True: backbone_config(self.backbone, self.parts["rep"])}
        self.common = {"data": asdict(self.data), "stream": asdict(self.stream), "learner": asdict(self.learner),
                       "protocol": asdict(self.protocol), "n_train": len(self.train), "n_test": len(self.test)}

    def job_config(self, job: Job) -> dict:
        """Everything that shapes the job's numbers: what its cache key hashes, and what its run records."""
        variant, parts = VARIANTS[job.variant], self.parts[job.variant]
        return {**self.common, "backbone": provenance(self.backbones[variant.rep]),
                "method_config": asdict(self.method_config),
                "alignment": asdict(self.alignment) if variant.cov else None,
                "sigma_pre": str(parts.cov) if variant.cov else None,
                "prompts": str(parts.prompts) if parts.prompts else None}

    def ceiling(self, use_rep: bool) -> dict[str, float]:
        """The offline heads of the backbone w/o or w/ Meta Rep, measured on first use."""
        if use_rep not in self.ceilings:
            bcfg = self.backbones[use_rep]
            self.ceilings[use_rep] = ceiling(self.out, bcfg, self.train, self.test, self.probe, self.data)
        return self.ceilings[use_rep]

    def run(self, job: Job) -> dict:
        """The job's run, from the cache or learnt now, with its backbone's ceiling."""
        config = self.job_config(job)
        heads = self.ceiling(VARIANTS[job.variant].rep)
        cached = self.out / "cache" / f"{job_key(job, config)}.json"
        if cached.is_file():
            run = json.loads(cached.read_text())
        else:
            run = {**asdict(job), **self.learn(job), "config": config}
            cached.write_text(json.dumps(run, default=str))
            log.info("%s %s seed %d: %s", job.method, job.variant, job.seed,
                     {m: {k: round(c[k], 4) for k in ("A_auc", "A_last")} for m, c in run["curves"].items()})
        return {**run, "ceiling": heads["probe"], "best_offline_head": heads["best"], "offline_lda": heads["lda"]}

    def learn(self, job: Job) -> dict:
        """Run the job's seed; without Meta Cov both alignment modes are the same model, so keep one."""
        model = ModelConfig(job.method, self.method_config, self.backbone, self.parts[job.variant], self.alignment,
                            self.learner, job.seed)
        run = run_seed(SeedRun(model, self.train, self.test, replace(self.stream, seed=job.seed), self.protocol))
        if not VARIANTS[job.variant].cov:
            run["curves"] = {"batch": run["curves"]["batch"]}
        return run


def evaluate(
    out: Path = Path("runs/evaluate"), seed: str = "1-5", method: str = "frozen", mepo: Path | None = None,
    mepo_rep: Path | None = None, mepo_cov: Path | None = None, mepo_prompts: Path | None = None,
    ablation: bool = False, data: DataConfig = DataConfig(), stream: SiBlurryShape = SiBlurryShape(),
    backbone: BackboneConfig = BackboneConfig(), method_config: MethodsConfig = MethodsConfig(),
    learner: LearnerConfig = LearnerConfig(), alignment: AlignmentConfig = AlignmentConfig(),
    protocol: ProtocolConfig = ProtocolConfig(), probe: ProbeConfig = ProbeConfig(),
) -> dict:
    """Run the Si-Blurry protocol offline over methods and seeds; write results.json, table.md and a plot.

    Every table reports A_last against the ceiling: an offline linear probe of the same frozen features,
    trained on all of the stream's training images and scored on the same test images. Finished runs are
    cached under out/cache, keyed by everything that shapes them, so re-running the same command continues an
    interrupted sweep instead of starting over.

    Args:
        out: Output folder.
        seed: The seed, or seeds, to run: "1", "1-5" or "1,3" (each seed gives its own stream order and model
            initialisation, as --seed and --stream.seed do in mepo serve and mepo produce).
        method: The host method, or several comma-separated, or "all": frozen, misa, dualprompt, deep_l2p, coda_p,
            mvp, linear_probe, seq_ft, seq_ft_sl.
        mepo: A MePo bundle (mepo refine): every PTM-based method runs without and with it (Meta Rep = its
            backbone, Meta Cov = its Sigma_pre); the lower bounds run without. ISA prompts come from
            --mepo_prompts only, so an ablation controls them separately.
        mepo_rep: Meta Rep only: a bundle whose backbone replaces --backbone.weights.
        mepo_cov: Meta Cov only: a bundle holding Sigma_pre, or a MePo release cov_*.npy. With --mepo and
            --ablation it is the Sigma_pre of the Meta Cov-alone runs (that of the untouched backbone, whose
            features they align), while the full MePo runs keep the bundle's.
        mepo_prompts: A bundle whose ISA prompts (mepo isa) start the prompt-based hosts, in every variant.
        ablation: With --mepo, also run Meta Rep alone and Meta Cov alone (writes ablation.md).
        data: Downstream dataset.
        stream: Si-Blurry stream settings (its seed is --seed).
        backbone: Pretrained backbone.
        method_config: Per-method hyperparameters (--method_config.misa.e_pool, ...).
        learner: Online learning settings (--learner.classifier linear ... for the paper's recipe: docs/fidelity.md).
        alignment: Meta Cov alignment settings.
        protocol: Evaluation protocol settings.
        probe: The offline probe that gives each table's ceiling.
    """
    backbone = sized(backbone, [b for b in (mepo, mepo_rep, mepo_prompts, mepo_cov) if b is not None])
    check_bundles(mepo, mepo_rep, mepo_cov, mepo_prompts, backbone)
    names = parse_methods(method)
    jobs = plan_jobs(names, parse_seeds(seed), planned_variants(mepo, mepo_rep, mepo_cov, ablation))
    (out / "cache").mkdir(parents=True, exist_ok=True)
    parts = variant_parts(mepo, mepo_rep, mepo_cov, mepo_prompts)
    sweep = Sweep(out, parts, load_split(data, "train"), load_split(data, "test"), data,
                  SiBlurryConfig(**asdict(stream)), backbone, method_config, learner, alignment, protocol, probe)
    runs = [sweep.run(job) for job in tqdm(jobs, desc="runs", unit="run")]
    return report(sweep, names, jobs, runs, mepo)


def check_bundles(mepo: Path | None, rep: Path | None, cov: Path | None, prompts: Path | None,
                  backbone: BackboneConfig) -> None:
    """Each bundle option against the parts it uses, before any work: ``--mepo`` runs Meta Rep and Meta Cov
    together, so its bundle needs both; each other option needs its own part (a ``cov_*.npy`` is Σ_pre as is)."""
    if mepo is not None:
        check_bundle(mepo, backbone, {
            BACKBONE: f"--mepo runs Meta Rep and Meta Cov, and Meta Rep needs a refined backbone; use --mepo_cov "
                      f"{mepo} for Meta Cov alone",
            SIGMA_PRE: f"--mepo runs Meta Rep and Meta Cov, and Meta Cov needs Sigma_pre; use --mepo_rep {mepo} for "
                       f"Meta Rep alone, or add Sigma_pre with `mepo covariance`"})
    if rep is not None:
        check_bundle(rep, backbone, {BACKBONE: "--mepo_rep needs a refined backbone (mepo refine)"})
    if cov is not None and Path(cov).suffix != ".npy":
        check_bundle(cov, backbone, {SIGMA_PRE: "--mepo_cov needs Sigma_pre (mepo covariance, or mepo refine)"})
    if prompts is not None:
        check_bundle(prompts, backbone, {PROMPTS: "--mepo_prompts needs ISA prompts (mepo isa)"})


def report(sweep: Sweep, names: list[str], jobs: list[Job], runs: list[dict], mepo: Path | None) -> dict:
    """Write results.json, table.md (and ablation.md) and the plot of a finished sweep; print the tables."""
    variants = {VARIANTS[j.variant].label for j in jobs}
    title = (f"{', '.join(names)} ({'; '.join(sorted(variants))}) on {sweep.data.dataset} "
             f"({sweep.backbone.name} @ {sweep.backbone.img_size}px)")
    parts = sweep.parts
    result = {"config": {**sweep.common, "methods": names, "mepo": str(mepo) if mepo else None,
                         "mepo_rep": str(parts["rep"].rep) if parts["rep"].rep else None,
                         "mepo_cov": {v: str(parts[v].cov) for v in ("cov", "mepo") if parts[v].cov},
                         "mepo_prompts": str(parts["host"].prompts) if parts["host"].prompts else None},
              "ceiling": {"w/o Meta Rep" if not k else "Meta Rep": v for k, v in sweep.ceilings.items()},
              "runs": runs}
    (sweep.out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    print(write_tables(runs, sweep.out, title))
    plot_curves(runs, sweep.out / "anytime_accuracy.png", title)
    return result
