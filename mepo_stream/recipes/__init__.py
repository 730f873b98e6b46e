"""Named recipes: YAML files that set some fields of config dataclasses, each the one source of its recipe.

A recipe is layered under what its caller gave, so a recipe is a starting point, never a trap: the fields a caller
passed to a config's constructor, or typed on the command line, win even at their default value; the recipe sets
the others. To tell the two apart, configs that recipes layer under record the fields their caller gave (as
pydantic's ``model_fields_set``; ``tracks_given``). The command line marks what was typed the same way
(``mark_given``), so a recipe means the same from Python and from ``mepo``.

Example:
    >>> from dataclasses import dataclass
    >>> @tracks_given
    ... @dataclass(frozen=True)
    ... class Loop:
    ...     lr: float = 1.0
    ...     epochs: int = 1
    >>> sorted(given(Loop(epochs=1)))
    ['epochs']
    >>> layer(Loop(epochs=1), {"lr": 0.5, "epochs": 2})
    Loop(lr=0.5, epochs=1)
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

RECIPES = Path(__file__).parent
"""The folder of the named recipes (``<name>.yaml``), shipped inside the package."""
C = TypeVar("C", bound="DataclassInstance")
T = TypeVar("T", bound=type)
GIVEN = "_given_fields"


def load(name: str) -> dict[str, Any]:
    """The values of recipe ``name`` (``RECIPES/<name>.yaml``), nested as the options are (``{"loop": {...}}``)."""
    path = RECIPES / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES.glob("*.yaml"))
        raise ValueError(f"no recipe {name!r}; the recipes are {', '.join(known)}")
    return yaml.safe_load(path.read_text()) or {}


def build(cls: Callable[..., C], values: dict[str, Any]) -> C:
    """``cls(**values)``, YAML's lists made the tuples that the config's fields hold (``freeze: []``)."""
    return cls(**as_fields(cls, values))


def as_fields(cls: object, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` for config class ``cls``, each list a tuple where its field holds a tuple."""
    hints = typing.get_type_hints(cls)
    return {k: tuple(v) if isinstance(v, list) and (hints[k] is tuple or typing.get_origin(hints[k]) is tuple)
            else v for k, v in values.items()}


def tracks_given(cls: T) -> T:
    """Class decorator over ``@dataclass``: each instance records the fields passed to its constructor (``given``);
    ``dataclasses.replace`` passes them all, so a config derived from another gives every field."""
    init = cls.__dict__["__init__"]
    names = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        object.__setattr__(self, GIVEN, frozenset(names[: len(args)]) | frozenset(kwargs))

    cls.__init__ = __init__  # type: ignore[misc]  # a dataclass's generated __init__, wrapped
    cls.tracks_given = True  # type: ignore[attr-defined]
    return cls


def given(config: DataclassInstance) -> frozenset[str]:
    """The fields of ``config`` its caller gave: all of them, unless its class ``tracks_given``."""
    return getattr(config, GIVEN, frozenset(f.name for f in dataclasses.fields(config)))


def mark_given(config: C, typed: Iterable[str]) -> C:
    """``config`` (as the command line built it, every field passed) marked with the options typed for it
    (``head`` for ``--loop.head``, ``data.dataset`` for a nested group), so a recipe layers under them alone.
    A group typed whole (``--loop FILE.yaml``) gives every field; a config that does not track what was given is
    left as it is."""
    typed = frozenset(typed)
    if "" in typed or not getattr(config, "tracks_given", False):
        return config
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            object.__setattr__(config, f.name, mark_given(value, typed_under(f.name, typed)))
    object.__setattr__(config, GIVEN, frozenset(t.split(".")[0] for t in typed))
    return config


def typed_under(group: str, typed: Iterable[str]) -> frozenset[str]:
    """The options of ``typed`` (dotted) inside option group ``group``, relative to it; ``""`` where the group
    itself was given whole.

    Example:
        >>> sorted(typed_under("loop", ["loop.head", "loop", "out", "looped"]))
        ['', 'head']
    """
    return frozenset("" if t == group else t.removeprefix(f"{group}.") for t in typed
                     if t == group or t.startswith(f"{group}."))


def layer(config: C, values: dict[str, Any], together: frozenset[str] = frozenset()) -> C:
    """``config`` with ``values`` (a recipe's, for this config) on every field its caller did not give. The fields
    ``together`` go as one: a budget given (``--loop.steps``) drops the recipe's whole budget (its ``minutes``).

    Example:
        >>> from dataclasses import dataclass
        >>> @tracks_given
        ... @dataclass(frozen=True)
        ... class Loop:
        ...     head: str = "mlp"
        ...     steps: int | None = None
        ...     minutes: float | None = None
        >>> layer(Loop(steps=7, head="mlp"), {"head": "cosine", "minutes": 2.5}, frozenset({"steps", "minutes"}))
        Loop(head='mlp', steps=7, minutes=None)
    """
    unknown = set(values) - {f.name for f in dataclasses.fields(config)}
    if unknown:
        raise ValueError(f"recipe sets unknown fields {sorted(unknown)} of {type(config).__name__}")
    keep = given(config)
    if keep & together:
        keep |= together
    return dataclasses.replace(config, **as_fields(type(config), {k: v for k, v in values.items() if k not in keep}))
