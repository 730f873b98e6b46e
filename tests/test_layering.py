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


def imported_server_modules(path: Path) -> set[str]:
    """The ``server.*`` modules a file imports (``server.x.y`` counts as ``server.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        found |= {".".join(name.split(".")[:2]) for name in names if name.startswith("server.")}
    return found


LEARNER_INTERNALS = {"server.state", "server.stream", "server.book", "server.publisher", "server.staging",
                     "server.monitor", "server.service", "server.replica", "server.model_thread"}
WEB = [*sorted((ROOT / "server" / "routers").glob("*.py")),
       *(ROOT / "server" / f"{name}.py" for name in ("prediction", "dependencies", "middleware", "serving"))]


@pytest.mark.parametrize("path", WEB, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_web_layer_sees_a_serving_model_never_a_roles_internals(path):
    """Routes, request handling and the ``ServingModel`` protocol import neither role's loop, state, book,
    publisher or model thread: they reach a running service only through ``server.serving.ServingModel``
    (``server.app``, the composition root, is the one web module that starts the roles)."""
    assert not imported_server_modules(path) & LEARNER_INTERNALS


def test_a_replica_imports_nothing_of_the_learner():
    """The replica shares the consumer-thread base (``server.consumer``), never the learner's loop or state."""
    learner = {"server.state", "server.stream", "server.book", "server.publisher", "server.service"}
    assert not imported_server_modules(ROOT / "server" / "replica.py") & learner
