"""The docs/results.md table of ``benchmarks/experiments/refine_comparison.sh``: every backbone's offline heads and
online learners.

Reads the sweeps' ``results.json`` under ``RUNS/eval/<dataset>/`` and prints one markdown table per dataset: for
each backbone (untouched, fine-tuned, Meta Rep), the offline logistic probe and the best offline head of its
features, then A_last and A_AUC (mean ± std over seeds, batch alignment statistics) of the default learner
without and with Meta Cov and of MISA with the fixes without and with ISA prompts, each with A_last ÷ the best
offline head of the same features and stream.

Usage:
    python -m benchmarks.tools.refine_comparison_table --runs runs/refine_comparison
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.tools.common import mean_std

BACKBONES = {"base": "untouched", "finetune": "fine-tuned", "meta": "Meta Rep",
             "finetune2": "fine-tuned, twice the budget"}
# row label -> (sweep folder, variant) per backbone; {b} is the backbone's name
ROWS = {
    "default learner (frozen + streaming LDA)": {"base": ("frozen_base", "host"), "*": ("frozen_{b}", "rep")},
    "default learner + Meta Cov (its own Σ_pre)": {"base": ("frozen_cov_base", "cov"), "*": ("frozen_{b}", "mepo")},
    "MISA + fixes, random prompts": {"base": ("misa_base", "host"), "*": ("misa_{b}", "rep")},
    "MISA + fixes, ISA prompts": {"base": ("misa_isa_base", "host"), "*": ("misa_isa_{b}", "rep")},
}


def runs_of(folder: Path, variant: str) -> list[dict]:
    """The finished runs of one variant in a sweep folder (empty if the sweep has not run)."""
    path = folder / "results.json"
    if not path.is_file():
        return []
    return [r for r in json.loads(path.read_text())["runs"] if r["variant"] == variant]


def cell(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    mean, std = mean_std(values)
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


def table(folder: Path) -> list[str]:
    """The markdown rows of one dataset's folder."""
    lines = ["| backbone | offline probe / best head | learner | seeds | A_last % | A_AUC % | A_last ÷ best head |",
             "|---|---|---|---|---|---|---|"]
    for b, label in BACKBONES.items():
        first = True
        for row, where in ROWS.items():
            sweep, variant = where.get(b, where["*"])
            rs = runs_of(folder / sweep.format(b=b), variant)
            if not rs:
                continue
            heads = f"{100 * rs[0]['ceiling']:.1f} / {100 * rs[0]['best_offline_head']:.1f}" if first else ""
            a_last = [r["curves"]["batch"]["A_last"] for r in rs]
            lines.append(f"| {label if first else ''} | {heads} | {row} | {len(rs)} | {cell(a_last)} | "
                         f"{cell([r['curves']['batch']['A_auc'] for r in rs])} | "
                         f"{cell([a / r['best_offline_head'] for a, r in zip(a_last, rs, strict=True)], 1.0, 2)} |")
            first = False
    return lines


TABLE1_COLUMNS = {"w/o MePo": ("table1_meta", "host"), "Meta Rep": ("table1_meta", "rep"),
                  "fine-tuned (same budget)": ("table1_finetune", "rep"), "Meta Cov": ("table1_meta", "cov"),
                  "Meta Rep + Meta Cov (MePo)": ("table1_meta", "mepo"),
                  "fine-tuned + Meta Cov": ("table1_finetune", "mepo")}
"""Table 1's columns: (sweep folder, variant). Meta Cov alone uses the untouched backbone's Sigma_pre; with a
refined backbone, that backbone's own."""


def table1(folder: Path, metric: str = "A_last") -> list[str]:
    """Table 1 and its ablation in one: every host's ``metric`` (mean ± std over seeds) without MePo, with each
    refine as Meta Rep, with Meta Cov, and with both, from the ``table1_*`` sweeps of ``refine_comparison.sh``."""
    runs = {column: runs_of(folder / sweep, variant) for column, (sweep, variant) in TABLE1_COLUMNS.items()}
    hosts = list(dict.fromkeys(r["method"] for rs in runs.values() for r in rs))
    lines = [f"| host ({metric} %) | " + " | ".join(TABLE1_COLUMNS) + " |", "|---" * (len(TABLE1_COLUMNS) + 1) + "|"]
    for host in hosts:
        cells = []
        for column in TABLE1_COLUMNS:
            values = [r["curves"]["batch"][metric] for r in runs[column] if r["method"] == host]
            cells.append(cell(values) if values else "–")
        lines.append(f"| {host} | " + " | ".join(cells) + " |")
    return lines


def main(runs: Path = Path("runs/refine_comparison")) -> None:
    """Print the table of every dataset evaluated under ``runs/eval``, and Table 1 where it ran."""
    for folder in sorted((runs / "eval").iterdir()):
        print(f"\n{folder.name}\n")
        print("\n".join(table(folder)))
        if (folder / "table1_meta" / "results.json").is_file():
            for metric in ("A_last", "A_auc"):
                print(f"\nTable 1, {metric}\n")
                print("\n".join(table1(folder, metric)))


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main)
