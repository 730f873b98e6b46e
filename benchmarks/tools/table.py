"""The rows of docs/performance.md's results table, as the row scripts give them (``table_rows``) and
``benchmarks.run_all`` joins them: a row's fields, and the number formats the rows share."""

from __future__ import annotations

Row = tuple[str, str, str, float | None, str, bool | None]
"""One row of the table: the measurement, mepo-stream's figure, the bare reference's, their ratio (None: none), the
goal, and whether the goal is met (None: no goal)."""


def fmt(value: float, unit: str) -> str:
    """A figure in the table's units: seconds as ms, a rate per second, bytes as MB.

    Example:
        >>> fmt(0.01234, "ms"), fmt(123.456, "/s"), fmt(3 * 2**20, "MB")
        ('12.3 ms', '123.5/s', '3 MB')
    """
    return {"ms": f"{1000 * value:.1f} ms", "/s": f"{value:.1f}/s", "MB": f"{value / 2**20:.0f} MB"}[unit]


def spread(c: dict) -> str:
    """How far a throughput's rounds went (nothing for one round).

    Example:
        >>> spread({"rounds": [{}, {}, {}], "ratio_range": [0.861, 0.97]})
        '; median of 3 rounds, ratios 0.86–0.97'
    """
    if len(rounds := c["rounds"]) < 2:
        return ""
    low, high = c["ratio_range"]
    return f"; median of {len(rounds)} rounds, ratios {low:.2f}–{high:.2f}"
