"""The reference's own stream run on our CIFAR-10 stream (issue 32): does SunGL001/MePo collapse as we do?

``benchmarks/experiments/reference_equivalence.py`` shows that one step of our paper recipe equals the reference's. This
runs the reference's code for a whole stream: its MISA + Meta Cov host (``GCL/models/dualprompt.py``, built by its own
``select_model``, its own prompt and key initialisation) and its trainer step (``GCL/methods/dualprompt.py``:
``online_step`` -> ``online_train``: label remap, batch-present mask, 3 Adam steps a mini-batch, and
``online_after_task``, which moves its training prompt slot at each task's end), on the stream ``mepo evaluate`` learns:
the same Si-Blurry order of the same CIFAR-10 images, cut into the same mini-batches, with the same test images scored
at the same points (the seen classes' test images in dataset order, 128 a batch, no logit mask, the reference's Meta Cov
on each test batch's statistics as its evaluation computes them).

What is ours, not the reference's (nothing of the reference is copied here; it is read from ``--reference`` and
patched at run time, the patches listed in the JSON):

- the backbone: the reference's host is hard-wired to ViT-B/16 at 224 px, whose ImageNet-21K weights are not
  available here; ``timm.create_model`` inside its constructor returns our DINOv2 ViT-S/14 at 84 px with its
  weights instead (a timm ViT, whose blocks the reference's forward calls as modules), plus the ``fc`` head the
  reference reads (timm's init: truncated normal, std 0.02; bias 0);
- Sigma_pre: ours (``--mepo_cov``), set as ``--cor_path`` would, on the CPU; alpha 0.7, as our runs use;
- the training augmentation: ours (the same as our paper recipe: resize, crop, flip, AutoAugment ``imagenet``),
  since the reference builds its own in ``methods/_trainer.py``, which it ships only as a ``.pyc``;
- the accuracy count of its ``online_evaluate`` (``_interpret_pred`` is in that ``.pyc`` too): per-class hits.

Usage:
    python -m benchmarks.experiments.reference_run --reference /tmp/ref/MePo --seed 1-3 \\
        --mepo_cov benchmarks/results/work/sigma_pre_vit_small_patch14_dinov2_84 \\
        --train_per_class 100 --test_per_class 50 --eval_period 250
Writes ``benchmarks/results/reference_run.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import timm
import torch
from tqdm import tqdm

from benchmarks.experiments.equivalence.reference import (
    HOST_STUBS,
    _NoMemory,
    import_reference_gcl,
    timm_registry_kept,
)
from benchmarks.experiments.reference_equivalence import reference_commit
from benchmarks.tools.common import mean_std
from benchmarks.tools.service import device_name
from mepo_stream.anytime import stream_batches
from mepo_stream.artifacts import SIGMA_PRE, load_part
from mepo_stream.backbone import BackboneConfig, create_backbone, normalization
from mepo_stream.data import DataConfig, load_split
from mepo_stream.sampler import SiBlurryConfig, si_blurry_stream
from mepo_stream.transforms import test_transform, train_transform
from offline.evaluate import parse_seeds

PATCHES = [
    *(f"{name}: {why}" for name, why in HOST_STUBS.items()),
    "models.dualprompt.DualPrompt: built by utils.train_utils.select_model('DualPrompt', 'cifar10', 10, ...) with "
    "memory_size 0 and cor_coef alpha; inside, timm.create_model returns our DINOv2 ViT-S/14 (weights loaded) at "
    "the stream's image size with an fc head (trunc-normal std 0.02, bias 0), not ViT-B/16 at 224 px",
    "Sigma_pre: our bundle's, set after construction on the CPU (cov_matrix_tensor = float32, cor_path set), as "
    "--cor_path would without the constructor's .to('cuda')",
    "trainer: methods.dualprompt.DualPrompt without _Trainer.__init__ (which loads its datasets); its attributes "
    "set as the scripts run it: Adam via select_optimizer at lr 5e-3, the 'default' scheduler, AMP off, memory 0, "
    "batch mask on, online_iter 3, our training augmentation as train_transform",
    "evaluation: its online_evaluate with _interpret_pred (in the .pyc) replaced by a per-class hit count; the "
    "test loader is the seen classes' test images in dataset order, 128 a batch",
]


def reference_host(gcl: Path, backbone: BackboneConfig, n_classes: int, sigma_pre: torch.Tensor, alpha: float,
                   seed: int):
    """The reference's MISA + Meta Cov model on our backbone, and its DualPrompt module (the trainer's class)."""
    vit = create_backbone(backbone)
    with timm_registry_kept():
        _, train_utils, methods = import_reference_gcl(gcl)
        real = timm.create_model

        def ours(name, pretrained=False, num_classes=0, **kwargs):
            vit.fc = torch.nn.Linear(vit.num_features, num_classes)
            torch.nn.init.trunc_normal_(vit.fc.weight, std=0.02)
            torch.nn.init.zeros_(vit.fc.bias)
            return vit

        timm.create_model = ours
        try:
            torch.manual_seed(seed)
            model = train_utils.select_model("DualPrompt", "cifar10", n_classes, None,
                                             {"memory_size": 0, "cor_coef": alpha})
        finally:
            timm.create_model = real
    model.cor_path, model.cor_coef = "<our Sigma_pre>", alpha
    model.cov_matrix_tensor = sigma_pre.to(torch.float32)
    return model, train_utils, methods


def reference_trainer(model, train_utils, methods, n_classes: int, n_tasks: int, lr: float, batch_size: int,
                      online_iter: int, transform):
    """MePo's DualPrompt trainer without ``_Trainer.__init__``, set up as its scripts run it."""
    trainer = object.__new__(methods.DualPrompt)
    trainer.__dict__.update(
        model=model, memory=_NoMemory(), exposed_classes=[], mask=torch.zeros(n_classes) - torch.inf,
        distributed=False, sessionmask=False, nobatchmask=False, sched_name="default", memory_batchsize=0,
        memory_size=0, online_iter=online_iter, temp_batchsize=batch_size, world_size=1, n_classes=n_classes,
        n_tasks=n_tasks, device=torch.device("cpu"), train_transform=transform, topk=1, use_amp=False,
        scaler=torch.amp.GradScaler("cpu", enabled=False), criterion=model.loss_fn, task_id=0)
    trainer.optimizer = train_utils.select_optimizer("adam", lr, model)
    trainer.scheduler = train_utils.select_scheduler("default", trainer.optimizer)

    def interpret_pred(y: torch.Tensor, pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = torch.bincount(y, minlength=n_classes)
        hits = torch.bincount(y[pred == y], minlength=n_classes)
        return count, hits

    trainer._interpret_pred = interpret_pred
    return trainer


def evaluate_seen(trainer, test_x: torch.Tensor, test_y: torch.Tensor, batch_size: int = 128) -> float:
    """The reference's ``online_evaluate`` on the seen classes' test images (dataset order)."""
    keep = torch.isin(test_y, torch.tensor(trainer.exposed_classes)).nonzero().squeeze(1)
    loader = [(test_x[idx], test_y[idx].clone()) for idx in keep.split(batch_size)]
    return trainer.online_evaluate(loader)["avg_acc"]


def run_seed(reference: Path, sigma_pre: torch.Tensor, seed: int, data: DataConfig, img_size: int,
             eval_period: int, alpha: float, lr: float, batch_size: int, online_iter: int,
             autoaugment: str | None) -> dict:
    """One seed: the reference learns the stream ``mepo evaluate --seed SEED`` learns; its curve and A_last."""
    torch.manual_seed(seed)
    backbone = BackboneConfig("vit_small_patch14_dinov2", "dinov2", img_size)
    train, test = load_split(data, "train"), load_split(data, "test")
    n_classes = len(train.classes)
    stream_cfg = SiBlurryConfig(seed=seed)
    stream = si_blurry_stream(train.targets.tolist(), stream_cfg.n_tasks, stream_cfg.n, stream_cfg.m, seed)
    model, train_utils, methods = reference_host(reference / "GCL", backbone, n_classes, sigma_pre, alpha, seed)
    mean, std = normalization(model.backbone)
    trainer = reference_trainer(model, train_utils, methods, n_classes, stream_cfg.n_tasks, lr, batch_size,
                                online_iter, train_transform(img_size, mean, std, autoaugment))
    test_x = test_transform(img_size, mean, std)(test.images)
    start, seen, next_eval = time.time(), 0, eval_period
    curve: dict[str, list] = {"samples": [], "accuracy": [], "task_accuracy": []}
    bar = tqdm(total=len(stream.order), desc=f"reference MISA + MePo, seed {seed}", unit="img")
    for task in stream.tasks:
        for batch in stream_batches([task], batch_size, eval_period, seen):
            idx = torch.tensor(batch)
            loss, _ = trainer.online_step(train.images[idx], train.targets[idx].clone(), None)
            seen += len(idx)
            bar.update(len(idx))
            bar.set_postfix(loss=f"{loss:.3f}", classes=len(trainer.exposed_classes))
            if seen >= next_eval:
                curve["samples"].append(next_eval)
                curve["accuracy"].append(evaluate_seen(trainer, test_x, test.targets))
                next_eval += eval_period
        if trainer.exposed_classes:
            curve["task_accuracy"].append(evaluate_seen(trainer, test_x, test.targets))
        trainer.online_after_task(None)
    bar.close()
    with torch.no_grad():  # where the final predictions go: the collapse, if any
        model.eval()
        keep = torch.isin(test.targets, torch.tensor(trainer.exposed_classes)).nonzero().squeeze(1)
        preds = torch.cat([model(test_x[i]).argmax(1) for i in keep.split(128)])
        shares = torch.bincount(preds, minlength=n_classes).float() / len(preds)
    top = int(shares.argmax())
    return {"seed": seed, "samples": len(stream.order), "A_last": curve["task_accuracy"][-1],
            "A_auc": float(np.mean(curve["accuracy"])), "curve": curve,
            "most_predicted": {"class": train.classes[trainer.exposed_classes[top]], "share": float(shares[top])},
            "wall_s": round(time.time() - start, 1)}


def main(reference: Path, mepo_cov: Path, seed: str = "1", train_per_class: int = 30, test_per_class: int = 20,
         img_size: int = 84, eval_period: int = 100, alpha: float = 0.7, lr: float = 5e-3, batch_size: int = 32,
         online_iter: int = 3, autoaugment: str | None = "imagenet", commit: str | None = None,
         out: Path = Path("benchmarks/results/reference_run.json")) -> dict:
    """Run the reference's MISA + MePo on our CIFAR-10 stream; write each seed's any-time curve and A_last.

    Args:
        reference: A checkout of SunGL001/MePo.
        mepo_cov: A bundle holding Sigma_pre of the same backbone (``mepo covariance``).
        seed: Stream seeds (and the reference's initialisation seeds), as ``mepo evaluate --seed``: 1, 1-3, 1,3.
        train_per_class: Stream images per class (``--data.train_per_class``).
        test_per_class: Test images per class.
        img_size: Input resolution of the DINOv2 ViT-S/14.
        eval_period: Any-time evaluation period in samples.
        alpha: Meta Cov blend weight.
        lr: Adam learning rate.
        batch_size: Stream mini-batch size.
        online_iter: Adam steps a mini-batch.
        autoaugment: AutoAugment policy of the training augmentation.
        commit: The reference's commit, recorded in the result; by default read from ``reference`` when it is a git
            work tree (a tree checked out with ``git --work-tree`` is not).
        out: JSON result path.
    """
    data = DataConfig("cifar10", train_per_class=train_per_class, test_per_class=test_per_class)
    sigma_pre = load_part(mepo_cov, SIGMA_PRE)[SIGMA_PRE]
    runs = [run_seed(reference, sigma_pre, s, data, img_size, eval_period, alpha, lr, batch_size, online_iter,
                     autoaugment) for s in parse_seeds(seed)]
    (a_last, a_last_std), shape = mean_std([r["A_last"] for r in runs]), SiBlurryConfig()
    result = {
        "benchmark": "reference_run", "reference": str(reference),
        "reference_commit": commit or reference_commit(reference),
        "stream": {"dataset": "cifar10", "train_per_class": train_per_class, "test_per_class": test_per_class,
                   "samples": runs[0]["samples"], "seeds": [r["seed"] for r in runs], "tasks": shape.n_tasks,
                   "n": shape.n, "m": shape.m, "eval_period": eval_period},
        "backbone": {"name": "vit_small_patch14_dinov2", "weights": "dinov2", "img_size": img_size},
        "recipe": {"alpha": alpha, "lr": lr, "batch_size": batch_size, "online_iter": online_iter,
                   "autoaugment": autoaugment, "sigma_pre": str(mepo_cov)},
        "A_last_mean": a_last, "A_last_std": a_last_std,
        "runs": runs,
        "reference_patches": PATCHES, "machine": device_name(torch.device("cpu")),
        "threads": torch.get_num_threads(), "versions": {"torch": torch.__version__, "timm": timm.__version__},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps([{k: r[k] for k in ("seed", "A_last", "A_auc", "most_predicted", "wall_s")} for r in runs]))
    return result


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
