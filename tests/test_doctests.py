"""The docstring examples of the packages outside pytest's ``testpaths`` (``offline``, ``producers``,
``benchmarks``): collecting those packages whole would also collect their ``test_*``-named helpers
(``benchmarks.model_arithmetic.test_images``) as tests, so their examples run here, module by module."""

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                 for package in ("offline", "producers", "benchmarks") for p in (ROOT / package).glob("*.py")
                 if ">>> " in p.read_text())


def test_the_packages_outside_testpaths_have_examples():
    assert {"benchmarks.learner_throughput", "benchmarks.run_all", "offline.evaluate"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
