"""The learner process keeps freed memory (``server.allocator``): set by ``mepo serve``, left alone when the
environment already says how."""

from __future__ import annotations

import platform

import pytest

import server.allocator as allocator
import server.serve as serve_module
from server.config import ServeConfig


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_the_thresholds_are_set_on_glibc(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert allocator.keep_freed_memory() is True


def test_thresholds_the_environment_sets_are_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert allocator.keep_freed_memory() is False


def test_serve_keeps_freed_memory_before_it_builds_the_model(monkeypatch):
    calls = []
    monkeypatch.setattr(serve_module, "keep_freed_memory", lambda: calls.append("allocator"))
    monkeypatch.setattr(serve_module, "create_app", lambda cfg, start: calls.append("app"))
    monkeypatch.setattr(serve_module.uvicorn, "run", lambda app, **_: calls.append("run"))
    serve_module.serve(ServeConfig())
    assert calls == ["allocator", "app", "run"]
