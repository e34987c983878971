"""``kvoffload bench`` of two checkouts, interleaved in one run, row by row side by side.

A machine's speed drifts by tens of percent between minutes, so two trees are compared by running
their benches in turn, several rounds, in one session: each round runs this checkout's bench, then
the other's (then the order flips), and each row's figures are shown per round with the ratio of
the two. The other tree is a directory holding a checkout (its ``src/`` is put first on the path;
its compiled modules must be built: ``python setup.py build_ext --inplace`` there) or a git
revision of this repository, exported and built into a temporary directory.

    python scripts/bench_ab.py --other REV_OR_DIR [--rounds 2] [--timeout 300] -- --only engine,latency

Arguments after ``--`` go to ``kvoffload bench`` of both trees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def export(rev: str, into: Path) -> Path:
    """Revision ``rev`` of this repository, exported into ``into`` with its compiled modules built."""
    archive = subprocess.run(["git", "-C", str(HERE), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    print(f"building {rev} in {into} ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into, check=True, capture_output=True)
    return into


def bench(tree: Path, args: list[str], timeout: float) -> dict[str, dict]:
    """One ``kvoffload bench`` of ``tree``: its rows by scenario."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = {**os.environ, "PYTHONPATH": str(tree / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = subprocess.run([sys.executable, "-m", "kvoffload.cli", "bench", *args, "--json", str(out)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"the bench of {tree} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return {row["scenario"]: row for row in json.loads(out.read_text())["rows"]}


def main() -> None:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", required=True, help="a checkout's directory, or a git revision of this repository")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one bench may run")
    args = parser.parse_args(own)
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(args.other)
        if not other.is_dir():
            other = export(args.other, Path(tmp))
        trees = {"this": HERE, "other": other}
        runs: dict[str, list[dict[str, dict]]] = {"this": [], "other": []}
        for r in range(args.rounds):
            for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
                print(f"round {r + 1}: {name} tree ...", file=sys.stderr, flush=True)
                runs[name].append(bench(trees[name], bench_args, args.timeout))
    print(f"{'scenario':58s} {'unit':>9s}  {'this tree':>21s}  {'other tree':>21s}  this/other")
    for scenario, row in runs["this"][0].items():
        mine = [run[scenario]["kvoffload"] for run in runs["this"] if scenario in run]
        theirs = [run[scenario]["kvoffload"] for run in runs["other"] if scenario in run]
        if not theirs or any(v is None for v in mine + theirs):
            continue
        ratio = sum(mine) / sum(theirs) if sum(theirs) else float("nan")
        print(f"{scenario[:58]:58s} {row['unit']:>9s}  {', '.join(f'{v:.3g}' for v in mine):>21s}  "
              f"{', '.join(f'{v:.3g}' for v in theirs):>21s}  {ratio:.3f}")


if __name__ == "__main__":
    main()
