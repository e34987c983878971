"""Every example runs to completion (on CPU tensors in CI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.slow
def test_example_runs(path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip()


def test_demo_command_verifies_every_byte():
    proc = subprocess.run([sys.executable, "-m", "kvoffload.cli", "demo", "--device", "cpu", "--gib", "0.03", "--layers", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: every byte round-tripped" in proc.stdout and "GB/s" in proc.stdout


@pytest.mark.slow
def test_readme_quickstart_runs():
    """The README's quickstart runs as written (on CPU tensors here, on the GPU where there is one)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = readme.split("## Quickstart", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    nbytes, seconds = proc.stdout.split()
    assert int(nbytes) == 2 * 8 * 2 * 16 * 8 * 128 * 2 and float(seconds) > 0
