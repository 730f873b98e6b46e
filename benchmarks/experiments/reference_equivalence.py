"""Reference equivalence: the paper's recipe, step by step, against the public reference code (issue 32).

Both sides start from identical state (a random timm ViT state dict, the same prompts, keys, head and Sigma_pre,
the same mini-batch with augmentation off, the same optimizer settings) and every compared tensor is reported with
its maximum absolute and relative difference. Steps:

1. the host's forward at training and at evaluation: query feature, prompt selection, CLS feature, aligned
   feature, logits, key loss;
2. the Meta Cov alignment of a batch (the re-coloured batch in fp32 and fp64, the blended feature);
3. the masked loss of one step;
4. the gradient of every trainable tensor;
5. every trainable tensor after ``online_iter`` Adam steps on one mini-batch;
6. one Meta Rep outer step of the refine: each inner SGD step on the pseudo tasks, the joint SGD step, and the
   Reptile interpolation with eps.

Our side is built by the project's own code: ``mepo_stream.model.create_model`` (MISA with Meta Cov from a bundle
holding the backbone, Sigma_pre and the prompts), ``mepo_stream.learner.OnlineLearner`` for the step, and
``offline.refine.Trainer.group`` for the outer step. The reference side is read at run time from ``--reference``,
a checkout of SunGL001/MePo (``GCL/`` holds MISA + MePo's model and trainer; ``meta_post_training.py`` the
refine); nothing of it is copied here. What had to change for it to run on a CPU without its data is patched at
run time and listed in the result (``reference_patches``).

The relative difference of a tensor is ``max|ours - theirs| / max|theirs|`` (its scale, not element-wise, so
near-zero entries do not blow it up). Tolerance: 1e-4, and 1e-3 for an update (parameters after minus before).
Each row also has a noise floor: the same comparison of our side with itself built with timm's attention unfused
(the same arithmetic in another fp32 order, the reference ViT's). Why: with B < D the alignment's ``L_B^-1``
stretches rounding by up to ``1/sqrt(eps)``, and Adam moves a coordinate by ``lr * sign(g)`` however small ``g`` is,
so two exact fp32 implementations differ by far more than 1e-4 downstream of either. A row over tolerance within 10x
of its floor is "fp32 noise"; an update within 2 ulp of its parameter is "fp32 resolution".

Without ``--reference`` the harness compares our side with a second copy of itself, optionally perturbed
(``--perturb.alpha``, ``--perturb.lr``, ``--perturb.reptile_eps``): what CI runs, on a tiny ViT, to show that the
comparison machinery reports a difference where there is one.

The harness is split by concern under ``benchmarks/experiments/equivalence/``: ``settings`` (what both sides share),
``shared_state`` (building it), ``comparison`` (rows, tolerances, verdicts), ``recording`` (what a side's step hands
back), ``ours``, ``reference`` (its stubs and source patches), and ``steps`` (steps 1-6 and their rows); this module
runs them.

Usage:
    python -m benchmarks.experiments.reference_equivalence --reference /tmp/ref/MePo
    python -m benchmarks.experiments.reference_equivalence --settings.backbone test_vit --settings.img_size 32 \\
        --perturb.lr 1e-4 --out /tmp/stand_in.json
Writes ``benchmarks/results/reference_equivalence.json``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import timm
import torch

from benchmarks.experiments.equivalence.comparison import Row, markdown_table
from benchmarks.experiments.equivalence.ours import OurHost, OurRefine
from benchmarks.experiments.equivalence.reference import ReferenceHost, ReferenceRefine, reference_patches
from benchmarks.experiments.equivalence.settings import Perturbation, Settings, Tensors
from benchmarks.experiments.equivalence.shared_state import SharedState, shared_state
from benchmarks.experiments.equivalence.steps import host_rows, refine_rows


def reference_commit(reference: Path) -> str | None:
    """The checkout's commit, when ``reference`` is a git work tree."""
    done = subprocess.run(["git", "-C", str(reference), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


@contextlib.contextmanager
def fused_attention(enabled: bool) -> Iterator[None]:
    """Within, timm builds its attention fused (``scaled_dot_product_attention``, its default) or as matmul and
    softmax: the same arithmetic in another fp32 order, which gives our side's noise floor."""
    config = importlib.import_module("timm.layers.config")
    saved = config._USE_FUSED_ATTN
    timm.layers.set_fused_attn(enabled)
    try:
        yield
    finally:
        config._USE_FUSED_ATTN = saved


def host_sides(reference: Path | None, state: SharedState, settings: Settings, perturb: Perturbation, workdir: Path,
               noise_floor: bool) -> tuple:
    """Ours; the reference (or the perturbed stand-in); ours with unfused attention (the noise floor) or None."""
    ours = OurHost(state, settings, workdir / "ours", settings.alpha, settings.lr)
    noise = None
    if noise_floor:
        with fused_attention(False):
            noise = OurHost(state, settings, workdir / "unfused", settings.alpha, settings.lr)
    if reference is not None:
        return ours, ReferenceHost(reference, state, settings), noise
    return ours, OurHost(state, settings, workdir / "stand_in", settings.alpha + perturb.alpha,
                         settings.lr + perturb.lr), noise


def refine_sides(reference: Path | None, state: SharedState, settings: Settings, perturb: Perturbation,
                 workdir: Path, noise_floor: bool) -> tuple:
    """Ours; a factory of the reference (or the perturbed stand-in) from an initial state; one of ours unfused."""
    ours = OurRefine(state, settings, workdir / "ours", settings.reptile_eps)

    def unfused(initial: Tensors) -> OurRefine:
        with fused_attention(False):
            return OurRefine(state, settings, workdir / "unfused", settings.reptile_eps)

    noise = unfused if noise_floor else None
    if reference is not None:
        return ours, lambda initial: ReferenceRefine(reference, state, settings, initial), noise
    eps = settings.reptile_eps + perturb.reptile_eps
    return ours, lambda initial: OurRefine(state, settings, workdir / "stand_in", eps), noise


def run(reference: Path | None, settings: Settings, perturb: Perturbation, tol: float, update_tol: float,
        host: bool, refine: bool, noise_floor: bool = False) -> list[Row]:
    """Every comparison's rows."""
    state, rows = shared_state(settings), []
    with tempfile.TemporaryDirectory() as tmp:
        if host:
            sides = host_sides(reference, state, settings, perturb, Path(tmp), noise_floor)
            rows += host_rows(*sides, state, settings, tol, update_tol)
        if refine:
            sides = refine_sides(reference, state, settings, perturb, Path(tmp), noise_floor)
            rows += refine_rows(*sides, settings, tol, update_tol)
    return rows


def check_settings(reference: Path | None, settings: Settings) -> None:
    if reference is not None and (settings.backbone, settings.img_size) != ("vit_base_patch16_224", 224):
        raise ValueError("the reference's host is ViT-B/16 at 224 px: keep --settings.backbone and img_size")
    if settings.refine_classes % settings.refine_tasks:
        raise ValueError("refine_classes must be a multiple of refine_tasks (the reference cuts equal tasks)")


def main(reference: Path | None = None, settings: Settings = Settings(), perturb: Perturbation = Perturbation(),
         tolerance: float = 1e-4, update_tolerance: float = 1e-3, host: bool = True, refine: bool = True,
         noise_floor: bool = True,
         out: Path = Path("benchmarks/results/reference_equivalence.json")) -> dict:
    """Compare the paper's recipe as built here with the reference code, step by step; write the JSON result.

    Args:
        reference: A checkout of SunGL001/MePo (GCL/ and meta_post_training.py). Without it our side is compared
            with a copy of itself, changed by ``perturb`` (what CI runs).
        settings: The shared state: backbone, mini-batch, recipe and the refine's group.
        perturb: Deliberate changes of the stand-in side (only without a reference).
        tolerance: Largest relative difference of a tensor that passes (fp32: 1e-4).
        update_tolerance: Largest relative difference of an update (parameters after minus before) that passes:
            looser, because fp32 parameters carry an update much smaller than themselves to only a few digits.
        host: Compare the host's forward, alignment, loss, gradients and Adam steps (steps 1-5).
        refine: Compare one Meta Rep outer step (step 6).
        noise_floor: Also compare our side with itself built with timm's attention unfused (the same arithmetic in
            another fp32 order): each row's noise floor; a row over tolerance within 10x of it is fp32 noise.
        out: JSON result path.
    """
    check_settings(reference, settings)
    start = time.time()
    rows = run(reference, settings, perturb, tolerance, update_tolerance, host, refine, noise_floor)
    result = {
        "reference": str(reference) if reference else None,
        "reference_commit": reference_commit(reference) if reference else None,
        "settings": asdict(settings), "perturb": asdict(perturb), "tolerance": tolerance,
        "update_tolerance": update_tolerance,
        "all_passed": all(r.passed is not False for r in rows),
        "rows": [asdict(r) | {"verdict": r.verdict} for r in rows],
        "reference_patches": reference_patches() if reference else [],
        "table": markdown_table(rows), "wall_s": round(time.time() - start, 1),
        "versions": {"torch": torch.__version__, "timm": timm.__version__},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(result["table"])
    return result


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
