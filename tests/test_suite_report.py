"""What ``make test`` tells a newcomer at its end: the real components it could not run, and how to get them."""

import subprocess
import sys

from tests.helpers import ROOT


def test_the_run_ends_by_naming_the_components_it_skipped_and_how_to_install_them(tmp_path):
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_terminal_summary  # noqa: F401\n")
    (tmp_path / "test_needs_tools.py").write_text(
        "import pytest\n"
        "def test_a(): pytest.skip('promtool is not installed (apt-get install prometheus)')\n"
        "def test_b(): pytest.skip('needs Chromium (Debian: apt-get install chromium chromium-driver)')\n"
        "def test_c(): pytest.skip('needs a CUDA GPU')\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True)
    out = run.stdout
    assert "real components not run here" in out, out
    assert "1 test(s) skipped: no prometheus" in out and "1 test(s) skipped: no chromium chromium-driver" in out
    assert "sudo apt-get install -y --no-install-recommends chromium chromium-driver prometheus" in out
