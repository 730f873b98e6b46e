"""Why the online learners collapse, measured: one Si-Blurry stream, the paper's recipe against the default.

The stream, its mini-batches (never across a task boundary or a scheduled evaluation) and the evaluation
schedule are ``mepo evaluate``'s (``offline.evaluate.run_seed``). Two learners see it:

* ``paper_recipe``: ``linear_probe`` with ``PAPER_RECIPE`` (SGD-trained linear head, batch-present logit mask,
  3 Adam steps per mini-batch, no mask at evaluation);
* ``default``: ``frozen`` with ``LearnerConfig()`` (streaming LDA on the frozen features).

What is measured, and why each number is a candidate cause:

* per-class test accuracy at every any-time evaluation and after each task: does one class win everything?
* the paper head at the end: per-class weight norms and biases, the shared logit ``W_k . mu + b_k``
  (``mu`` = mean test feature, the same for every image) against the spread of its discriminative part
  ``W_k . (x - mu)``: if the first varies across classes far more than the second, the argmax ignores the image;
* single-class mini-batches: under the batch mask their loss is exactly 0, so they teach nothing;
* Adam steps on rows whose gradient is zero (masked classes): momentum keeps moving them; the change of the
  shared logit those steps cause, against the change caused by steps with a gradient;
* feature scale: ``||mu||`` against the per-dimension std, the share of ``E||x||^2`` the mean carries, the
  cosine of different-class pairs raw and centred; Adam's step (``lr`` per coordinate) against the head's
  weight scale and the logit change one step makes;
* MISA's random uniform(-1, 1) prompt initialisation: the prompted CLS feature against the plain one on the
  same test images, and nearest-class-mean accuracy of each (class means from the training images).

Features of the frozen backbone are computed once per image set and reused wherever the model is frozen, so
only the paper recipe's augmented training forwards are repeated.

Usage:
    python -m benchmarks.experiments.learning_diagnosis
Writes ``benchmarks/results/learning_diagnosis.json`` and ``benchmarks/results/learning_diagnosis.png``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.tools.service import write_result
from mepo_stream.anytime import AnytimeEvaluation, stream_batches
from mepo_stream.backbone import BackboneConfig, device
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.heads import NearestClassMean
from mepo_stream.learner import PAPER_RECIPE, LearnerConfig, OnlineLearner
from mepo_stream.methods.base import ContinualMethod, Encoded
from mepo_stream.model import ModelConfig, create_model
from mepo_stream.sampler import SiBlurryConfig, si_blurry_stream

EVAL_BATCH = 128
LEARNERS = {"paper_recipe": ("linear_probe", PAPER_RECIPE), "default": ("frozen", LearnerConfig())}
"""The two learners compared: name -> (host method, learner configuration)."""
TITLES = {"paper_recipe": "linear_probe, SGD head, batch mask", "default": "frozen, streaming LDA"}


def count_single_class(batches: list[list[int]], targets: torch.Tensor) -> int:
    """Mini-batches holding one class only: under the batch mask their loss is exactly 0."""
    return sum(len(targets[b].unique()) == 1 for b in batches)


def class_exposure(batches: list[list[int]], targets: torch.Tensor, n_classes: int) -> dict[int, dict]:
    """Per class: first and last stream position, mini-batches it shares with another class (the only ones
    that give its head row a gradient under the batch mask) and mini-batches it fills alone."""
    out = {c: {"first_seen": None, "last_seen": None, "shared_batches": 0, "alone_batches": 0}
           for c in range(n_classes)}
    position = 0
    for batch in batches:
        labels = targets[batch]
        classes = labels.unique().tolist()
        for offset, y in enumerate(labels.tolist()):
            if out[y]["first_seen"] is None:
                out[y]["first_seen"] = position + offset
            out[y]["last_seen"] = position + offset
        for c in classes:
            out[c]["shared_batches" if len(classes) > 1 else "alone_batches"] += 1
        position += len(batch)
    return out


@torch.no_grad()
def features(model: ContinualMethod, images: torch.Tensor) -> torch.Tensor:
    """Eval-mode features [N, D] of uint8 images [N, 3, H, W], in batches, as predictions see them."""
    return torch.cat([model.encode_images(images[s: s + EVAL_BATCH]).feature.cpu()
                      for s in range(0, len(images), EVAL_BATCH)])


@torch.no_grad()
def predict_cached(learner: OnlineLearner, feats: torch.Tensor) -> torch.Tensor:
    """Original-label predictions [N] from cached frozen features [N, D], through the learner's own
    prediction function (``predict_logits``): the same numbers ``learner.predict`` gives, without the backbone."""
    learner.method.eval()
    preds = []
    for s in range(0, len(feats), EVAL_BATCH):
        encoded = Encoded(feats[s: s + EVAL_BATCH].to(learner.device), feats.new_zeros(()))
        logits = learner.method.predict_logits(encoded, len(learner.exposed), "running")
        preds.append(learner.to_labels(logits.argmax(1)))
    return torch.cat(preds)


class HeadTracker:
    """Watches every Adam step of the linear head: which rows move without a gradient, and how much each step
    changes the shared logit ``W_k . mu + b_k`` (``mu`` [D] = mean test feature)."""

    def __init__(self, head: torch.nn.Linear, optimizer: torch.optim.Optimizer, mu: torch.Tensor):
        self.head, self.optimizer, self.mu = head, optimizer, mu.to(head.weight.device)
        n = head.out_features
        self.zero_grad_moves = torch.zeros(n, dtype=torch.long)  # steps on a row with grad 0 but momentum != 0
        self.drift_zero_grad = torch.zeros(n, dtype=torch.float64)  # change of the shared logit from those steps
        self.drift_gradient = torch.zeros(n, dtype=torch.float64)  # ... from steps with a gradient
        self.step_changes: list[torch.Tensor] = []  # |change of the shared logit| of rows with a gradient, per step
        self.weight_steps: list[torch.Tensor] = []  # mean |change of a weight| of rows with a gradient, per step
        self._before: tuple | None = None
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)

    def shared(self) -> torch.Tensor:
        return (self.head.weight @ self.mu + self.head.bias).detach().double().cpu()  # [C]

    def _pre(self, *_) -> None:
        w, b = self.head.weight, self.head.bias
        has_grad = (w.grad != 0).any(1) | (b.grad != 0)  # [C]
        state = self.optimizer.state.get(w, {})
        momentum = (state["exp_avg"] != 0).any(1) if "exp_avg" in state else torch.zeros_like(has_grad)
        self._before = (has_grad.cpu(), (momentum & ~has_grad).cpu(), self.shared(), w.detach().clone())

    def _post(self, *_) -> None:
        has_grad, moved, before, w_before = self._before
        change = self.shared() - before  # [C]
        self.zero_grad_moves += moved.long()
        self.drift_zero_grad += change * moved
        self.drift_gradient += change * has_grad
        self.step_changes.append(change[has_grad].abs())
        self.weight_steps.append((self.head.weight.detach() - w_before)[has_grad.to(w_before.device)].abs()
                                 .mean(1).cpu())


def run_stream(learner: OnlineLearner, train: ImageSet, tasks: list[list[int]], test: ImageSet,
               test_feats: torch.Tensor, eval_period: int) -> dict:
    """One pass in ``run_seed``'s order, scored by the core's any-time evaluation (``AnytimeEvaluation``, the
    schedule ``mepo evaluate`` and the service use); per-class accuracy at every evaluation, the losses."""
    evaluation, anytime, end_of_task, losses = AnytimeEvaluation(test, eval_period, EVAL_BATCH), [], [], []
    for task in tasks:
        for batch in evaluation.batches(learner, task, learner.cfg.batch_size):
            idx = torch.tensor(batch)
            losses.append(learner.observe(train.images[idx], train.targets[idx]))
            if (due := evaluation.after_batch(learner)) is not None:
                acc, per_class = due["running"]
                anytime.append({"at": evaluation.next_eval - eval_period, "samples_seen": learner.samples_seen,
                                "accuracy": acc, "per_class": per_class})
        if learner.exposed:
            acc, per_class = evaluation.end_of_task(learner)["running"]
            end_of_task.append({"samples_seen": learner.samples_seen, "accuracy": acc, "per_class": per_class})
    final = predict_cached(learner, test_feats)
    run = {**evaluation.curves["running"].summary(), "anytime": anytime, "end_of_task": end_of_task,
           "per_class_end": end_of_task[-1]["per_class"],
           "prediction_share": {c: (final == c).float().mean().item() for c in range(learner.n_classes)}}
    if learner.trains_by_gradient:  # a learner without gradient steps reports 0 for every batch
        run.update(losses=losses, zero_loss_batches=sum(loss == 0.0 for loss in losses))
    return run


def by_label(values: torch.Tensor, exposed: list[int]) -> dict[int, float]:
    """Head-order values [C] keyed by original label (outputs no class was mapped to are left out)."""
    return {y: float(values[k]) for k, y in enumerate(exposed)}


def head_report(learner: OnlineLearner, feats: torch.Tensor, tracker: HeadTracker) -> dict:
    """The trained head against the features: shared logit part vs the discriminative part, and Adam's moves."""
    w, b = learner.method.head.weight.detach().cpu(), learner.method.head.bias.detach().cpu()  # [C, D], [C]
    mu = feats.mean(0)  # [D]
    shared = w @ mu + b  # [C], the same for every image
    disc_std = ((feats - mu) @ w.T).std(0)  # [C], how much the image moves each logit
    steps, weight_steps = torch.cat(tracker.step_changes), torch.cat(tracker.weight_steps)
    exposed = learner.exposed
    return {
        "weight_norm": by_label(w.norm(dim=1), exposed), "bias": by_label(b, exposed),
        "shared_logit": by_label(shared, exposed), "discriminative_std": by_label(disc_std, exposed),
        "shared_logit_range": float(shared.max() - shared.min()), "shared_logit_std": float(shared.std()),
        "discriminative_std_min_mean_max": [float(disc_std.min()), float(disc_std.mean()), float(disc_std.max())],
        "shared_winner": exposed[int(shared.argmax())],
        "adam_steps": len(tracker.step_changes),
        "zero_grad_moving_steps": by_label(tracker.zero_grad_moves, exposed),
        "shared_drift_from_zero_grad_steps": by_label(tracker.drift_zero_grad, exposed),
        "shared_drift_from_gradient_steps": by_label(tracker.drift_gradient, exposed),
        "shared_change_per_step_median": float(steps.median()), "shared_change_per_step_max": float(steps.max()),
        "weight_change_per_step_median": float(weight_steps.median()),
        "weight_rms_end": float(w.pow(2).mean().sqrt()),
    }


def pair_cosines(feats: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Mean cosine over all pairs of test images of different / the same class, raw and centred."""
    same = targets[:, None] == targets[None, :]  # [N, N]
    off_diag = ~torch.eye(len(targets), dtype=torch.bool)
    out = {}
    for name, x in (("raw", feats), ("centred", feats - feats.mean(0))):
        x = F.normalize(x, dim=1)
        cos = x @ x.T  # [N, N]
        out[f"different_class_{name}"] = float(cos[~same].mean())
        out[f"same_class_{name}"] = float(cos[same & off_diag].mean())
    return out


def feature_scale(feats: torch.Tensor, targets: torch.Tensor) -> dict:
    """How much of the feature is one shared direction."""
    mu = feats.mean(0)  # [D]
    return {"mean_norm": float(mu.norm()), "mean_dim_std": float(feats.std(0).mean()),
            "feature_norm_mean": float(feats.norm(dim=1).mean()),
            "mean_share_of_energy": float(mu.pow(2).sum() / feats.pow(2).sum(1).mean()),
            "mean_l1": float(mu.abs().sum()), **pair_cosines(feats, targets)}


def adam_scale(lr: float, feats: torch.Tensor, head: dict) -> dict:
    """Adam moves every coordinate by about ``lr`` per step whatever the gradient's size: compare that with
    the head's weights and with the logit change it buys through ``mu``."""
    mean_l1 = feature_scale(feats, torch.zeros(len(feats)))["mean_l1"]
    return {"lr": lr, "init_weight_std": 0.02, "lr_over_init_weight_std": lr / 0.02,
            "lr_over_final_weight_rms": lr / head["weight_rms_end"],
            "shared_change_if_every_weight_moves_lr": lr * mean_l1,
            "measured_shared_change_per_step_median": head["shared_change_per_step_median"],
            "measured_weight_change_per_step_median": head["weight_change_per_step_median"],
            "discriminative_std_mean": head["discriminative_std_min_mean_max"][1]}


def ncm_accuracy(train_feats: torch.Tensor, train_targets: torch.Tensor, test_feats: torch.Tensor,
                 test_targets: torch.Tensor, n_classes: int) -> dict[str, float]:
    """Nearest class mean by cosine: the product's (features centred by the training mean) and raw."""
    ncm = NearestClassMean(train_feats.shape[1], n_classes)
    ncm.update(train_feats, train_targets)
    raw = F.normalize(test_feats, dim=1) @ F.normalize(ncm.means().float(), dim=1).T  # [N, C]
    return {"centred": float((ncm(test_feats).argmax(1) == test_targets).float().mean()),
            "raw": float((raw.argmax(1) == test_targets).float().mean())}


def prompt_report(backbone: BackboneConfig, seed: int, train: ImageSet, test: ImageSet,
                  plain: dict[str, torch.Tensor], dev: torch.device) -> dict:
    """MISA's CLS feature with its random uniform(-1, 1) prompts against the plain backbone's, same images."""
    misa = create_model(ModelConfig("misa", backbone=backbone, seed=seed), len(train.classes), dev)
    prompted = {split: features(misa, images.images)
                for split, images in (("train", train), ("test", test))}
    p, q = prompted["test"], plain["test"]  # [N, D]
    cosine, n = F.cosine_similarity(p, q, dim=1), len(train.classes)
    return {
        "cosine_to_plain_mean": float(cosine.mean()), "cosine_to_plain_min": float(cosine.min()),
        "relative_change_norm": float(((p - q).norm(dim=1) / q.norm(dim=1)).mean()),
        "norm_ratio": float((p.norm(dim=1) / q.norm(dim=1)).mean()),
        "ncm_accuracy_plain": ncm_accuracy(plain["train"], train.targets, q, test.targets, n),
        "ncm_accuracy_prompted": ncm_accuracy(prompted["train"], train.targets, p, test.targets, n),
        "feature_scale_prompted": feature_scale(p, test.targets),
    }


def plot(runs: dict[str, dict], class_names: list[str], path: Path) -> None:
    """Per-class accuracy over the stream (any-time and end-of-task evaluations), one panel per learner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.2), sharey=True)
    for ax, (name, run) in zip(axes, runs.items(), strict=True):
        points = sorted([*run["anytime"], *run["end_of_task"]], key=lambda p: p["samples_seen"])
        x = [p["samples_seen"] for p in points]
        for c, label in enumerate(class_names):
            ax.plot(x, [100 * p["per_class"].get(c, float("nan")) for p in points], marker="o", ms=3, lw=1,
                    color=plt.cm.tab10(c % 10), label=label)
        ax.plot(x, [100 * p["accuracy"] for p in points], color="black", lw=2.5, label="all seen classes")
        ax.set(title=f"{name}: {TITLES[name]} (A_last {100 * run['A_last']:.1f} %)", xlabel="samples seen")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy of each seen class (%)")
    axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def learn(name: str, backbone: BackboneConfig, train: ImageSet, test: ImageSet, tasks: list[list[int]],
          plain: dict[str, torch.Tensor], cfg: LearnerConfig, seed: int, eval_period: int) -> dict:
    """One learner over the stream; the paper recipe's head is watched and reported, LDA's shrinkage too."""
    start, method = time.time(), LEARNERS[name][0]
    model = create_model(ModelConfig(method, backbone=backbone, learner=cfg, seed=seed), len(train.classes), device())
    learner = OnlineLearner(model, cfg)
    linear = cfg.classifier == "linear"
    tracker = HeadTracker(learner.method.head, learner.optimizer, plain["test"].mean(0)) if linear else None
    run = {"method": method, **run_stream(learner, train, tasks, test, plain["test"], eval_period)}
    if linear:
        run["head"] = head_report(learner, plain["test"], tracker)
    if cfg.classifier == "slda":
        lda = learner.method.classifier
        run["slda_shrinkage_chosen"] = float(lda.shrinkage[lda.chosen])
    return {**run, "wall_time_s": round(time.time() - start, 1)}


def main(data: DataConfig = DataConfig("cifar10", train_per_class=100, test_per_class=50),
         backbone: BackboneConfig = BackboneConfig(img_size=84), stream: SiBlurryConfig = SiBlurryConfig(),
         autoaugment: str | None = "cifar10", eval_period: int = 250, threads: int = 2,
         out: Path = Path("benchmarks/results/learning_diagnosis.json"),
         plot_path: Path | None = Path("benchmarks/results/learning_diagnosis.png")) -> dict:
    """Run the stream once per learner, measure the candidate causes, write the JSON (and the plot).

    Args:
        data: Downstream dataset slice.
        backbone: Frozen backbone.
        stream: Si-Blurry stream (its seed also seeds the models and the augmentation).
        autoaugment: AutoAugment policy of both learners' training augmentation (only the paper recipe trains
            on augmented images; LDA learns the un-augmented batch).
        eval_period: Any-time evaluation every this many samples.
        threads: torch CPU threads.
        out: JSON result path.
        plot_path: PNG of per-class accuracy over the stream (null: no plot).
    """
    torch.set_num_threads(threads)
    start, dev = time.time(), device()
    train, test = load_split(data, "train"), load_split(data, "test")
    n_classes = len(train.classes)
    frozen = create_model(ModelConfig("frozen", backbone=backbone), n_classes, dev)
    plain = {split: features(frozen, images.images)  # [N, D], reused wherever frozen
             for split, images in (("train", train), ("test", test))}
    tasks = si_blurry_stream(train.targets.tolist(), stream.n_tasks, stream.n, stream.m, stream.seed).tasks
    cfgs = {name: replace(cfg, autoaugment=autoaugment) for name, (_, cfg) in LEARNERS.items()}
    runs = {name: learn(name, backbone, train, test, tasks, plain, cfg, stream.seed, eval_period)
            for name, cfg in cfgs.items()}
    batches = stream_batches(tasks, cfgs["paper_recipe"].batch_size, eval_period)
    single = count_single_class(batches, train.targets)
    result = {
        "benchmark": "learning_diagnosis",
        "config": {"data": asdict(data), "backbone": asdict(backbone), "stream": asdict(stream),
                   "eval_period": eval_period, "learners": {n: asdict(c) for n, c in cfgs.items()}},
        "classes": train.classes,
        "stream": {"length": sum(map(len, tasks)), "task_lengths": list(map(len, tasks)), "batches": len(batches),
                   "single_class_batches": single, "single_class_share": single / len(batches),
                   "per_class": class_exposure(batches, train.targets, n_classes)},
        "runs": runs,
        "features": feature_scale(plain["test"], test.targets),
        "adam": adam_scale(cfgs["paper_recipe"].lr, plain["test"], runs["paper_recipe"]["head"]),
        "prompt_init": prompt_report(backbone, stream.seed, train, test, plain, dev),
        "wall_time_s": round(time.time() - start, 1),
    }
    if plot_path is not None:
        plot(runs, train.classes, plot_path)
    return write_result(result, out, dev, frozen.dtype)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
