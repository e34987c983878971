"""The command line answers every mistake in what was typed with one line on stderr and exit status
2, before it allocates or runs anything, never with a traceback; ``kvoffload info`` reports the
environment on a machine without a GPU; the bench's ``--only`` runs the scenarios named and no
others, and its per-transfer costs stand beside bare hops in a table of their own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import kvoffload
from kvoffload.bench.report import Report
from kvoffload.cli import guarded, main

TINY = ["--gib", "0.01", "--disk-gib", "0.01", "--small", "100", "--layout", "4x2x16x8x128:bf16"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``kvoffload ARGV`` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, prog: str, *fragments: str) -> None:
    assert code == 2, (code, out, err)
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line, no traceback
    assert err.startswith(f"{prog}: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert out == "", out  # nothing ran


def _memory_available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    raise AssertionError("no MemAvailable in /proc/meminfo")


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

BAD_INPUTS = [
    pytest.param(["demo", "--device", "cuda"], "kvoffload demo", ["--device", "no CUDA device"],
                 marks=pytest.mark.skipif(GPUS > 0, reason="this machine has a GPU"), id="demo-cuda-without-gpu"),
    pytest.param(["demo", "--device", f"cuda:{GPUS}"], "kvoffload demo", ["--device", f"cuda:{GPUS}"], id="demo-no-such-gpu"),
    pytest.param(["demo", "--device", "tpu"], "kvoffload demo", ["--device", "want auto, cpu, cuda or cuda:N"], id="demo-device-foo"),
    pytest.param(["demo", "--gib", "-1"], "kvoffload demo", ["--gib", "above 0"], id="demo-gib-negative"),
    pytest.param(["demo", "--gib", "nan"], "kvoffload demo", ["--gib", "above 0"], id="demo-gib-nan"),
    pytest.param(["demo", "--gib", "lots"], "kvoffload demo", ["--gib", "'lots'"], id="demo-gib-word"),
    pytest.param(["demo", "--layers", "0"], "kvoffload demo", ["--layers", "at least 1"], id="demo-layers-zero"),
    pytest.param(["demo", "--nosuch"], "kvoffload demo", ["unrecognized arguments: --nosuch"], id="demo-unknown-option"),
    pytest.param([], "kvoffload", ["required"], id="no-command"),
    pytest.param(["serve"], "kvoffload", ["invalid choice: 'serve'"], id="unknown-command"),
    pytest.param(["info", "--path", "/nonexistent-kvoffload-dir"], "kvoffload info", ["--path", "no directory"], id="info-no-dir"),
    pytest.param(["info", "--verbose"], "kvoffload info", ["unrecognized arguments: --verbose"], id="info-unknown-option"),
    pytest.param(["bench", "--layout", "32x2x16x8x128:bf16x"], "kvoffload bench", ["--layout", "no dtype 'bf16x'", "bf16, fp16"],
                 id="bench-layout-bad-dtype"),
    pytest.param(["bench", "--layout", "foo"], "kvoffload bench", ["--layout", "'foo'", "LAYERSx"], id="bench-layout-foo"),
    pytest.param(["bench", "--layout", "32x0x4:bf16"], "kvoffload bench", ["--layout", "at least 1"], id="bench-layout-zero"),
    pytest.param(["bench", "--gib", "0.01", "--layout", "32x2x16x8x128000:bf16"], "kvoffload bench", ["--layout", "at least 2"],
                 id="bench-layout-larger-than-a-transfer"),
    pytest.param(["bench", "--skip", "host,nosuch"], "kvoffload bench", ["--skip", "no scenario nosuch"], id="bench-skip-unknown"),
    pytest.param(["bench", "--only", "nosuch"], "kvoffload bench", ["--only", "no scenario nosuch"], id="bench-only-unknown"),
    pytest.param(["bench", "--only", ","], "kvoffload bench", ["--only", "one or more"], id="bench-only-empty"),
    pytest.param(["bench", "--only", "host", "--skip", "disk"], "kvoffload bench", ["not allowed with"], id="bench-only-and-skip"),
    pytest.param(["bench", "--only", "layouts,expedited"], "kvoffload bench", ["--only", "need a CUDA device"],
                 marks=pytest.mark.skipif(GPUS > 0, reason="this machine has a GPU"), id="bench-only-gpu-scenarios-on-cpu"),
    pytest.param(["bench", "--gib", "0"], "kvoffload bench", ["--gib", "above 0"], id="bench-gib-zero"),
    pytest.param(["bench", "--io-threads", "0"], "kvoffload bench", ["--io-threads", "at least 1"], id="bench-io-threads-zero"),
    pytest.param(["bench", "--ttft-tokens", "64,many"], "kvoffload bench", ["--ttft-tokens", "'64,many'"], id="bench-ttft-tokens"),
    pytest.param(["bench", "--disk-dir", "/nonexistent-kvoffload-dir"], "kvoffload bench", ["--disk-dir", "no directory"],
                 id="bench-disk-dir-missing"),
    pytest.param(["bench", "--json", "/nonexistent-kvoffload-dir/out.json"], "kvoffload bench", ["--json", "no directory"],
                 id="bench-json-nowhere"),
    pytest.param(["bench", "--baseline", "/nonexistent-kvoffload-dir/seed_baseline.py"], "kvoffload bench",
                 ["--baseline", "no file"], id="bench-baseline-missing"),
    pytest.param(["bench", "--nosuch"], "kvoffload bench", ["unrecognized arguments: --nosuch"], id="bench-unknown-option"),
]


@pytest.mark.parametrize(("argv", "prog", "fragments"), BAD_INPUTS)
def test_a_mistake_is_one_line_on_stderr_and_exit_status_2(capsys, argv, prog, fragments):
    assert_one_line_error(*run_cli(capsys, *argv), prog, *fragments)


def test_a_baseline_that_does_not_load_is_one_line_too(capsys, tmp_path):
    broken = tmp_path / "seed_baseline.py"
    broken.write_text("def oops(:\n")
    assert_one_line_error(*run_cli(capsys, "bench", "--baseline", str(broken)), "kvoffload bench", "--baseline", "SyntaxError")


def test_a_file_as_info_path_is_refused(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    assert_one_line_error(*run_cli(capsys, "info", "--path", str(tmp_path / "f")), "kvoffload info", "--path", "not a directory")


def test_help_and_version_exit_0(capsys):
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.strip() == f"kvoffload {kvoffload.__version__}"
    for argv in (["--help"], ["demo", "--help"], ["info", "--help"], ["bench", "--help"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 0 and "usage:" in out and err == "", argv
    assert "--only" in out  # the bench's help names --only beside --skip


def _console(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvoffload.cli", *argv], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="MemAvailable comes from Linux's /proc/meminfo")
def test_demo_larger_than_memory_is_refused_before_allocating():
    # A cache as large as the memory available now: the demo would need 3x that on CPU. A second
    # process, so that a demo that did allocate would not take this one down.
    gib = f"{_memory_available_gib():.2f}"
    proc = _console("demo", "--device", "cpu", "--gib", gib)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "kvoffload demo", "--gib", "of host memory",
                          "MemAvailable", "try --gib")


def test_an_interrupt_is_one_line_and_exit_status_130(capsys):
    def interrupted() -> int:
        raise KeyboardInterrupt

    assert guarded("kvoffload demo", interrupted) == 130
    out, err = capsys.readouterr()
    assert (out, err) == ("", "kvoffload demo: interrupted\n")
    assert guarded("kvoffload demo", lambda: 7) == 7


def _info(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, list[str]]:
    code, out, err = run_cli(capsys, "info", *argv)
    assert code == 0 and err == "", err
    lines: dict[str, list[str]] = {}
    for line in out.splitlines():
        what, sep, answer = line.partition(": ")
        assert sep and answer.strip(), line  # every line is "what: answer"
        lines.setdefault(what.strip(), []).append(answer.strip())
    return lines


def test_info_reports_the_environment_on_this_machine(capsys, tmp_path):
    info = _info(capsys, "--path", str(tmp_path))
    assert info["kvoffload"][0].startswith(kvoffload.__version__)
    assert info["torch"][0].startswith(torch.__version__)
    assert info["python"][0].startswith(".".join(map(str, sys.version_info[:3])))
    for what in ("numpy", "cuda-bindings", "redis", "hiredis", "CUDA driver", "CUDA runtime", "GPU", "cuMemcpyBatchAsync", "NVRTC",
                 "host memory", "RLIMIT_MEMLOCK", "file system", "O_DIRECT", "O_TMPFILE", "flock", "redis-server"):
        assert what in info, what
    # both compiled extensions, loaded by import kvoffload
    assert sorted(e.split(":")[0] for e in info["extension"]) == ["convoy_free_lock", "piece_copies"]
    assert all("loaded" in e for e in info["extension"]), info["extension"]
    if GPUS == 0:
        assert info["GPU"][0].startswith("none")
    else:
        assert any(torch.cuda.get_device_name(0) in g for gs in info.values() for g in gs)
    # the file system answers are about the directory given, and it leaves nothing there
    assert info["path"] == [str(tmp_path)]
    free = float(info["free space"][0].split()[0]) * (2**30 if info["free space"][0].split()[1] == "GiB" else 2**20)
    assert abs(free - shutil.disk_usage(tmp_path).free) < 0.05 * shutil.disk_usage(tmp_path).total + 2**20
    assert info["O_DIRECT"][0].startswith(("supported", "not supported")), info["O_DIRECT"]
    assert list(tmp_path.iterdir()) == []


def test_info_says_unavailable_where_a_probe_cannot_answer(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # as if cuda-bindings were not installed
    monkeypatch.setitem(sys.modules, "cuda", None)
    info = _info(capsys, "--path", str(tmp_path))
    for what in ("CUDA driver", "cuMemcpyBatchAsync", "NVRTC"):
        assert info[what][0].startswith("unavailable (ModuleNotFoundError") and "cuda" in info[what][0], (what, info[what])


def test_report_puts_per_transfer_costs_beside_bare_hops_in_a_table_of_their_own(capsys):
    rep = Report(1)
    rep.row("host store", "GB/s", 5.0, 10.0, 2.5)
    rep.row("one-block store: caller CPU", "us/xfer", 40.0, bare_hop=10.0)
    with pytest.raises(ValueError, match="bare hop"):
        rep.row("mixed", "us/xfer", 40.0, baseline=3.0, bare_hop=10.0)
    main_table, hop_table = rep.table(), rep.hop_table()
    assert "host store" in main_table and "caller CPU" not in main_table
    assert "caller CPU" in hop_table and "host store" not in hop_table
    (hop_row,) = [line for line in hop_table.splitlines() if "caller CPU" in line]
    assert hop_row.split()[-3:] == ["40.00", "10.00", "+30.00"]  # kvoffload, bare hop, above
    host, cost = rep.rows
    assert (host["vs_ceiling"], host["vs_baseline"], host["bare_hop"]) == (0.5, 2.0, None)
    assert (cost["ceiling"], cost["baseline"], cost["vs_baseline"], cost["over_hop"]) == (None, None, None, 30.0)
    summary = rep.summary()
    assert "baseline: the seed-style baseline" in summary and "bare hop: " in summary
    capsys.readouterr()


@pytest.mark.slow
def test_bench_only_runs_the_scenarios_named(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvoffload.cli", "bench", *TINY, "--only", "latency,small", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["meta"]["scenarios"] == ["small", "latency"]  # in the bench's order
    assert "[2/2 " in proc.stdout and "[3/" not in proc.stdout  # one step each, no other
    rows = {r["scenario"]: r for r in data["rows"]}
    assert {"one-block stores, all at once", "one-block store, call to resume p50"} <= set(rows)
    assert not any(n.startswith(("host ", "disk ", "TTFT", "engine step")) for n in rows), set(rows)
    # the seed-style baseline in the baseline column; the wake floor beside the latency, not in it
    assert rows["one-block stores, all at once"]["baseline"] > 0
    latency = rows["one-block store, call to resume p50"]
    assert latency["bare_hop"] > 0 and latency["ceiling"] is None and latency["baseline"] is None
    tables = proc.stdout.split("\nper-transfer cost")
    assert len(tables) == 2 and "call to resume" in tables[1] and "call to resume" not in tables[0].split("\nscenario")[-1]
    assert set(data["columns"]) == {"table", "hop_table"}
    assert list(tmp_path.iterdir()) == [out]
