"""Named refine recipes (``mepo refine --preset NAME``): what a refine minute buys, measured.

Why: users pay for refine minutes once and for accuracy on every prediction after, so each preset is a point
on the measured frontier (docs/refine.md, written by ``benchmarks/experiments/refine_frontier.py``): its budget and
the downstream accuracy it bought, on the machine that measured it. Each preset's values live in its recipe files,
``mepo_stream/recipes/refine_<name>.yaml``, and nowhere else. A preset sets the ``--loop.*`` and ``--tasks.*``
fields its caller did not give (``mepo_stream.recipes.layer``): what a caller passed, or typed on the command line,
wins, even at its default value. ``refine(preset=...)`` from Python and ``mepo refine --preset`` agree.

Example:
    >>> sorted(PRESETS)
    ['balanced', 'best', 'demo', 'paper']
    >>> recipe("demo")["loop"]["minutes"], "meta_epochs" in recipe("demo")["loop"]
    (2.5, False)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from mepo_stream.recipes import given, layer, load

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)
PresetName = Literal["demo", "balanced", "best", "paper"]
L = TypeVar("L", bound="DataclassInstance")
P = TypeVar("P", bound="DataclassInstance")

PRESETS: dict[str, tuple[str, ...]] = {
    "best": ("refine_best",),
    "balanced": ("refine_best", "refine_balanced"),
    "demo": ("refine_best", "refine_demo"),
    "paper": ("refine_paper",),
}
"""Each preset's recipe files, a later one layered over the earlier (balanced, demo: best's recipe, less of it)."""
BUDGET = frozenset({"meta_epochs", "steps", "minutes"})
"""The loop's budget fields, which go as one: a budget given replaces the preset's whole budget
(``--preset demo --loop.steps N`` repeats a demo refine exactly; ``--loop.meta_epochs 2`` drops its minutes)."""


def recipe(name: str) -> dict[str, dict[str, Any]]:
    """Preset ``name``'s ``loop`` and ``tasks`` values, its files merged (a later file's budget replaces the
    earlier ones')."""
    merged: dict[str, dict[str, Any]] = {"loop": {}, "tasks": {}}
    for file in PRESETS[name]:
        for group, values in load(file).items():
            if group == "loop" and BUDGET & values.keys():
                merged["loop"] = {k: v for k, v in merged["loop"].items() if k not in BUDGET}
            merged[group] = {**merged[group], **values}
    return merged


def apply_preset(name: str, loop: L, tasks: P) -> tuple[L, P]:
    """The refine's ``loop`` and ``tasks`` with preset ``name`` layered under the fields their caller gave."""
    values = recipe(name)
    for group, config in (("loop", loop), ("tasks", tasks)):
        if values[group] and given(config) >= values[group].keys():
            log.warning("--preset %s sets nothing of --%s: every field it sets was given (a config made by "
                        "dataclasses.replace gives all its fields; pass only yours to its constructor)", name, group)
    return layer(loop, values["loop"], BUDGET), layer(tasks, values["tasks"])
