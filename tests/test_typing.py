"""The package type-checks under ``mypy --strict`` (configured in pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_package_is_mypy_strict_clean():
    pytest.importorskip("mypy")
    with tempfile.TemporaryDirectory() as cache:  # a fresh cache: the result must not depend on an old one
        proc = subprocess.run(
            [sys.executable, "-m", "mypy", "--cache-dir", cache],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "MYPY_FORCE_COLOR": "0"},
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
