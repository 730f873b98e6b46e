"""``mepo isa``: MISA's initial session adaptation (ISA), warming a prompt host's prompts into a MePo bundle.

MISA's downstream runs do not start from random prompts: they load g- and e-prompts trained beforehand on
pretraining data (its ``pretrained_prompt/{g,e}_prompt.pt``). This command makes that artifact with the
bundle's own backbone, on the Tiny-ImageNet pretraining half, so it can never have seen a downstream class:

* session: the first ``C - pool_classes`` classes (90 of 100), streamed once as ``n_tasks`` disjoint tasks of
  consecutive classes (MISA's ``--n 101 --m 0 --rnd_NM``: with n > 100 its sampler cuts the classes *in
  order* into equal tasks, with no random split and no blurry samples), ``epochs`` passes over each task
  before the next, ``online_iter`` FAM steps per mini-batch, each on a fresh augmentation;
* out-of-session pool: the last ``pool_classes`` classes. Batches come from ``pool_draw`` random pool classes
  at a time; when their images run out, new classes are drawn with probability ``redraw_prob`` (else the same
  ones again), and the pool images get a second AutoAugment, as in MISA;
* one FAM step (``mepo_stream.fam``): ascent on the pool batch's loss, descent with the session batch's loss
  at the perturbed point, Adam as the base optimizer. Loss = cross-entropy over the classes seen so far
  (unseen logits -inf; no batch mask, MISA's ``--nobatchmask``) + the key-query matching term;
* the e-prompt is chosen by the best-matching key over the whole pool (MISA's ISA branch), so all pool slots
  and keys train; with ``e_proj`` the e-prompts are trained through a residual MLP projector and stored
  projected (MISA's ``--e_proj``; its released ``e_prompt.pt`` is such a projected pool of 10);
* the throwaway linear head covers session and pool classes; only the prompts and keys are kept, as
  ``prompts.safetensors`` (tensor names of the host's ``initial_prompts()``), with the settings, class split,
  loss curve and the backbone's hash under the manifest's ``isa`` key.

Example:
    mepo isa --out runs/isa --backbone.img_size 84 --data.train_per_class 10 --adapt.epochs 1
    mepo isa --mepo runs/refined --backbone.img_size 84      # adds the prompts to an existing bundle
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torchvision.transforms import v2
from tqdm import tqdm

from mepo_stream.artifacts import PROMPTS, BundleError, library_versions, load_part, read_manifest, write_bundle
from mepo_stream.backbone import BackboneConfig, device, normalization, provenance, sized
from mepo_stream.data import DataConfig, ImageSet, load_split
from mepo_stream.fam import FAM
from mepo_stream.learner import LearnerConfig
from mepo_stream.methods import METHODS, MISA, MethodsConfig
from mepo_stream.methods.base import ContinualMethod, PromptHost
from mepo_stream.model import BundleParts, ModelConfig, backbone_config, create_model
from mepo_stream.transforms import AUTOAUGMENT_POLICIES, Transform, train_transform

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ISAConfig:
    """MISA's initial session adaptation (defaults: MISA's ImageNet-900 script unless said otherwise)."""

    pool_classes: int = 10
    """The last N classes are the out-of-session pool, the others the session (MISA: 100 of 1000; here 10 of
    100)."""
    n_tasks: int = 10
    """Disjoint tasks the session is cut into, consecutive classes each (MISA: 10)."""
    epochs: int = 3
    """Passes over each task before the next one (MISA: 3 for ImageNet-900)."""
    online_iter: int = 3
    """FAM steps per session mini-batch, each with a fresh augmentation and pool batch (MISA: 3)."""
    batch_size: int = 32
    """Session and pool mini-batch size (MISA: 32 for Tiny-ImageNet, 65 for ImageNet-900)."""
    lr: float = 5e-3
    """Adam learning rate inside FAM. MISA uses 1e-4 for ImageNet-900 (~18k steps) and 5e-3 for its
    Tiny-ImageNet-sized sessions; 5e-3 moves the uniform(-1, 1) prompts within a few hundred images."""
    rho: float = 0.1
    """FAM radius: the ascent step's length along the pool loss' gradient (MISA: 0.1)."""
    pool_draw: int = 1
    """Pool classes per draw. MISA draws 10 of its 100, but its sampler (n > 100, task 0 only) serves the
    images of just the first, so in effect 1."""
    redraw_prob: float = 0.67
    """Probability of drawing new pool classes when the current ones run out (MISA: 0.67)."""
    e_proj: bool = True
    """Train the e-prompts through a residual MLP projector (D -> D/8 -> LayerNorm -> ReLU -> D) and store
    them projected (MISA: --e_proj)."""
    autoaugment: str | None = "imagenet"
    """AutoAugment policy of the session augmentation (the pool gets it twice); null turns it off."""
    seed: int = 1
    """Seed of the prompt and head initialisation, the task order, the pool draws and the augmentation."""


@dataclass
class ISAResult:
    """Warmed prompts (CPU tensors named as ``initial_prompts()``) and the loss curve, per task and epoch."""

    prompts: dict[str, torch.Tensor]
    history: list[dict]
    steps: int
    session_images: int
    wall_s: float


class ResidualProjector(nn.Module):
    """``p + MLP(p)`` over the last (feature) dim: MISA's e-prompt projector, a reparametrisation for training."""

    def __init__(self, dim: int, factor: int = 8):
        super().__init__()
        hidden = max(dim // factor, 1)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, prompts: torch.Tensor) -> torch.Tensor:
        return prompts + self.mlp(prompts)  # [pool, L, T, D]


def prompt_hosts() -> list[str]:
    return sorted(name for name, (cls, _) in METHODS.items() if isinstance(cls, type) and issubclass(cls, PromptHost))


def build_host(n_classes: int, cfg: ISAConfig, method: str, method_config: MethodsConfig, backbone: BackboneConfig,
               rep: Path | None) -> ContinualMethod:
    """The prompt host ``method`` (seeded by ``cfg.seed``) around the frozen backbone, the bundle's under Meta Rep
    (``rep``), in fp32 and without Meta Cov; with MISA's e-prompt projector when ``cfg.e_proj``."""
    if method not in prompt_hosts():
        raise ValueError(f"--method {method!r} is not a prompt-based host: ISA warms the prompts of "
                         f"{', '.join(prompt_hosts())}")
    model = ModelConfig(method, method_config, backbone, BundleParts(rep=rep),
                        learner=LearnerConfig(classifier="linear", precision="fp32"), seed=cfg.seed)
    host = create_model(model, n_classes, device())
    if cfg.e_proj:  # host.e_prompt.prompts now reads p + MLP(p); the MLP trains along with p
        assert isinstance(host, MISA), "every prompt host is a MISA, with its e-prompt pool"
        projector = ResidualProjector(host.backbone.num_features).to(host.device)
        parametrize.register_parametrization(host.e_prompt, "prompts", projector)
    return host


def class_split(n_classes: int, cfg: ISAConfig) -> tuple[list[list[int]], list[int]]:
    """Session tasks (consecutive classes, as equal as possible) and the pool classes."""
    n_session = n_classes - cfg.pool_classes
    if cfg.pool_classes < 1 or n_session < 1:
        raise ValueError(f"--adapt.pool_classes {cfg.pool_classes} must leave both a session and a pool among the "
                         f"{n_classes} classes")
    if not 1 <= cfg.n_tasks <= n_session:
        raise ValueError(f"--adapt.n_tasks {cfg.n_tasks} must be between 1 and the {n_session} session classes")
    if not 1 <= cfg.pool_draw <= cfg.pool_classes:
        raise ValueError(f"--adapt.pool_draw {cfg.pool_draw} must be between 1 and --adapt.pool_classes")
    tasks = [list(range(t * n_session // cfg.n_tasks, (t + 1) * n_session // cfg.n_tasks)) for t in range(cfg.n_tasks)]
    return tasks, list(range(n_session, n_classes))


def task_order(targets: torch.Tensor, classes: list[int], g: torch.Generator) -> torch.Tensor:
    """The images of ``classes`` in one random order (MISA's sampler shuffles each task once)."""
    idx = torch.isin(targets, torch.tensor(classes)).nonzero().flatten()
    return idx[torch.randperm(len(idx), generator=g)]


class PoolBatches:
    """Out-of-session batches: a few random pool classes at a time, re-drawn (or repeated) when they run out."""

    def __init__(self, targets: torch.Tensor, pool: list[int], cfg: ISAConfig, g: torch.Generator):
        self.pool, self.cfg, self.g = pool, cfg, g
        self.by_class = {c: (targets == c).nonzero().flatten() for c in pool}
        self.classes: list[int] = []
        self.queue = torch.empty(0, dtype=torch.long)

    def next(self, n: int) -> torch.Tensor:
        """Indices of the next pool batch (at most ``n``; the last of a draw may be short, as MISA's loader)."""
        if len(self.queue) == 0:
            if not self.classes or torch.rand((), generator=self.g) < self.cfg.redraw_prob:
                pick = torch.randperm(len(self.pool), generator=self.g)[: self.cfg.pool_draw]
                self.classes = [self.pool[i] for i in pick]
            idx = torch.cat([self.by_class[c] for c in self.classes])
            self.queue = idx[torch.randperm(len(idx), generator=self.g)]
        batch, self.queue = self.queue[:n], self.queue[n:]
        return batch


def isa_loss(host: ContinualMethod, x: torch.Tensor, y: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the seen classes (``seen`` [C] bool) plus the host's key-query term."""
    logits, aux = host(x)  # [B, C]; slot None: the best-matching e-prompt of the whole pool
    return F.cross_entropy(logits.masked_fill(~seen, float("-inf")), y) + aux


@dataclass
class Session:
    """Everything one FAM step needs."""

    host: ContinualMethod
    fam: FAM
    images: ImageSet
    pool: PoolBatches
    tf: Transform
    pool_tf: Transform
    seen: torch.Tensor
    cfg: ISAConfig

    def step(self, idx: torch.Tensor) -> tuple[float, float]:
        """One FAM update on session images ``idx``; returns the session loss (at the perturbed point, as MISA
        reports it) and the pool loss."""
        dev = self.seen.device
        x, y = self.images.images[idx].to(dev), self.images.targets[idx].to(dev)
        p_idx = self.pool.next(self.cfg.batch_size)
        px, py = self.images.images[p_idx].to(dev), self.images.targets[p_idx].to(dev)
        self.seen[y] = True
        self.seen[py] = True
        pool_loss = isa_loss(self.host, self.pool_tf(px), py, self.seen)
        pool_loss.backward()
        self.fam.first_step()
        loss = isa_loss(self.host, self.tf(x), y, self.seen)
        loss.backward()
        self.fam.second_step()
        return loss.item(), pool_loss.item()


def session_for(host: ContinualMethod, images: ImageSet, pool: list[int], cfg: ISAConfig, g: torch.Generator
                ) -> Session:
    dev = next(host.parameters()).device
    img_size, (mean, std) = host.backbone.patch_embed.img_size[0], normalization(host.backbone)
    tf = train_transform(img_size, mean, std, cfg.autoaugment)
    pool_tf = v2.Compose([v2.AutoAugment(AUTOAUGMENT_POLICIES[cfg.autoaugment]), tf]) if cfg.autoaugment else tf
    trainable = [p for p in host.parameters() if p.requires_grad]
    fam = FAM(torch.optim.Adam(trainable, lr=cfg.lr, weight_decay=0.0), cfg.rho)
    seen = torch.zeros(len(images.classes), dtype=torch.bool, device=dev)
    return Session(host, fam, images, PoolBatches(images.targets, pool, cfg, g), tf, pool_tf, seen, cfg)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def warm_prompts(host: ContinualMethod, images: ImageSet, cfg: ISAConfig) -> ISAResult:
    """Run ISA on ``images`` (labels 0..C-1; the last ``cfg.pool_classes`` are the pool) and return the prompts."""
    start, g = time.time(), torch.Generator().manual_seed(cfg.seed)
    tasks, pool = class_split(len(images.classes), cfg)
    orders = [task_order(images.targets, classes, g) for classes in tasks]
    session = session_for(host, images, pool, cfg, g)
    host.train()
    history, steps = [], 0
    total = cfg.epochs * sum(len(o) for o in orders)
    with tqdm(total=total, desc="ISA", unit="img") as bar:
        for t, order in enumerate(orders):
            for epoch in range(1, cfg.epochs + 1):
                losses = [session.step(order[b : b + cfg.batch_size])
                          for b in range(0, len(order), cfg.batch_size) for _ in range(cfg.online_iter)]
                bar.update(len(order))
                steps += len(losses)
                loss, pool_loss = mean([s for s, _ in losses]), mean([p for _, p in losses])
                history.append({"task": t + 1, "epoch": epoch, "loss": round(loss, 4),
                                "pool_loss": round(pool_loss, 4), "steps": len(losses),
                                "classes_seen": int(session.seen.sum())})  # chance loss: ln(classes_seen)
                bar.set_postfix(task=f"{t + 1}/{len(orders)}", loss=f"{loss:.3f}", pool=f"{pool_loss:.3f}")
                log.info("ISA task %d/%d epoch %d: loss %.4f, pool loss %.4f", t + 1, len(orders), epoch, loss,
                         pool_loss)
    assert isinstance(host, PromptHost), "build_host makes prompt hosts only"
    prompts = {k: v.detach().cpu().clone() for k, v in host.initial_prompts().items()}
    return ISAResult(prompts, history, steps, total, time.time() - start)


def check_backbone(bundle: Path, manifest: dict, backbone: BackboneConfig, parts: BundleParts) -> None:
    """Refuse to warm prompts with another backbone than the bundle's (refined, or the one Sigma_pre came from)."""
    made = manifest.get("backbone", {})
    for key in ("name", "img_size"):
        if made.get(key) is not None and made[key] != getattr(backbone, key):
            raise ValueError(f"{bundle} was made with backbone {key} {made[key]!r}, not {getattr(backbone, key)!r}: "
                             f"pass --backbone.{key} {made[key]}")
    theirs, ours = made.get("weights_sha256"), provenance(backbone)["weights_sha256"]
    if parts.rep is None and "weights_sha256" in made and theirs != ours:  # e.g. Sigma_pre of other weights
        raise ValueError(f"{bundle} has no backbone of its own and was made with weights "
                         f"{made.get('weights')!r} (sha256 {str(theirs)[:12]}…), not "
                         f"{backbone.weights!r}: pass the same --backbone.weights")


def carried_parts(bundle: Path, manifest: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The bundle's existing safetensors parts except the prompts, to write back unchanged."""
    files = list(manifest.get("files", {}))
    if other := [f for f in files if not f.endswith(".safetensors")]:
        raise BundleError(f"{bundle}: only safetensors parts can be carried over, found {other}")
    return {n: load_part(bundle, n) for f in files if (n := f.removesuffix(".safetensors")) != PROMPTS}


def isa_record(cfg: ISAConfig, method: str, method_config: MethodsConfig, backbone: BackboneConfig,
               data: DataConfig, images: ImageSet, result: ISAResult) -> dict:
    """What the manifest's ``isa`` key records: settings, host and its layout, backbone hash, data, class split,
    curve."""
    tasks, pool = class_split(len(images.classes), cfg)
    layout = METHODS[method][1]
    record = {
        "method": method,
        **{f.name: getattr(cfg, f.name) for f in fields(ISAConfig)},
        "layout": asdict(getattr(method_config, layout)) if layout else None,
        "backbone": provenance(backbone),
        "data": {**asdict(data), "n_images": len(images)},
        "session_tasks": [[images.classes[c] for c in task] for task in tasks],
        "pool_classes_names": [images.classes[c] for c in pool],
        "shapes": {k: list(v.shape) for k, v in result.prompts.items()},
        "history": result.history,
        "steps": result.steps,
        "session_images_per_s": round(result.session_images / result.wall_s, 2) if result.wall_s else None,
        "wall_time_s": round(result.wall_s, 1),
    }
    return json.loads(json.dumps(record, default=str))  # Paths and tuples as JSON has them


def add_prompts(out: Path, bundle: Path | None, backbone: BackboneConfig, data: DataConfig, images: ImageSet,
                method: str, cfg: ISAConfig = ISAConfig(), method_config: MethodsConfig = MethodsConfig()) -> Path:
    """Warm the prompts of host ``method`` with the bundle's backbone (or ``backbone`` without a bundle) and write
    ``out``: the bundle's parts and manifest keys, plus ``prompts.safetensors`` and the ``isa`` record."""
    manifest = read_manifest(bundle) if bundle is not None else {}
    parts = BundleParts.of(bundle)
    if bundle is not None:
        check_backbone(bundle, manifest, backbone, parts)
    model_cfg = backbone_config(backbone, parts)
    host = build_host(len(images.classes), cfg, method, method_config, backbone, parts.rep)
    result = warm_prompts(host, images, cfg)
    tensors = carried_parts(bundle, manifest) if bundle is not None else {}
    if parts.prompts is not None:
        log.info("replacing the prompts of %s", bundle)
    keep = {k: v for k, v in manifest.items() if k not in ("format", "files")}
    new = {"kind": "isa", "backbone": {**provenance(model_cfg), "arch": model_cfg.name},
           "versions": library_versions()}
    write_bundle(out, {**tensors, PROMPTS: result.prompts},
                 {**(keep or new), "isa": isa_record(cfg, method, method_config, model_cfg, data, images, result)})
    log.info("wrote ISA prompts %s to %s (%d FAM steps, %.0f s)", {k: tuple(v.shape) for k, v in
             result.prompts.items()}, out, result.steps, result.wall_s)
    return out


def isa(
    mepo: Path | None = None,
    out: Path | None = None,
    backbone: BackboneConfig = BackboneConfig(),
    data: DataConfig = DataConfig(dataset="tinyimagenet-pretrain"),
    adapt: ISAConfig = ISAConfig(),
    method: str = "misa",
    method_config: MethodsConfig = MethodsConfig(),
) -> Path:
    """Warm a prompt host's g/e prompts and keys with MISA's initial session adaptation; store them in a bundle.

    Args:
        mepo: MePo bundle to add the prompts to (its backbone is used when it has one; its other parts and
            manifest keys are kept). Without one, a new bundle is written at --out with --backbone.
        out: Where to write the bundle (default: --mepo itself, rewritten atomically).
        backbone: The backbone (its name and img_size must match the bundle's; its weights are replaced by the
            bundle's backbone when it has one).
        data: Pretraining data of the session and the pool (never a downstream class).
        adapt: Initial session adaptation settings.
        method: Prompt-based host whose prompts are warmed (misa, dualprompt, mvp; as for mepo serve).
        method_config: Prompt layout of the host (--method_config.misa.e_pool, ...; as for mepo serve).
    """
    target = out or mepo
    if target is None:
        raise ValueError("pass --mepo (a bundle to add the prompts to) or --out (for a new bundle), or both")
    backbone = sized(backbone, [mepo] if mepo is not None else [])
    images = load_split(data, "train")
    return add_prompts(Path(target), mepo, backbone, data, images, method, adapt, method_config)
