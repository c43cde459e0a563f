"""The type checker over the library, its tests and benchmarks: `mypy` with the `[tool.mypy]` settings of pyproject.toml.

Annotations are how the parallel authors of this code base state their contracts to each
other; a wrong one (an Optional read as a value, an exception attribute that exists only
on a subclass) is a bug waiting for the input that reaches it, in a test as in the library
(a test that reads an Optional as a value fails on the input it was not written for). About
25-45 s from a cold cache on 2 cores, a few seconds from the warm one kept in `.mypy_cache`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_mypy_finds_no_errors() -> None:
    pytest.importorskip("mypy", reason="mypy comes with the dev extra: pip install -e '.[dev]'")
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"mypy found errors:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
