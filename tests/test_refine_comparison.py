"""The refine comparison's table (docs/results.md) is built from the sweeps' results.json, one row per backbone
and learner."""

import json

from benchmarks.tools.refine_comparison_table import table, table1


def _run(variant: str, seed: int, a_last: float, method: str = "frozen") -> dict:
    return {"method": method, "variant": variant, "seed": seed, "ceiling": 0.4, "best_offline_head": 0.5,
            "curves": {"batch": {"A_last": a_last, "A_auc": a_last + 0.1}}}


def test_rows_come_from_each_backbones_sweep_and_variant(tmp_path):
    sweeps = {"frozen_base": [_run("host", s, 0.30 + s / 100) for s in (1, 2, 3)],
              "frozen_finetune": [_run("host", 1, 0.99), _run("rep", 1, 0.45), _run("mepo", 1, 0.44)]}
    for name, runs in sweeps.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"runs": runs}))
    rows = table(tmp_path)
    assert rows[2] == ("| untouched | 40.0 / 50.0 | default learner (frozen + streaming LDA) | 3 | 32.0 ± 1.0 | "
                       "42.0 ± 1.0 | 0.64 ± 0.02 |")
    assert rows[3].startswith("| fine-tuned | 40.0 / 50.0 | default learner (frozen + streaming LDA) | 1 | 45.0 ± 0.0")
    assert rows[4].startswith("|  |  | default learner + Meta Cov (its own Σ_pre) | 1 | 44.0 ± 0.0")
    assert len(rows) == 5  # nothing for sweeps that have not run


def test_table1_has_a_row_per_host_and_a_column_per_backbone_and_part(tmp_path):
    sweeps = {"table1_meta": [_run(v, s, a, m) for m in ("frozen", "misa") for s in (1, 2)
                              for v, a in (("host", 0.30), ("rep", 0.31), ("cov", 0.29), ("mepo", 0.305))],
              "table1_finetune": [_run("rep", s, 0.40 + s / 100, "frozen") for s in (1, 2)]}
    for name, runs in sweeps.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps({"runs": runs}))
    rows = table1(tmp_path)
    assert rows[0].startswith("| host (A_last %) | w/o MePo | Meta Rep | fine-tuned (same budget) |")
    assert rows[2] == "| frozen | 30.0 ± 0.0 | 31.0 ± 0.0 | 41.5 ± 0.7 | 29.0 ± 0.0 | 30.5 ± 0.0 | – |"
    assert rows[3].startswith("| misa | 30.0 ± 0.0 | 31.0 ± 0.0 | – |") and len(rows) == 4
