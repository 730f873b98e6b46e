"""The reference's side, read at run time from ``--reference`` (a checkout of SunGL001/MePo): the stubs and
source patches that let it run on a CPU without its data (each listed in the result), its host and its refine."""

from __future__ import annotations

import contextlib
import copy
import importlib
import sys
import tempfile
import traceback
import types
from collections.abc import Iterator
from pathlib import Path

import timm
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from benchmarks.experiments.equivalence.recording import (
    StepCallback,
    Trained,
    adam_settings,
    forward_hook,
    step_recorder,
)
from benchmarks.experiments.equivalence.settings import Settings, Tensors
from benchmarks.experiments.equivalence.shared_state import SharedState


class _NoMemory:
    """The trainer's episodic memory at memory_size 0 (the paper's rehearsal-free setting): always empty."""

    def __len__(self) -> int:
        return 0

    def add_new_class(self, cls_list) -> None:
        pass


class _NoWriter:
    """tensorboard's SummaryWriter, which the reference creates at import and never needs here."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


HOST_STUBS = {
    "torch.utils.tensorboard": "tensorboard is not installed; SummaryWriter (created at import, unused) is a no-op",
    "methods._trainer": "MePo ships methods/_trainer.py only as a .pyc: _Trainer is an empty base class (its "
                        "__init__ builds data loaders and is never called here; the step methods used are MePo's own)",
    "sklearn.manifold": "scikit-learn is not installed; TSNE (imported for plots, unused) is a placeholder",
    "pandas": "pandas is not installed; imported, unused",
}


@contextlib.contextmanager
def timm_registry_kept() -> Iterator[None]:
    """Within, the reference may (re)register timm models (its ``vit_base_patch16_224`` is its own ViT); after,
    timm's registry is what it was, so that our side keeps building timm's own ViT."""
    registry = importlib.import_module("timm.models._registry")
    saved = {k: copy.copy(v) for k, v in vars(registry).items() if k.startswith("_") and isinstance(v, (dict, set))}
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(registry, k, v)


@contextlib.contextmanager
def no_download() -> Iterator[None]:
    """Within: ``timm.create_model(..., pretrained=True)`` builds the architecture without fetching weights."""
    real = timm.create_model

    def create(name, pretrained=False, **kwargs):
        return real(name, pretrained=False, **kwargs)

    timm.create_model = create
    try:
        yield
    finally:
        timm.create_model = real


def import_reference_gcl(gcl: Path) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """MePo's ``models.dualprompt``, ``utils.train_utils`` and ``methods.dualprompt``, imported from ``gcl`` with
    the ``HOST_STUBS`` in place."""
    if str(gcl) not in sys.path:
        sys.path.insert(0, str(gcl))
    sys.modules.setdefault("torch.utils.tensorboard", _stub("torch.utils.tensorboard", SummaryWriter=_NoWriter))
    sys.modules.setdefault("methods._trainer", _stub("methods._trainer", _Trainer=type("_Trainer", (), {})))
    sys.modules.setdefault("sklearn", _stub("sklearn"))
    sys.modules.setdefault("sklearn.manifold", _stub("sklearn.manifold", TSNE=object))
    sys.modules.setdefault("pandas", _stub("pandas"))
    names = ("models.dualprompt", "utils.train_utils", "methods.dualprompt")
    return tuple(importlib.import_module(n) for n in names)


def to_reference_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """Our prompt layout [pool, layers, tokens, D] as the reference stores it, [pool, layers * tokens, D]."""
    return t.flatten(1, 2) if name in ("g_prompt", "e_prompt") else t


REF_PARAMS = {"g_prompt.prompts": "g_prompt", "e_prompt.prompts": "e_prompt", "e_prompt.key": "e_keys",
              "backbone.fc.weight": "head.weight", "backbone.fc.bias": "head.bias"}


class ReferenceHost:
    """MePo's MISA + Meta Cov (``GCL/models/dualprompt.py``) and its trainer step (``GCL/methods/dualprompt.py``:
    ``online_step`` -> ``online_train`` -> ``model_forward``), built by its own ``select_model``."""

    def __init__(self, reference: Path, state: SharedState, settings: Settings):
        self.state, self.settings = state, settings
        with timm_registry_kept():
            self.models, self.train_utils, self.methods = import_reference_gcl(reference / "GCL")
            with no_download():
                kwargs = {"memory_size": 0, "cor_coef": settings.alpha}
                self.model = self.train_utils.select_model("DualPrompt", "cifar10", settings.n_classes, None, kwargs)
        self._set_meta_cov(state.sigma_pre, settings.alpha)
        self.initial = self._initial_state()
        self.reset()

    def _set_meta_cov(self, sigma_pre: torch.Tensor, alpha: float) -> None:
        """What the constructor does with ``--cor_path --pretrain_cor`` (np.load, float32), minus its move to
        'cuda' (patch: set after construction, on the CPU)."""
        self.model.cor_path, self.model.cor_coef = "<harness Sigma_pre>", alpha
        self.model.cov_matrix_tensor = torch.from_numpy(sigma_pre.numpy()).to(torch.float32)

    def _initial_state(self) -> Tensors:
        s = self.state
        state = {f"backbone.{k}": v for k, v in s.backbone.items()}
        state |= {"backbone.fc.weight": s.head["weight"], "backbone.fc.bias": s.head["bias"],
                  "g_prompt.prompts": to_reference_layout("g_prompt", s.g_prompt),
                  "e_prompt.prompts": to_reference_layout("e_prompt", s.e_prompt), "e_prompt.key": s.e_keys}
        return state

    def reset(self) -> None:
        missing, unexpected = self.model.load_state_dict(self.initial, strict=False)
        buffers = {"pos_g_prompt", "pos_e_prompt", "similarity", "g_prompt.frequency", "g_prompt.counter",
                   "e_prompt.frequency", "e_prompt.counter"}
        if unexpected or set(missing) - buffers:
            raise ValueError(f"the reference model does not take the shared state: {missing[:6]} {unexpected[:6]}")
        self.model.task_id = 0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, train: bool, task: int) -> Tensors:
        """Its forward (``model.task_id = task`` in training), with hooks reading the query, the selected prompts,
        the prompted CLS and the aligned CLS."""
        self.reset()
        self.model.train(train)
        self.model.task_id = task
        prompts, norms = [], []
        with forward_hook(self.model.e_prompt, prompts), forward_hook(self.model.backbone.norm, norms):
            logits, aligned = self.model(x, return_feat=True)
        (query, *_), (_, selection) = prompts[0]
        return {"query": query, "index": self._selected(selection), "cls": norms[1][1][:, 0], "aligned": aligned,
                "logits": logits, "key_loss": self.model.lambd * self.model.similarity}

    def _selected(self, selection: torch.Tensor) -> torch.Tensor:
        """The pool entry each sample's selected prompts [B, 1, L, D] are, read back from the prompts."""
        pool = self.model.e_prompt.prompts  # [pool, L, D]
        gap = (selection[:, 0, None] - pool[None]).abs().flatten(2).amax(2)  # [B, pool]
        if not bool((gap.amin(1) == 0).all()):
            raise AssertionError("a selected prompt is no entry of the pool")
        return gap.argmin(1)

    def recoloured(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Its ``transform_to_target_covariance`` (centre, L_B^-1 L_pre) in ``dtype``."""
        sigma = self.model.cov_matrix_tensor if dtype == torch.float32 else self.state.sigma_pre.to(dtype)
        return self.models.transform_to_target_covariance(h.to(dtype), sigma)

    @torch.no_grad()
    def aligned(self, h: torch.Tensor) -> torch.Tensor:
        """Its forward's alignment of ``h`` [B, D]: ``h`` replaces the prompted CLS (a hook on the final norm's
        second call), so the aligned feature comes out of the reference's own lines."""
        self.reset()
        self.model.eval()
        calls = []

        def inject(module, args, out):
            calls.append(None)
            if len(calls) == 2:  # the prompted pass; the first is the query's
                out = out.clone()
                out[:, 0] = h
            return out

        handle = self.model.backbone.norm.register_forward_hook(inject)
        try:
            _, aligned = self.model(self.state.transform(self.state.images[: len(h)]), return_feat=True)
        finally:
            handle.remove()
        return aligned

    def train_step(self, online_iter: int) -> Trained:
        """Its ``online_step`` on the mini-batch: ``online_iter`` x (remap labels, batch mask, forward, loss,
        backward, Adam step, scheduler step), from the initial state."""
        self.reset()
        trainer = self._trainer(online_iter)
        names = {id(p): REF_PARAMS[n] for n, p in self.model.named_parameters() if p.requires_grad}
        grads: list[Tensors] = []
        layout = lambda n, t: t.view_as(self.state.g_prompt if n == "g_prompt" else self.state.e_prompt) \
            if n in ("g_prompt", "e_prompt") else t  # noqa: E731
        params = lambda: {REF_PARAMS[n]: layout(REF_PARAMS[n], p.detach().clone())  # noqa: E731
                          for n, p in self.model.named_parameters() if p.requires_grad}
        start = params()
        with step_recorder(trainer.optimizer, names, grads, layout):
            loss, _ = trainer.online_step(self.state.images.clone(), self.state.labels.clone(), None)
        return Trained(loss, start, grads, params(), adam_settings(trainer.optimizer))

    def _trainer(self, online_iter: int):
        """MePo's DualPrompt trainer without its ``_Trainer.__init__`` (which loads datasets): the attributes its
        step reads, set as that constructor and the scripts would (Adam, default scheduler, no AMP, no memory)."""
        trainer = object.__new__(self.methods.DualPrompt)
        n = self.settings.n_classes
        trainer.__dict__.update(
            model=self.model, memory=_NoMemory(), exposed_classes=[], mask=torch.zeros(n) - torch.inf,
            distributed=False, sessionmask=False, nobatchmask=False, sched_name="default", memory_batchsize=0,
            memory_size=0, online_iter=online_iter, temp_batchsize=self.settings.batch_size, world_size=1,
            device=torch.device("cpu"), train_transform=self.state.transform, topk=1, use_amp=False,
            scaler=torch.amp.GradScaler("cpu", enabled=False), criterion=self.model.loss_fn)
        trainer.optimizer = self.train_utils.select_optimizer("adam", self.settings.lr, self.model)
        trainer.scheduler = self.train_utils.select_scheduler("default", trainer.optimizer)
        return trainer


def our_name(reference_name: str) -> str:
    """``module.vit.X`` / ``module.head.X`` (the reference's DataParallel-wrapped metaViT) -> ``backbone.X`` /
    ``head.X``."""
    name = reference_name.removeprefix("module.")
    return "backbone." + name.removeprefix("vit.") if name.startswith("vit.") else name


class _StubDataManager:
    """The reference's ``utils.data_manager.DataManager`` over the harness's images: ``_class_order`` and
    ``get_dataset(indices, source, mode)`` with its semantics (``indices`` are positions in the class order; the
    labels it returns are positions too), 'train' mode from the pseudo-task images, 'test' mode from the joint
    ones, both already through the shared (augmentation-free) transform. It records what it served."""

    def __init__(self, state: SharedState, served: list):
        self._class_order = list(state.plan.classes)
        task_samples = {i for task in state.plan.tasks for i in task}
        x = state.transform(state.refine.images)  # [N, 3, S, S]
        self._pools = {mode: [(i, x[i], self._class_order.index(int(state.refine.targets[i])))
                              for i in range(len(x)) if (i in task_samples) == (mode == "train")]
                       for mode in ("train", "test")}
        self._served = served

    def get_dataset(self, indices, source, mode):
        items = [item for item in self._pools[mode] if item[2] in set(int(i) for i in indices)]
        self._served.append((mode, sorted(i for i, _, _ in items)))
        return items


REFINE_PATCHES = [
    ("from utils.data_manager import DataManager", "",
     "DataManager is the harness's stub (_StubDataManager): the shared images, no ImageNet, no augmentation"),
    ("import wandb", "", "wandb is a no-op stub (the script logs to it unconditionally)"),
    ("if torch.cuda.device_count() > 1:", "if True:",
     "the model is always wrapped in nn.DataParallel (a pass-through on the CPU): the script reads model.module, "
     "which exists only under DataParallel (it crashes on one GPU as shipped)"),
    ('save_path=f"/data/meta_vit2"', "save_path=HARNESS_TMP",
     "checkpoints go to a temporary folder (and torch.save is a no-op during the run)"),
]


REFINE_RUNTIME_PATCHES = [
    "sys.argv: -inner_lr EPS -num_tasks T -num_inner_steps 1 -batch_size 256 -samples N -epochs 1 -model sup",
    "timm.create_model('vit_base_patch16_224_in21k', checkpoint_path=ViT-B_16.npz) builds the architecture "
    "(timm's vit_base_patch16_224) without the npz; nn.DataParallel loads the shared initial state (backbone and "
    "meta head) into the wrapped model",
    "the run ends at the second group (the stub has one group's classes: class_mask[1] raises IndexError), "
    "after the first Reptile update",
]


def patched_refine_source(script: Path, tmp: Path) -> str:
    """The script's text with ``REFINE_PATCHES`` applied, each exactly once."""
    text = script.read_text()
    for old, new, _ in REFINE_PATCHES:
        if text.count(old) != 1:
            raise ValueError(f"{script}: expected one {old!r}, found {text.count(old)}: another reference version?")
        text = text.replace(old, new.replace("HARNESS_TMP", repr(str(tmp))))
    return text


class ReferenceRefine:
    """SunGL001/MePo's ``meta_post_training.py`` run (patched at run time) for its first group: one outer step."""

    def __init__(self, reference: Path, state: SharedState, settings: Settings, initial: Tensors):
        self.script, self.state, self.settings = reference / "meta_post_training.py", state, settings
        self.initial = initial
        self.served: list = []

    def _argv(self) -> list[str]:
        s = self.settings
        return [str(self.script), "-inner_lr", str(s.reptile_eps), "-num_tasks", str(s.refine_tasks),
                "-num_inner_steps", "1", "-batch_size", "256", "-samples", str(s.refine_train_per_class),
                "-epochs", "1", "-model", "sup"]

    def outer_step(self, on_step: StepCallback) -> Tensors:
        wrapped: list[torch.nn.Module] = []
        hook = register_optimizer_step_post_hook(
            lambda *_: on_step({our_name(k): v for k, v in wrapped[0].state_dict().items()}))
        try:
            with tempfile.TemporaryDirectory() as tmp, self._patched(wrapped):
                self._run(patched_refine_source(self.script, Path(tmp)))
        finally:
            hook.remove()
        self._check_served()
        return {our_name(k): v.detach().clone() for k, v in wrapped[0].state_dict().items()}

    def _run(self, source: str) -> None:
        scope = {"__name__": "__main__", "__file__": str(self.script), "wandb": _wandb_stub(),
                 "DataManager": lambda *a, **k: _StubDataManager(self.state, self.served)}
        try:
            exec(compile(source, str(self.script), "exec"), scope)
        except IndexError:
            frame = traceback.extract_tb(sys.exc_info()[2])[-1]
            if "class_mask[task_id]" not in (frame.line or ""):
                raise
            return
        raise AssertionError("the reference refine ran past its first group")

    @contextlib.contextmanager
    def _patched(self, wrapped: list) -> Iterator[None]:
        """timm.create_model, nn.DataParallel, torch.save and sys.argv for the run (``REFINE_RUNTIME_PATCHES``)."""
        initial, backbone = self.initial, self.settings.backbone
        real_create = timm.create_model

        class SharedStateDataParallel(torch.nn.DataParallel):
            def __init__(self, module, *args, **kwargs):
                state = {k.replace("backbone.", "vit.", 1): v for k, v in initial.items()}
                module.load_state_dict(state, strict=True)
                super().__init__(module, *args, **kwargs)
                wrapped.append(self)

        saved = (torch.nn.DataParallel, torch.save, sys.argv)
        timm.create_model = lambda name, **kwargs: real_create(backbone, pretrained=False)
        torch.nn.DataParallel, torch.save, sys.argv = SharedStateDataParallel, lambda *a, **k: None, self._argv()
        try:
            yield
        finally:
            timm.create_model = real_create
            torch.nn.DataParallel, torch.save, sys.argv = saved

    def _check_served(self) -> None:
        """What the stub served must be our plan: the joint set, then each pseudo task's samples."""
        plan = self.state.plan
        expected = [("test", sorted(plan.joint))] + [("train", sorted(t)) for t in plan.tasks]
        if self.served != expected:
            raise AssertionError(f"the reference trained on other samples than our plan: {self.served} != {expected}")


def _wandb_stub() -> types.ModuleType:
    run = types.SimpleNamespace(get_url=lambda: "(no wandb)")
    return _stub("wandb", init=lambda *a, **k: run, log=lambda *a, **k: None, finish=lambda: None, run=run)


def reference_patches() -> list[str]:
    """Every run-time patch of the reference, in words."""
    host = [f"{name}: {why}" for name, why in HOST_STUBS.items()]
    host += ["models.dualprompt.DualPrompt: built by utils.train_utils.select_model with timm.create_model(..., "
             "pretrained=False) (no download); the shared state loaded into it afterwards",
             "Sigma_pre: set on the CPU after construction (cov_matrix_tensor = float32 of the shared Sigma_pre, "
             "cor_coef = alpha), as --cor_path/--pretrain_cor would, without the constructor's .to('cuda')",
             "trainer: methods.dualprompt.DualPrompt without _Trainer.__init__; its step's attributes set as "
             "the scripts run it (Adam via select_optimizer, 'default' scheduler via select_scheduler, AMP off, "
             "memory_size 0, batch mask on, the shared transform as train_transform)"]
    refine = [f"meta_post_training.py: {old!r} -> {new!r}: {why}" for old, new, why in REFINE_PATCHES]
    return host + refine + [f"meta_post_training.py: {p}" for p in REFINE_RUNTIME_PATCHES]
