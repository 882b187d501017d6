"""The tree stays ruff-clean: pyflakes, import order and bugbear-style mistakes ([tool.ruff] in pyproject.toml)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINTED = ["core", "plugins", "server", "bench", "router", "tests", "benchmarks"]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (it is in the `test` extra: pip install -e '.[test]')")
def test_ruff_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *LINTED],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"ruff check found problems:\n{proc.stdout}{proc.stderr}"
