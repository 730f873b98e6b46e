"""The import rules of README "Layout", read from the source: a change that breaks one fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("mepo_stream", "offline", "server", "producers", "benchmarks")
FORBIDDEN = {
    "mepo_stream": {"offline", "server", "producers", "benchmarks"},  # the core imports none of the others
    "producers": {"server", "offline", "benchmarks"},  # producer and server meet only through Kafka
    "server": {"producers", "offline", "benchmarks"},
    "offline": {"server", "producers", "benchmarks"},
}


def imported_packages(path: Path) -> dict[str, int]:
    """Top-level package of every import in a file (relative imports are its own package), with a line number."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            found.setdefault(name.split(".")[0], node.lineno)
    return found


def test_the_parser_sees_imports_of_every_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom server.app import x\ndef f():\n    import producers.siblurry\nfrom . import y\n")
    assert imported_packages(source) == {"os": 1, "server": 2, "producers": 4}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_one_way(package):
    violations = [f"{path.relative_to(ROOT)}:{line} imports {name}"
                  for path in sorted((ROOT / package).rglob("*.py"))
                  for name, line in imported_packages(path).items() if name in FORBIDDEN[package]]
    assert not violations, "\n".join(violations)
