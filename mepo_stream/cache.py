"""Where mepo-stream keeps things it derives once and reuses: extracted datasets, converted weights."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$MEPO_CACHE`` if set, else ``$XDG_CACHE_HOME/mepo-stream`` (default ``~/.cache/mepo-stream``)."""
    if env := os.environ.get("MEPO_CACHE"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "mepo-stream"
