"""Named refine recipes (``mepo refine --preset NAME``): what a refine minute buys, measured.

Why: users pay for refine minutes once and for accuracy on every prediction after, so each preset is a point
on the measured frontier (docs/refine.md, written by ``benchmarks/refine_frontier.py``): its budget and the
downstream accuracy it bought, on the machine that measured it. A preset sets the ``--loop.*`` and ``--tasks.*``
fields it names; an option typed on the command line wins over it, even at its default value.

Example:
    >>> sorted(PRESETS)
    ['balanced', 'best', 'demo', 'paper']
    >>> PRESETS["paper"].loop["mode"]
    'meta'
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Literal, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

PresetName = Literal["demo", "balanced", "best", "paper"]
C = TypeVar("C", bound="DataclassInstance")

# AdamW with layer-wise decay and a cosine schedule, trained at 56 px (served at the bundle's 84 px), every image
# its own crop (half the batches through a lower resolution and back), a cosine training head, one pass over all
# 250 images of each of the 100 pretraining classes per meta-epoch. docs/refine.md has the screening runs behind
# each choice.
FINE_TUNE = {"mode": "finetune", "optimizer": "adamw", "lr_backbone": 1e-4, "lr_head": 1e-3, "layer_decay": 0.75,
             "weight_decay": 0.05, "schedule": "cosine", "warmup": 0.1, "label_smoothing": 0.1, "batch_size": 64,
             "inner_epochs": 1, "train_img_size": 56, "augment": "image", "low_res": 0.5, "head": "cosine"}
ALL_IMAGES = {"samples_per_class": 250}
DEMO_IMAGES = {"samples_per_class": 160}  # 16,000 images a pass: within the old demo refine's wall
DEMO_MINUTES = 2.5
"""The demo's budget: minutes of training, so ``make demo`` takes about the same time on any CPU (docs/refine.md:
what it buys with bf16 and without)."""
BUDGET = frozenset({"meta_epochs", "steps", "minutes"})
"""The loop's budget fields: a preset sets them only when the user gave none (``--preset demo --loop.steps N``
repeats a demo refine exactly)."""


@dataclass(frozen=True)
class Preset:
    """The refine loop's and pseudo tasks' fields a preset sets."""

    loop: dict = field(default_factory=dict)
    tasks: dict = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "demo": Preset({**FINE_TUNE, "minutes": DEMO_MINUTES}, DEMO_IMAGES),
    "balanced": Preset({**FINE_TUNE, "meta_epochs": 2}, ALL_IMAGES),
    "best": Preset({**FINE_TUNE, "meta_epochs": 4}, ALL_IMAGES),
    "paper": Preset({"mode": "meta", "freeze": (), "reptile_eps": 0.1, "inner_epochs": 4, "lr_backbone": 1e-4,
                     "lr_head": 1e-2, "momentum": 0.9, "batch_size": 256, "mask": "multiply", "head": "mlp"},
                    {}),  # the reference code's Meta Rep (mepo_stream/recipes/refine_paper.yaml)
}


def apply_preset(given: C, values: dict, default: C, typed: frozenset[str] = frozenset(),
                 together: frozenset[str] = frozenset()) -> C:
    """``given`` (a config dataclass) with ``values`` set on every field it leaves at its ``default`` value, except
    the fields in ``typed`` (typed on the command line: ``--preset paper --loop.mode finetune`` keeps finetune,
    though it is the field's default). The fields ``together`` (the budget: ``BUDGET``) go as one: when the user
    gave any of them, the preset sets none.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass(frozen=True)
        ... class Loop:
        ...     lr: float = 1.0
        ...     epochs: int = 1
        >>> apply_preset(Loop(epochs=3), {"lr": 0.5, "epochs": 2}, Loop())
        Loop(lr=0.5, epochs=3)
        >>> apply_preset(Loop(), {"lr": 0.5, "epochs": 2}, Loop(), typed=frozenset({"lr"}))
        Loop(lr=1.0, epochs=2)
        >>> budget = frozenset({"lr", "epochs"})
        >>> apply_preset(Loop(), {"lr": 0.5, "epochs": 2}, Loop(), typed=frozenset({"lr"}), together=budget)
        Loop(lr=1.0, epochs=1)
    """
    unknown = set(values) - {f.name for f in fields(given)}
    if unknown:
        raise ValueError(f"preset sets unknown fields {sorted(unknown)}")
    keep = typed | {f.name for f in fields(given) if getattr(given, f.name) != getattr(default, f.name)}
    if keep & together:
        keep |= together
    return replace(given, **{k: v for k, v in values.items() if k not in keep})
