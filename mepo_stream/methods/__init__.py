"""Host methods, found by name. Each is a small module subclassing ``ContinualMethod``.

Example:
    >>> sorted(METHODS)
    ['misa']
"""

from __future__ import annotations

from mepo_stream.methods.base import ContinualMethod
from mepo_stream.methods.misa import MISA, MISAConfig

METHODS: dict[str, type[ContinualMethod]] = {"misa": MISA}

__all__ = ["METHODS", "MISA", "ContinualMethod", "MISAConfig", "create_method"]


def create_method(name: str, backbone, n_classes: int, alignment=None, **kwargs) -> ContinualMethod:
    """Instantiate the host method ``name`` around ``backbone``."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name](backbone, n_classes, alignment, **kwargs)
