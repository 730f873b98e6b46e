"""The reference-equivalence harness (benchmarks/experiments/reference_equivalence.py): its comparison machinery, the
stand-in run on a tiny ViT (our side against a copy of itself, exact, and perturbed copies, each difference reported at
the step it belongs to), and, when ``MEPO_REFERENCE_DIR`` names a SunGL001/MePo checkout, the run against the reference
code itself (skipped in CI, which has neither the checkout nor the internet)."""

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks.experiments.equivalence.comparison import (
    compare,
    compare_index,
    compare_updates,
    markdown_table,
    with_noise_floor,
)
from benchmarks.experiments.equivalence.reference import patched_refine_source
from benchmarks.experiments.equivalence.settings import Perturbation, Settings
from benchmarks.experiments.reference_equivalence import main, run

TINY = Settings(backbone="test_vit", img_size=32, batch_size=8, batch_classes=3, data="synthetic",
                refine_classes=2, refine_tasks=2, refine_train_per_class=1, refine_query_per_class=1)
REFERENCE = os.environ.get("MEPO_REFERENCE_DIR")


def by_step(rows, prefix: str):
    return [r for r in rows if r.step.startswith(prefix)]


def test_a_row_reports_the_largest_difference_relative_to_the_reference_scale():
    theirs = torch.tensor([2.0, -4.0, 0.0])
    row = compare("s", "t", theirs + torch.tensor([0.0, 0.0, 1e-3]), theirs, tol=1e-4)
    assert (row.max_abs, row.max_rel, row.passed) == (pytest.approx(1e-3), pytest.approx(2.5e-4), False)
    assert compare("s", "t", theirs.clone(), theirs, tol=0.0).passed
    assert compare("s", "t", theirs + 1, theirs, tol=1e-4, documented="why").passed is None
    assert compare_index("s", "i", torch.tensor([0, 1]), torch.tensor([0, 2])).max_abs == 0.5
    assert "| s | t | 1.00e-03 | 2.50e-04 |  | **no** |" in markdown_table([row])


def test_a_difference_within_ten_times_our_own_fp32_noise_floor_is_called_noise_and_no_more():
    theirs = torch.ones(4)
    rows = [compare("s", t, theirs * (1 + d), theirs, tol=1e-4) for t, d in (("a", 1e-3), ("b", 1e-2))]
    with_noise_floor(rows, [compare("s", t, theirs * (1 + 2e-4), theirs, tol=1e-4) for t in ("a", "b")])
    assert [r.verdict for r in rows] == ["fp32 noise", "no"]
    assert rows[0].passed is None and rows[1].passed is False and rows[0].noise_rel == pytest.approx(2e-4, rel=1e-3)


def test_an_update_is_compared_apart_from_the_parameter_it_moves():
    start = {"w": torch.full((3,), 10.0)}
    ours, theirs = {"w": start["w"] + 1e-3}, {"w": start["w"] + 2e-3}
    assert compare("s", "w", ours["w"], theirs["w"], tol=1e-4).passed  # 1e-4 of the parameter: invisible
    row = compare_updates("s", ours, theirs, start, tol=1e-3)
    assert row.passed is False and row.max_rel == pytest.approx(0.5, rel=1e-3)


def test_an_update_below_the_parameters_fp32_spacing_may_round_either_way():
    start = {"w": torch.ones(4)}
    ours = {"w": torch.lerp(start["w"], start["w"] + 4e-7, 0.1)}  # 4e-8: under the spacing of 1.0 (1.2e-7)
    theirs = {"w": start["w"] + torch.finfo(torch.float32).eps}  # the same, rounded up to one ulp
    row = compare_updates("s", ours, theirs, start, tol=1e-3)
    assert row.verdict == "fp32 resolution" and row.max_rel == 1.0


def test_the_stand_in_equals_itself_exactly(tmp_path):
    result = main(settings=TINY, out=tmp_path / "r.json")
    assert result["all_passed"] and json.loads((tmp_path / "r.json").read_text())["rows"]
    checked = [r for r in result["rows"] if r["passed"] is not None]
    assert {r["step"][0] for r in checked} == set("123456")
    assert all(r["max_abs"] == 0 for r in checked)


def test_a_perturbed_learning_rate_fails_only_the_adam_update():
    rows = run(None, TINY, Perturbation(lr=1e-3), 1e-4, 1e-3, host=True, refine=False)
    assert all(r.passed is not False for r in rows if r.step[0] in "1234")
    updates = [r for r in by_step(rows, "5") if r.tensor.startswith("update")]
    assert updates and not any(r.passed for r in updates)


def test_a_perturbed_alpha_fails_from_the_alignment_on_and_not_before():
    rows = run(None, TINY, Perturbation(alpha=0.01), 1e-4, 1e-3, host=True, refine=False)
    forward = {r.tensor: r.passed for r in by_step(rows, "1 forward (train, task 0)")}
    assert forward["query [B, D]"] and forward["CLS [B, D]"] and forward["prompt selection [B]"]
    assert not forward["aligned CLS [B, D]"] and not forward["logits [B, C]"]
    alignment = {r.tensor: r.passed for r in by_step(rows, "2")}
    assert alignment["re-coloured batch, fp32 [B, D]"] and not alignment["aligned feature, fp32 [B, D]"]
    assert by_step(rows, "3")[0].max_abs > 0 and not all(r.passed for r in by_step(rows, "4"))


def test_a_perturbed_reptile_eps_fails_only_the_interpolation():
    rows = run(None, TINY, Perturbation(reptile_eps=0.05), 1e-4, 1e-3, host=False, refine=True)
    reptile = by_step(rows, "6 refine: after the Reptile")
    assert len(rows) > len(reptile) and all(r.passed for r in rows if r not in reptile)
    assert reptile and not any(r.passed for r in reptile)


def test_a_reference_script_the_patches_do_not_fit_is_refused(tmp_path):
    script = tmp_path / "meta_post_training.py"
    script.write_text("import wandb\n")
    with pytest.raises(ValueError, match="another reference version"):
        patched_refine_source(script, tmp_path)


@pytest.mark.skipif(not REFERENCE, reason="MEPO_REFERENCE_DIR (a SunGL001/MePo checkout) is not set")
@pytest.mark.timeout(3600)
def test_the_recipe_equals_the_reference_code_step_by_step(tmp_path):
    settings = Settings(batch_size=4, batch_classes=3, data="synthetic")
    result = main(reference=Path(REFERENCE), settings=settings, out=tmp_path / "r.json")
    failed = [(r["step"], r["tensor"], r["max_rel"]) for r in result["rows"] if r["passed"] is False]
    assert not failed
