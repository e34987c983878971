"""`kvoffload bench` runs end to end on CPU tensors with tiny sizes and writes its JSON; installed from
a wheel, with no checkout around, it still has its seed-style baseline and its model harness."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from kvoffload.bench.command import cost_scenario
from kvoffload.bench.remote_tier import redis_unavailable
from kvoffload.bench.report import Report

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--gib", "0.01", "--disk-gib", "0.01", "--small", "200", "--busy-seconds", "0.3", "--engine-steps", "20", "--engine-rounds", "3",
        "--layout", "4x2x16x8x128:bf16", "--ttft-tokens", "64"]


def bench(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "kvoffload.bench", *TINY, *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_bench_command_small(tmp_path):
    out = tmp_path / "bench.json"
    # cost: kvoffload.bench.transfer_cost's scenario, tested on its own
    proc = bench("--disk-dir", str(tmp_path), "--json", str(out), "--skip", "cost")
    assert "scenario" in proc.stdout and re.search(r"\[1/\d+ ", proc.stdout)  # progress, then the table
    data = json.loads(out.read_text())
    rows = {r["scenario"]: r for r in data["rows"]}
    assert {"host store, random ids", "store+load, another thread busy", "disk load (no host tier)", "one-block stores, all at once",
            "one-block loads, 64 in flight", "persistent disk load, verify=True", "TTFT 64 tokens, host", "TTFT 64 tokens, disk"} <= set(rows)
    # the engine loop and the application thread: no offloading (or the loop alone), kvoffload and the baseline, in one run
    for name in ("engine step, 3 ms of Python", "engine step, 10 ms of Python", "Python loop beside 5,000 one-block stores/s",
                 "Python loop beside one-block stores, unpaced"):
        assert rows[name]["ceiling"] > 0 and rows[name]["baseline"] > 0, name
    # at equal work (shown where the baseline fell behind its pace): kvoffload paced at the rate the baseline completed
    paced = data["extra"]["app_thread_paced"]
    if paced["baseline_stores_per_s"] < 0.9 * 5000:
        equal = data["extra"]["app_thread_equal_work"]
        assert equal["paced_at_per_s"] == max(paced["baseline_stores_per_s"], 1.0)
        assert rows["Python loop beside one-block stores, equal work"]["ceiling"] > 0
    # the loop's time lost per store done, each system's: its share short of 1 over the stores it completed
    for system in ("kvoffload", "baseline"):
        share = paced[f"loop_beside_{system}_its"] / paced["loop_alone_its"]
        expected = (1 - share) * 1e6 / max(paced[f"{system}_stores_per_s"], 1.0)
        assert abs(paced[f"{system}_loop_us_per_store"] - expected) <= 1e-6 * max(1.0, abs(expected))
    # where the engine step's time goes, per variant: the system's calls, its waits, the step's own Python
    parts = data["extra"]["engine_loop"]["3ms"]
    # (the step's Python is a fixed number of turns calibrated once: its time follows the machine's drift, so no
    # threshold on it; what must hold is that each variant's split is there and the bare step is its own Python)
    assert all(parts[f"{v}_{p}_us"] >= 0 for v in ("bare", "kvoffload", "baseline") for p in ("calls", "waits", "python"))
    assert parts["bare_calls_us"] < parts["kvoffload_calls_us"]
    assert parts["bare_python_us"] > 10 * (parts["bare_calls_us"] + parts["bare_waits_us"])
    assert "in its calls" in rows["engine step, 3 ms of Python"]["note"]
    if redis_unavailable() is None:
        assert rows["TTFT 64 tokens, remote"]["ceiling"] == rows["TTFT 64 tokens, recompute"]["kvoffload"]
        # the remote loads into host slots and through disk slots, beside the same redis-py GETs
        assert rows["remote load via disk slots (no host)"]["ceiling"] == rows["remote load (alookup + load)"]["ceiling"]
    for r in data["rows"]:
        assert r["kvoffload"] > 0
    assert list(tmp_path.iterdir()) == [out]  # the bench removed its disk files


@pytest.mark.slow
def test_skip_names_an_unknown_scenario():
    proc = subprocess.run([sys.executable, "-m", "kvoffload.bench", "--skip", "host,nosuch"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no scenario nosuch" in proc.stderr


def test_cost_scenario_missing_or_failing_leaves_the_bench_running(monkeypatch, capsys):
    rep = Report(2)
    monkeypatch.setitem(sys.modules, "kvoffload.bench.transfer_cost", None)  # as if absent: the import fails
    cost_scenario(rep, torch.device("cpu"))
    assert "[1/2" in capsys.readouterr().out.split("transfer cost: skipped")[0]

    def broken(rep: Report, dev: torch.device) -> None:
        raise RuntimeError("no such figure")

    monkeypatch.setitem(sys.modules, "kvoffload.bench.transfer_cost", types.SimpleNamespace(transfer_cost_scenarios=broken))
    cost_scenario(rep, torch.device("cpu"))
    assert "transfer cost: failed, no rows (RuntimeError: no such figure)" in capsys.readouterr().out
    assert rep.rows == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of this tree, built offline from a copy of what the build reads."""
    pytest.importorskip("setuptools", minversion="77")  # the build backend (pyproject's build-system; in the test extra)
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    tree.mkdir()
    for path in ROOT.iterdir():  # pyproject.toml, README.md, LICENSE, ...
        if path.is_file():
            shutil.copy(path, tree / path.name)
    shutil.copytree(ROOT / "src" / "kvoffload", tree / "src" / "kvoffload", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                           "-w", str(tmp / "dist"), str(tree)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = (tmp / "dist").glob("kvoffload-*.whl")
    return built


@pytest.mark.slow
def test_wheel_ships_the_baseline_and_the_model_harness(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kvoffload/bench/__main__.py", "kvoffload/bench/seed_baseline.py", "kvoffload/bench/prefix_cache_model.py"} <= names


@pytest.mark.slow
def test_installed_bench_has_its_baseline_without_a_checkout(wheel, tmp_path):
    site, work = tmp_path / "site", tmp_path / "work"
    zipfile.ZipFile(wheel).extractall(site)  # a pure-Python wheel, installed as pip would lay it out
    work.mkdir()
    # the wheel first; the rest of PYTHONPATH (dependencies installed there) but this checkout's sources
    checkout_src = str(Path(__file__).resolve().parents[1] / "src")
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(checkout_src)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *kept])}
    out = work / "bench.json"
    bench("--json", str(out), "--skip", "busy,cancel,disk,persist,remote,small,cost,engine,latency", cwd=work, env=env)
    data = json.loads(out.read_text())
    assert data["meta"]["baseline"].startswith(str(site))  # the wheel's, not this checkout's
    rows = {r["scenario"]: r for r in data["rows"]}
    assert rows["host store, random ids"]["baseline"] > 0
    if importlib.util.find_spec("transformers") is not None:
        assert rows["TTFT 64 tokens, host"]["kvoffload"] > 0  # the model harness came with the wheel


def test_the_step_cost_script_times_steps_on_the_gpu_path_with_the_gpu_stood_in_for():
    script = Path(__file__).resolve().parent.parent / "scripts" / "step_cost.py"
    proc = subprocess.run([sys.executable, str(script), "--steps", "120", "--runs", "1", "--python-ms", "0.1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"median ([\d.]+) us, lower quartile ([\d.]+) us \((\d+) steps", proc.stdout)
    assert m, proc.stdout
    assert 0 < float(m[2]) <= float(m[1]) and int(m[3]) == 70
    calls = subprocess.run([sys.executable, str(script), "--steps", "120", "--calls", "--python-ms", "0"], capture_output=True, text=True, timeout=120)
    m = re.search(r"every thread: ([\d.]+) \(70 steps", calls.stdout)
    assert calls.returncode == 0 and m and 20 < float(m[1]) < 200, calls.stdout + calls.stderr


def test_the_transfer_calls_script_counts_each_kind_of_transfer_in_every_thread():
    script = ROOT / "scripts" / "transfer_calls.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--transfers", "20"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    counts = dict(re.findall(r"^(.+): ([\d.]+) Python calls inside kvoffload", proc.stdout, re.M))
    assert set(counts) == {"one-block store, awaited", "8-block load, awaited", "one-block store, result() in another thread"}, proc.stdout
    # A transfer's calls, whichever thread makes them: far from none, and far from the 200 and more
    # of a one-block store plus an 8-block load before the hot path was put in one piece.
    assert all(20 < float(n) < 200 for n in counts.values()), proc.stdout


def test_the_ab_script_runs_two_trees_benches_in_turn_and_shows_each_row_side_by_side():
    script = ROOT / "scripts" / "bench_ab.py"
    proc = subprocess.run([sys.executable, str(script), "--other", "HEAD", "--rounds", "2", "--timeout", "120", "--",
                           "--only", "host", "--gib", "0.01", "--layout", "4x2x16x8x128:bf16"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = re.search(r"^host store, contiguous ids\s+GB/s\s+([\d.]+), ([\d.]+)\s+([\d.]+), ([\d.]+)\s+([\d.]+)$", proc.stdout, re.M)
    assert row, proc.stdout
    this, other = float(row[1]) + float(row[2]), float(row[3]) + float(row[4])
    assert all(float(row[i]) > 0 for i in range(1, 5)) and abs(float(row[5]) - this / other) < 0.01
    assert proc.stderr.count("round ") == 4  # each tree once per round
