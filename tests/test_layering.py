"""The import rules of docs/architecture.md, read from the source: a change that breaks one fails here."""

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
    """The ``server.*`` modules a file imports, by their full dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        found |= {name for name in names if name.startswith("server.")}
    return found


def reaching(path: Path, packages: tuple[str, ...]) -> set[str]:
    """The imports of ``path`` inside any of ``packages`` (dotted prefixes)."""
    return {m for m in imported_server_modules(path) if m.startswith(packages)}


@pytest.mark.parametrize("path", [*sorted((ROOT / "server" / "web").rglob("*.py")), ROOT / "server" / "serving.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_web_layer_sees_a_serving_model_never_a_roles_internals(path):
    """No module of ``server/web`` (app, routers, dependencies, middleware, prediction, the page), nor the protocol
    module ``server/serving.py``, imports anything under ``server.learner`` or ``server.replica``, or
    ``server.model_thread``: routes reach a running service only through ``server.serving.ServingModel``. Not even
    the app: the entry point (``server/serve.py``, the composition root) hands it the function that starts a
    role."""
    assert not reaching(path, ("server.learner", "server.replica", "server.model_thread"))


@pytest.mark.parametrize("path", sorted((ROOT / "server" / "replica").rglob("*.py")), ids=lambda p: p.name)
def test_a_replica_imports_nothing_of_the_learner(path):
    """The replica shares the consumer-thread base (``server.consumer``) and the model thread, never the
    learner's loop, book, state or publisher."""
    assert not reaching(path, ("server.learner",))


ROLES = sorted([*(ROOT / "server" / "learner").rglob("*.py"), *(ROOT / "server" / "replica").rglob("*.py")])


def test_a_role_never_imports_the_other():
    learner = sorted((ROOT / "server" / "learner").rglob("*.py"))
    assert not [str(p) for p in learner if reaching(p, ("server.replica",))]


@pytest.mark.parametrize("path", ROLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_role_never_imports_the_web_layer(path):
    """The roles implement ``server.serving.ServingModel`` and know nothing of HTTP: no ``server.web`` import (they
    answer in ``server.status``'s types, which the web layer returns as they are)."""
    assert not reaching(path, ("server.web",))


def attributes(path: Path) -> list[tuple[int, str, str]]:
    """(line, object, attribute) of every attribute access in a file, the object as written (``self.state``)."""
    return [(n.lineno, ast.unparse(n.value), n.attr)
            for n in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(n, ast.Attribute)]


SERVER = sorted((ROOT / "server").rglob("*.py"))


@pytest.mark.parametrize("path", SERVER, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_object_touches_another_objects_private_attributes(path):
    """In ``server/``, ``x._name`` only where ``x`` is ``self`` or ``cls`` (dunders aside)."""
    reaches = [f"{line}: {obj}.{attr}" for line, obj, attr in attributes(path)
               if attr.startswith("_") and not attr.startswith("__") and obj not in ("self", "cls")]
    assert not reaches


def test_the_stream_book_has_one_owner():
    """The intake (``server/learner/intake.py``) owns the ``StreamBook``: it books every record. The learning step
    and the persistence strategies (``state.py``, ``partitioned.py``) reach it only as ``intake.book``, to mark what
    was learned and saved; no other code in ``server/`` touches a ``.book`` attribute (the loop, the service and the
    reporter see offsets, counts and views, never the book)."""
    learner = ROOT / "server" / "learner"
    allowed = {learner / "intake.py": {"self"}, learner / "state.py": {"self.intake", "s.intake", "self.state.intake"},
               learner / "partitioned.py": {"s.intake", "self.state.intake"}}
    reaches = [f"{path.relative_to(ROOT)}:{line}: {obj}.book" for path in SERVER
               for line, obj, attr in attributes(path) if attr == "book" and obj not in allowed.get(path, set())]
    assert not reaches


def server_classes() -> list[tuple[Path, ast.ClassDef]]:
    return [(path, node) for path in SERVER for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ClassDef)]


def test_no_subclass_overrides_a_private_hook_of_its_base():
    """A subclass in ``server/`` may implement a hook its base leaves unimplemented (``raise NotImplementedError``,
    as ``ConsumerThread._run``), never override private behaviour of the base: a change there would break it
    silently. (The group learner is a strategy handed to the state, not a subclass of it.)"""
    import importlib
    import inspect

    overrides = []
    for path, _ in {(p, None) for p, _ in server_classes()}:
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            for base in cls.__mro__[1:]:
                if not base.__module__.startswith("server."):
                    continue
                for name, fn in vars(base).items():
                    if (name.startswith("_") and not name.startswith("__") and name in vars(cls)
                            and inspect.isfunction(fn) and "NotImplementedError" not in inspect.getsource(fn)):
                        overrides.append(f"{cls.__module__}.{cls.__name__}.{name} overrides {base.__name__}'s")
    assert not overrides


def module_imports(path: Path) -> set[str]:
    """The project modules a file imports, ``TYPE_CHECKING`` blocks and imports inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.split(".")[0] in PACKAGES}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of a module graph, each once, as the modules along it."""
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(module, ())):
            if nxt in path:
                cycle = path[path.index(nxt):]
                key = frozenset(cycle)
                if key not in done:
                    done.add(key)
                    cycles.append(cycle + [nxt])
            elif len(path) < 12:
                visit(nxt, path + [nxt])

    for module in sorted(graph):
        visit(module, [module])
    return cycles


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_not_even_under_type_checking():
    """Modules import each other one way, ``if TYPE_CHECKING:`` imports counted: a circle there is a circle in the
    design (the state and its reporter once needed each other's types)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    graph = {module: {name if name in files else name.rsplit(".", 1)[0] for name in module_imports(path)}
             & set(files) - {module} for module, path in files.items()}
    assert not import_cycles(graph)


def production_private_names() -> set[str]:
    """Every private name the production packages define: functions, classes, and attributes set on ``self``."""
    names = set()
    for package in ("mepo_stream", "offline", "server", "producers", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_test_uses_a_private_name_of_the_production_code():
    """Tests go through public surfaces: ``x._name`` (``x`` not ``self`` or ``cls``) and ``from m import _name`` are
    refused in ``tests/`` for every private name the production code defines, so a refactoring of internals never
    breaks a test, and a test never pins how the code is built."""
    private = production_private_names()
    reaches = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in private and ast.unparse(node.value) not in ("self",
                                                                                                         "cls"):
                reaches.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("tests"):
                reaches += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if a.name in private]
    assert not reaches
