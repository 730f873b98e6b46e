"""The docstring examples of the packages outside pytest's ``testpaths`` (``offline``, ``producers``,
``benchmarks``): collecting those packages whole would also collect their ``test_*``-named helpers
(``benchmarks.rows.model_arithmetic.test_images``) as tests, so their examples run here, module by module: each
module whose source has an example, and every example doctest finds in it must run and hold."""

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for package in ("offline", "producers", "benchmarks") for p in (ROOT / package).rglob("*.py")
                 if ">>> " in p.read_text())


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name):
    module = importlib.import_module(name)
    found = sum(len(t.examples) for t in doctest.DocTestFinder().find(module))
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted == found > 0
