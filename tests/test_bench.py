"""`kvoffload bench` runs end to end on CPU tensors with tiny sizes and writes its JSON."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def test_bench_command_small(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.bench", "--gib", "0.01", "--disk-gib", "0.01", "--small", "200", "--busy-seconds", "0.3", "--engine-steps", "20",
         "--layout", "4x2x16x8x128:bf16", "--disk-dir", str(tmp_path), "--ttft-tokens", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scenario" in proc.stdout and re.search(r"\[1/\d+ ", proc.stdout)  # progress, then the table
    data = json.loads(out.read_text())
    names = {r["scenario"] for r in data["rows"]}
    assert {"host store, random ids", "store+load, another thread busy", "disk load (no host tier)", "one-block stores, all at once",
            "one-block loads, 64 in flight", "engine step with offloading", "persistent disk load, verify=True",
            "TTFT 64 tokens, host", "TTFT 64 tokens, disk"} <= names
    for r in data["rows"]:
        assert r["kvoffload"] > 0
    assert list(tmp_path.iterdir()) == [out]  # the bench removed its disk files
