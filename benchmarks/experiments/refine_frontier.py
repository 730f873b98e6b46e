"""The refine frontier: downstream accuracy per refine minute, measured for each recipe (arm) and budget.

Why: users pay for refine minutes once and for accuracy on every prediction after (issue 41). Each point here is
one ``mepo refine`` (an arm's options and a budget of ``k`` passes, ``--loop.meta_epochs k``) and what its
backbone buys downstream: ``mepo evaluate --method frozen --mepo_rep BUNDLE`` (the default learner, streaming LDA)
over seeds on two streams, each next to the ceiling of the same features (the offline probe and LDA that
``evaluate`` writes):

* **T**: Tiny-ImageNet downstream, 25 training images per class (the README's 2,500-sample stream), 10 test images
  per class (1,000), as ``benchmarks/results/learning_quality_tinyimagenet.json``;
* **C**: CIFAR-10, 100 training images per class (the README's 1,000-sample stream), 50 test images per class
  (500), as ``benchmarks/results/learning_quality.json``.

Both with any-time evaluations every 250 samples (the test features are encoded once per run: the backbone is
frozen, so they cost one pass over the test images). Budget 0 is the untouched backbone (no ``--mepo_rep``).

The refines run as ``mepo refine`` subprocesses into ``--runs`` (``<arm>-<k>``, ``--resume true``; a bundle whose
manifest exists is reused), without Sigma_pre or ISA (``--cov.skip true --adapt.skip true``: the streaming LDA
needs neither) and with a 10-image-per-class guard. A point's refine minutes are the manifest's ``wall_time_s``
(data loading, training and the guard's probes; not the interpreter's start). The evaluations run in this process
through the CLI (``mepo_stream.cli.main``), with their outputs under ``--runs`` (``eval-<stream>-<arm>-<k>``;
``evaluate``'s cache makes a re-run instant), so the whole frontier resumes where it stopped. A bundle is reused
by its folder name alone: after changing an arm's options or a preset's fields, delete its ``<arm>-<k>`` folders
(each point's JSON records the ``loop`` and ``pseudo_tasks`` its manifest holds).

Writes the JSON result (``write_result``: the machine and the time), the markdown table between the
``<!-- frontier:begin -->`` and ``<!-- frontier:end -->`` markers of ``--page`` (docs/refine.md) and the plot
(A_last on T and C against refine minutes, one line per arm, from the untouched backbone at 0).

Usage:
    python -m benchmarks.experiments.refine_frontier                              # every default arm at 1, 2, 4 passes
    python -m benchmarks.experiments.refine_frontier --arms finetune,old_demo --budgets 1,2,4,8
    python -m benchmarks.experiments.refine_frontier --extra_arms '{"ld65": "--preset demo --loop.layer_decay 0.65"}' \
        --arms ld65
    python -m benchmarks.experiments.refine_frontier --quick true --runs /tmp/frontier   # test_vit smoke run (seconds)
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks.tools.common import mean_std
from benchmarks.tools.service import CLI, ROOT, write_result
from benchmarks.tools.table import Row
from mepo_stream.backbone import device
from mepo_stream.precision import resolve_precision

BEGIN, END = "<!-- frontier:begin -->", "<!-- frontier:end -->"
STREAMS = {
    "T": ("Tiny-ImageNet downstream, 2,500 samples, 1,000 test",
          ["--data.dataset", "tinyimagenet-downstream", "--data.train_per_class", "25", "--data.test_per_class", "10",
           "--protocol.eval_period", "250"]),
    "C": ("CIFAR-10, 1,000 samples, 500 test",
          ["--data.dataset", "cifar10", "--data.train_per_class", "100", "--data.test_per_class", "50",
           "--protocol.eval_period", "250"]),
}
"""Each downstream stream: its description and ``mepo evaluate`` data and protocol options (issue 41's T and C)."""
REFINE_COMMON = ["--cov.skip", "true", "--adapt.skip", "true", "--guard.per_class", "10", "--resume", "true"]
"""What every refine of the frontier adds: no Sigma_pre, no ISA (the streaming LDA needs neither), a small guard."""


@dataclass(frozen=True)
class Arm:
    """A refine recipe on the frontier: ``mepo refine`` options, run at each budget of passes (``budgets`` None) or
    only at its own (a reference point)."""

    options: tuple[str, ...]
    label: str
    budgets: tuple[int, ...] | None = None


BASE = ("--data.dataset", "tinyimagenet-pretrain-base")
"""The pretraining images before the extra archive, 250 a class: the arms measured on them name them, so that a
bundle stays true to its name whatever the data folder holds."""
ARMS: dict[str, Arm] = {
    "cosine": Arm(("--preset", "best", "--loop.head", "cosine", *BASE), "fine-tuning over all 250 images per class "
                  "with a cosine training head (presets balanced and best: 2 and 4 passes)"),
    "cosine_demo": Arm(("--preset", "demo", "--loop.head", "cosine", *BASE), "fine-tuning, --preset demo (160 "
                       "images per class, 1 pass, a cosine training head)", budgets=(1,)),
    "cosine500": Arm(("--preset", "best", "--loop.head", "cosine", "--tasks.samples_per_class", "500"),
                     "fine-tuning over all 500 images per class (the extra archive too) with a cosine training head: "
                     "1 pass is balanced's 50,000 images, 2 are best's 100,000", budgets=(1, 2)),
    "cosine_demo500": Arm(("--preset", "demo", "--loop.head", "cosine"), "--preset demo drawing its 160 images per "
                          "class from 500 (the extra archive too), 1 pass", budgets=(1,)),
    "finetune": Arm(("--preset", "best", "--loop.head", "mlp", *BASE), "the same with the reference's MLP training "
                    "head (the presets until 2026-11-27)"),
    "demo": Arm(("--preset", "demo", "--loop.head", "mlp", *BASE), "--preset demo with the MLP training head (until "
                "2026-11-27)", budgets=(1,)),
    "meta": Arm(("--preset", "best", "--loop.head", "mlp", "--loop.mode", "meta", "--tasks.classes_per_group", "10",
                 "--tasks.n_tasks", "5", *BASE),
                "Meta Rep with the presets' other fields (--loop.mode meta, the MLP head; groups of 10 classes in 5 "
                "pseudo tasks: 10 Reptile updates per pass, as the reference's 1,000 classes in groups of 100)"),
    "old_demo": Arm(("--tasks.samples_per_class", "50", "--loop.inner_epochs", "2", "--loop.batch_size", "64", *BASE),
                    "the old demo refine (SGD at 84 px, 8,500 images)", budgets=(1,)),
    "paper": Arm(("--preset", "paper"), "the reference code's Meta Rep (--preset paper)"),
}
"""The known arms; ``--arms`` picks among them (default: every one but paper) and ``--extra_arms`` adds more."""
DEFAULT_ARMS = "cosine_demo,cosine,demo,finetune,meta,old_demo"
QUICK_REFINE = ["--data.num_classes", "4", "--data.train_per_class", "12", "--tasks.classes_per_group", "4",
                "--tasks.n_tasks", "2", "--tasks.samples_per_class", "10", "--loop.train_img_size", "32",
                "--guard.per_class", "4"]
"""The smoke run's refine data (4 pretraining classes, 10 images each) at test_vit's 32 px (its patch is 16)."""
QUICK_EVAL = ["--data.num_classes", "4", "--data.train_per_class", "10", "--data.test_per_class", "5",
              "--protocol.eval_period", "20"]


def parse_budgets(spec: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4] (passes: ``--loop.meta_epochs``; 0 is the untouched backbone, always measured).

    Example:
        >>> parse_budgets("4, 1,2")
        [1, 2, 4]
    """
    budgets = sorted({int(b) for b in str(spec).split(",") if b.strip()})
    if not budgets or budgets[0] < 1:
        raise ValueError(f"budgets are passes >= 1 (the untouched backbone is always measured): {spec!r}")
    return budgets


def plan(arms: dict[str, Arm], budgets: list[int]) -> list[tuple[str, int]]:
    """Every (arm, budget) to refine: each arm at the chosen budgets, a reference arm at its own.

    Example:
        >>> plan({"a": Arm((), "a"), "ref": Arm((), "ref", budgets=(1,))}, [1, 2])
        [('a', 1), ('a', 2), ('ref', 1)]
    """
    return [(name, k) for name, arm in arms.items() for k in (arm.budgets or budgets)]


def recipe(arm: str) -> str:
    """The recipe an arm refines: ``X`` for ``X`` and for its other refine seeds ``X_seed2``, ``X_seed3``, ...

    Example:
        >>> recipe("finetune_seed2"), recipe("finetune")
        ('finetune', 'finetune')
    """
    return arm.split("_seed")[0]


def refine_seed_groups(points: list[dict], streams: list[str]) -> list[dict]:
    """The points of one recipe refined with several seeds (arms ``X``, ``X_seed2``, ... at the same budget),
    pooled: refine minutes, A_last, probe and LDA on each stream as the mean and std over the refines.

    Why: a refine's seed moves downstream accuracy more than the stream's order does (docs/refine.md), so a final
    point is the mean of several refines, each still a row of its own in the table.

    Example:
        >>> def pt(arm, minutes, a):
        ...     return {"arm": arm, "budget": 1, "refine": {"minutes": minutes}, "T": dict(a_last=a, probe=a, lda=a)}
        >>> pts = [pt("a", 2.0, 0.5), pt("a_seed2", 2.2, 0.6), pt("b", 1.0, 0.9)]
        >>> [(g["arm"], g["budget"], g["arms"], round(g["minutes"], 2), round(g["T"]["a_last"][1], 3))
        ...  for g in refine_seed_groups(pts, ["T"])]
        [('a', 1, ['a', 'a_seed2'], 2.1, 0.071)]
    """
    groups: dict[tuple[str, int], list[dict]] = {}
    for p in points:
        if p.get("refine"):
            groups.setdefault((recipe(p["arm"]), p["budget"]), []).append(p)
    return [{"arm": arm, "budget": k, "arms": [p["arm"] for p in ps],
             "minutes": statistics.fmean(p["refine"]["minutes"] for p in ps),
             **{s: {m: mean_std([p[s][m] for p in ps]) for m in ("a_last", "probe", "lda")} for s in streams}}
            for (arm, k), ps in groups.items() if len(ps) > 1]


def refine_command(arm: Arm, k: int, bundle: Path, backbone: list[str], quick: bool) -> list[str]:
    """``mepo refine``'s arguments for one point (later options win: the quick sizes over the arm's)."""
    return ["refine", *arm.options, "--loop.meta_epochs", str(k), "--out", str(bundle), *backbone, *REFINE_COMMON,
            *(QUICK_REFINE if quick else [])]


def run_refine(args: list[str], bundle: Path) -> dict:
    """The bundle's refine facts, refining first unless its manifest exists (a finished point is reused)."""
    manifest = bundle / "manifest.json"
    process_s = None
    if not manifest.is_file():
        print(f"== mepo {shlex.join(args)}", flush=True)
        bundle.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(bundle.parent / f"{bundle.name}.log", "wb") as log:
            done = subprocess.run([*CLI, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                                  stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise RuntimeError(f"mepo refine exited with {done.returncode}; see {bundle.parent / bundle.name}.log")
        process_s = round(time.perf_counter() - start, 1)
    m = json.loads(manifest.read_text())
    asked = int(args[args.index("--loop.meta_epochs") + 1])
    if m["refine"]["meta_epochs"] != asked:  # a preset overriding a budget equal to the option's default
        raise ValueError(f"{bundle}: refined {m['refine']['meta_epochs']} passes, asked for {asked}")
    precision = str(resolve_precision(m["refine"]["precision"], device())).removeprefix("torch.")
    history = m.get("history", [])
    return {"bundle": str(bundle), "command": "mepo " + shlex.join(args), "wall_time_s": m["wall_time_s"],
            "minutes": m["wall_time_s"] / 60, "process_s": process_s, "images_per_s": m["refine_images_per_s"],
            "precision": precision, "cpus": m.get("cpus"), "threads": m.get("threads"), "mode": m["refine"]["mode"],
            "meta_epochs": m["refine"]["meta_epochs"],
            "meta_epochs_completed": m["meta_epochs_completed"], "images": m["data"]["n_images"],
            "held_out": history[-1].get("held_out") if history else None, "loop": m["refine"],
            "pseudo_tasks": m["pseudo_tasks"]}


def run_evaluate(args: list[str], out: Path) -> dict:
    """``mepo evaluate`` in this process (its cache under ``out`` answers a finished run); A_last and A_AUC mean ±
    std over seeds, and the ceiling of the same features (probe, LDA, the better)."""
    from mepo_stream.cli import main as mepo

    print(f"== mepo {shlex.join(args)}", flush=True)
    mepo(args)  # a run already in out/cache is read back, not learned again
    result = json.loads((out / "results.json").read_text())
    runs = result["runs"]
    a_last, a_auc = (mean_std([r["curves"]["batch"][key] for r in runs]) for key in ("A_last", "A_auc"))
    return {"command": "mepo " + shlex.join(args), "out": str(out), "seeds": [r["seed"] for r in runs],
            "a_last": a_last[0], "a_last_std": a_last[1], "a_auc": a_auc[0], "a_auc_std": a_auc[1],
            "a_last_runs": [r["curves"]["batch"]["A_last"] for r in runs], "probe": runs[0]["ceiling"],
            "lda": runs[0]["offline_lda"], "best_offline_head": runs[0]["best_offline_head"],
            "stream_samples": runs[0]["stream_length"], "eval_wall_time_s": sum(r["wall_time_s"] for r in runs)}


def evaluate_args(stream: str, bundle: Path | None, out: Path, seeds: str, backbone: list[str], quick: bool
                  ) -> list[str]:
    return ["evaluate", "--method", "frozen", *(["--mepo_rep", str(bundle)] if bundle else []), "--seed", seeds,
            "--out", str(out), *backbone, *STREAMS[stream][1], *(QUICK_EVAL if quick else [])]


def _minutes(value: float) -> str:
    """Refine minutes to a table cell: one decimal, or two significant digits under a tenth (the smoke run's).

    Example:
        >>> _minutes(4.27), _minutes(0.0083)
        ('4.3', '0.0083')
    """
    return f"{value:.1f}" if value >= 0.1 else f"{value:.2g}"


def table(result: dict) -> str:
    """The frontier as markdown: one row per point (the untouched backbone first), A_last on each stream next to
    its ceiling, then each point's ``mepo refine`` command (its evaluations' are in the JSON result)."""
    streams = result["streams"]
    head = "| arm | passes | refine min | cores | images/s | " + " | ".join(
        f"{s}: A_last % | {s}: probe / LDA %" for s in streams) + " |"
    lines = [head, "|---" * (5 + 2 * len(streams)) + "|"]
    for p in result["points"]:
        refine = p.get("refine")
        cells = [p["arm"], str(p["budget"]), _minutes(refine["minutes"]) if refine else "0",
                 str(refine.get("cpus") or "?") if refine else "–", f"{refine['images_per_s']:.0f}" if refine else "–"]
        for s in streams:
            e = p[s]
            std = f" ± {100 * e['a_last_std']:.2f}" if len(e["seeds"]) > 1 else ""
            cells += [f"{100 * e['a_last']:.2f}{std}", f"{100 * e['probe']:.2f} / {100 * e['lda']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if groups := refine_seed_groups(result["points"], list(streams)):
        columns = " | ".join(f"{s}: A_last % | {s}: probe / LDA %" for s in streams)
        lines += ["", "The same recipes over their refine seeds (mean ± std over the refines; probe and LDA: means):",
                  "", f"| arm | passes | refines | refine min | {columns} |", "|---" * (4 + 2 * len(streams)) + "|"]
        for g in groups:
            cells = [g["arm"], str(g["budget"]), ", ".join(g["arms"]), _minutes(g["minutes"])]
            for s in streams:
                (a, a_std), probe, lda = g[s]["a_last"], g[s]["probe"][0], g[s]["lda"][0]
                cells += [f"{100 * a:.2f} ± {100 * a_std:.2f}", f"{100 * probe:.2f} / {100 * lda:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    m, spec = result.get("machine", {}), result["spec"]
    precisions = sorted({p["refine"]["precision"] for p in result["points"] if p.get("refine")})
    seeds = result["points"][0][next(iter(streams))]["seeds"]
    lines += ["", f"Measured {result.get('measured_at', '?')} on {m.get('device_name', '?')} ({m.get('cpus', '?')} "
              f"CPUs, torch {m.get('torch', '?')}), refines in {', '.join(precisions) or '–'}; {spec['model']} @ "
              f"{spec['img_size']} px; `mepo evaluate --method frozen` (streaming LDA), seeds "
              f"{', '.join(map(str, seeds))}; A_last as mean ± std over seeds. Streams: "
              + "; ".join(f"**{s}**: {d}" for s, d in streams.items()) + ". Refine minutes: the bundle's "
              "`wall_time_s` (data loading, training, the guard). The refine of each point (arms: "
              + "; ".join(f"`{n}`, {a['label']}" for n, a in result["arms"].items()) + "):", "", "```bash"]
    lines += [p["refine"]["command"] for p in result["points"] if p.get("refine")]
    lines += ["```", "", f"Reproduce: `{result['command']}`"]
    return "\n".join(lines)


def update_page(page: Path, text: str, image: str | None) -> None:
    """Put ``text`` (and the plot, when there is one) between the frontier markers of ``page``; a page without
    them gets them appended, a missing page is created."""
    block = f"{BEGIN}\n{text}\n" + (f"\n![Refine frontier]({image})\n" if image else "") + END
    if not page.is_file():
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(f"# Refine\n\n{block}\n")
        return
    content = page.read_text()
    if BEGIN not in content or END not in content:
        page.write_text(content.rstrip("\n") + f"\n\n## The measured frontier\n\n{block}\n")
        return
    head, rest = content.split(BEGIN, 1)
    page.write_text(f"{head}{block}{rest.split(END, 1)[1]}")


def plot(result: dict, path: Path) -> bool:
    """A_last on each stream against refine minutes, one line per arm from the untouched backbone (0 min), each
    arm's probe dotted; where an arm has other refine seeds (``refine_seed_groups``) a point is their mean with
    the std over the refines as its error bar, else the std over the stream seeds. False without matplotlib (the
    ``plots`` extra)."""
    try:
        import matplotlib
    except ImportError:
        print(f"== no {path.name}: matplotlib is not installed (pip install 'mepo-stream[plots]')", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = list(result["streams"])
    fig, axes = plt.subplots(1, len(streams), figsize=(5.5 * len(streams), 4.2), squeeze=False)
    base = next(p for p in result["points"] if p["budget"] == 0)
    pooled = {(g["arm"], g["budget"]): g for g in refine_seed_groups(result["points"], streams)}
    arms = [a for a in result["arms"] if recipe(a) == a]  # an arm's other refine seeds join its line
    for ax, s in zip(axes[0], streams, strict=True):
        for i, arm in enumerate(arms):
            x, y, err, probe, labels = [0.0], [base[s]["a_last"]], [base[s]["a_last_std"]], [base[s]["probe"]], [""]
            for p in (p for p in result["points"] if p["arm"] == arm):
                g = pooled.get((arm, p["budget"]))
                x.append(g["minutes"] if g else p["refine"]["minutes"])
                y.append(g[s]["a_last"][0] if g else p[s]["a_last"])
                err.append(g[s]["a_last"][1] if g else p[s]["a_last_std"])
                probe.append(g[s]["probe"][0] if g else p[s]["probe"])
                labels.append(f"{p['budget']}" + (f" ({len(g['arms'])} refines)" if g else ""))
            color = f"C{i}"
            ax.errorbar(x, [100 * v for v in y], yerr=[100 * e for e in err], marker="o", ms=4, capsize=3,
                        color=color, label=arm)
            ax.plot(x, [100 * v for v in probe], linestyle=":", color=color, alpha=0.7)
            for xi, yi, label in zip(x[1:], y[1:], labels[1:], strict=True):
                ax.annotate(label, (xi, 100 * yi), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)
        ax.set(xlabel="refine minutes (the bundle's wall time)", ylabel="A_last (%)",
               title=f"{s}: {result['streams'][s]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right", title="A_last; dotted: probe", title_fontsize=7)
    m = result.get("machine", {})
    fig.suptitle(f"Accuracy per refine minute ({result['spec']['model']} @ {result['spec']['img_size']} px, "
                 f"{m.get('device_name', '?')}); labels: passes; error bars: std over refine seeds or stream "
                 "seeds", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(arms: str = DEFAULT_ARMS, budgets: str = "1,2,4", extra_arms: dict[str, str] | None = None,
         arm_budgets: dict[str, str] | None = None,
         seeds: str = "1-3", model: str = "vit_small_patch14_dinov2", weights: str | None = "dinov2",
         img_size: int = 84, quick: bool = False, runs: Path = Path("runs/frontier"),
         out: Path = Path("benchmarks/results/refine_frontier.json"), page: Path | None = Path("docs/refine.md"),
         image: Path | None = Path("docs/refine_frontier.png")) -> dict:
    """Refine each arm at each budget (cached), evaluate every bundle on T and C, write the result, table and plot.

    Args:
        arms: Comma-separated arms: finetune (the presets' recipe), meta (Meta Rep with the presets' fields),
            old_demo (the old demo refine, at 1 pass only), paper (--preset paper), or a name from --extra_arms.
        budgets: Comma-separated passes (--loop.meta_epochs) for each arm; the untouched backbone (0) always runs.
        extra_arms: More arms, name to ``mepo refine`` options, e.g. {"ld65": "--preset demo --loop.layer_decay
            0.65"}.
        arm_budgets: Budgets of particular arms instead of --budgets, name to comma-separated passes, e.g.
            {"meta": "1,2"}.
        seeds: The evaluation seeds ("1-3" for the final points).
        model: timm ViT name.
        weights: Backbone weights (dinov2, a file, or null).
        img_size: The bundles' (serving) resolution, --backbone.img_size.
        quick: Smoke sizes (test_vit-sized data, the first seed only): checks the script, measures nothing.
        runs: Folder of the bundles, their logs and the evaluations (re-running reuses them).
        out: JSON result path.
        page: The docs page whose frontier markers get the table (null: print it only).
        image: The plot's path (null: no plot); the page links it relative to the page.
    """
    known = {**ARMS, **{n: Arm(tuple(shlex.split(o)), o) for n, o in (extra_arms or {}).items()}}
    chosen = [a.strip() for a in arms.split(",") if a.strip()]
    if unknown := [a for a in chosen if a not in known]:
        raise ValueError(f"unknown arm(s) {unknown}; choose from {', '.join(known)}")
    own = {a: tuple(parse_budgets(b)) for a, b in (arm_budgets or {}).items()}
    selected = {a: replace(known[a], budgets=own[a]) if a in own else known[a] for a in chosen}
    command = ["--arms", arms, "--budgets", budgets, "--seeds", seeds, "--model", model, "--weights",
               weights or "null", "--img_size", str(img_size), *(["--quick", "true"] if quick else []),
               *(["--extra_arms", json.dumps(extra_arms)] if extra_arms else []),
               *(["--arm_budgets", json.dumps(arm_budgets)] if arm_budgets else []), "--runs", str(runs)]
    seeds = seeds.split("-")[0].split(",")[0] if quick else seeds
    backbone = ["--backbone.name", model, "--backbone.weights", weights or "null", "--backbone.img_size", str(img_size)]
    points: list[dict] = [{"arm": "untouched", "budget": 0, "refine": None}]
    for name, k in plan(selected, parse_budgets(budgets)):
        bundle = runs / f"{name}-{k}"
        points.append({"arm": name, "budget": k,
                       "refine": run_refine(refine_command(selected[name], k, bundle, backbone, quick), bundle)})
    for p in points:
        bundle = Path(p["refine"]["bundle"]) if p["refine"] else None
        for s in STREAMS:
            ev = runs / f"eval-{s}-{p['arm']}-{p['budget']}"
            p[s] = run_evaluate(evaluate_args(s, bundle, ev, seeds, backbone, quick), ev)
    precisions = [p["refine"]["precision"] for p in points if p["refine"]]
    dev = device()
    dtype = getattr(torch, precisions[0]) if precisions else resolve_precision("auto", dev)
    result = write_result({
        "benchmark": "refine_frontier", "quick": quick,
        "spec": {"model": model, "weights": weights, "img_size": img_size},
        "streams": {s: f"{d.split(',')[0]}, smoke sizes" if quick else d for s, (d, _) in STREAMS.items()},
        "stream_options": {s: [*o, *(QUICK_EVAL if quick else [])] for s, (_, o) in STREAMS.items()},
        "arms": {n: {"options": list(a.options), "label": a.label, "budgets": list(a.budgets or parse_budgets(budgets))}
                 for n, a in selected.items()},
        "budgets": parse_budgets(budgets), "seeds": seeds, "refine_common": REFINE_COMMON, "points": points,
        "command": "python -m benchmarks.experiments.refine_frontier " + shlex.join(command),
    }, out, dev, dtype)
    drawn = image is not None and plot(result, image)
    text = table(result)
    if page is not None:
        link = os.path.relpath(image, page.parent) if drawn else None
        update_page(page, text, link)
    print(text)
    return result


def table_rows(r: dict) -> list[Row]:
    """The performance table's rows: each stream's most accurate refine on the frontier against the untouched
    backbone (docs/refine.md has all, from :func:`table`)."""
    base = next(p for p in r["points"] if p["budget"] == 0)
    rows: list[Row] = []
    for s, what in r["streams"].items():
        best = max((p for p in r["points"] if p["refine"]), key=lambda p: p[s]["a_last"], default=None)
        if best is None:
            continue
        refine = best["refine"]
        rows.append((f"Refine frontier, {s} ({what}): the most accurate refine, {best['arm']} × {best['budget']} "
                     f"({refine['minutes']:.2g} min at {refine['images_per_s']:.0f} images/s, {refine['precision']}), "
                     f"A_last (probe {100 * best[s]['probe']:.1f} %) against the untouched backbone",
                     f"A_last {best[s]['a_last']:.3f}", f"{base[s]['a_last']:.3f} (untouched)",
                     best[s]["a_last"] / base[s]["a_last"] if base[s]["a_last"] else None, "–", None))
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI as run

    run(main, as_positional=False)
