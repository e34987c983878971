"""``kvoffload bench``: kvoffload beside the ceiling and the seed-style baseline, in one run.

Every scenario runs the ceiling (what the hardware does with one large copy, or raw multi-threaded
O_DIRECT IO), the seed-style baseline (``kvoffload.bench.seed_baseline``: a background thread per
direction fed by a queue, one descriptor per layer per block, completion by polling a shared list
of events; disk one block at a time) and kvoffload, on the same data, and reports GB/s and ratios.
Per-transfer costs (CPU, wake-ups, latency) go to a table of their own, beside bare cross-thread
hops: the floor under any design that crosses threads. Under each table a legend says what its
columns mean (:data:`kvoffload.bench.report.COLUMNS`). On a machine without CUDA the scenarios that
need no GPU run on CPU tensors.

Usage: ``kvoffload bench [--gib 2] [--layout 32x2x16x8x128:bf16] [--skip host,disk | --only cost]
[--json out.json] [--plot out.png]``. A mistake in the options is one line on stderr and exit
status 2, before anything runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..cli import CommandLineParser, directory, guarded, positive_float, positive_int
from . import seed_baseline
from .busy_caller import app_thread_scenario, busy_caller_scenarios
from .cache_layout import Layout
from .disk_tier import disk_scenarios, persistence_scenarios
from .engine_loop import engine_loop_scenario
from .host_tier import host_scenarios
from .latency import latency_scenarios
from .layouts import layout_scenarios
from .load_timing import cancel_scenario, expedited_scenario, first_layer_scenario
from .measure import frozen_heap
from .remote_tier import remote_scenarios
from .report import COLUMNS, Report, plot
from .sglang_backend import sglang_scenarios
from .small_transfers import small_transfers
from .ttft import ttft_scenarios
from .under_compute import under_compute_scenarios

__all__ = ["SCENARIOS", "Run", "main", "parser"]

GPU_ONLY = {"layouts", "layers", "expedited", "compute"}
"""Scenarios that need a CUDA device (skipped without one)."""


def load_baseline(path: str | None) -> ModuleType:
    """The seed-style baseline: the one shipped in this package, or the file ``path`` (an override)."""
    if path is None:
        return seed_baseline
    spec = importlib.util.spec_from_file_location("seed_baseline", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # the module's own classes look themselves up there
    spec.loader.exec_module(mod)
    return mod


def cost_scenario(rep: Report, dev: torch.device) -> None:
    """The ``cost`` scenario, ``kvoffload.bench.transfer_cost.transfer_cost_scenarios(rep, dev)``; a
    printed reason instead where that module is missing or fails, and the bench goes on."""
    what = "transfer cost"
    try:
        run: Callable[[Report, torch.device], Any] = importlib.import_module(f"{__package__}.transfer_cost").transfer_cost_scenarios
    except Exception as e:  # absent, or broken: the other scenarios still run
        rep.skip(what, f"kvoffload.bench.transfer_cost unavailable: {type(e).__name__}: {e}")
        return
    try:
        run(rep, dev)
    except Exception as e:
        print(f"    {what}: failed, no rows ({type(e).__name__}: {e})", flush=True)


@dataclass
class Run:
    """What the scenarios of one run are given: its options, report, layout, device and baseline."""

    args: argparse.Namespace
    rep: Report
    lay: Layout
    dev: torch.device
    base: ModuleType

    @property
    def cuda(self) -> bool:
        """True on a GPU."""
        return self.dev.type == "cuda"

    @property
    def gib(self) -> float:
        """Bytes per host transfer, in GiB."""
        return float(self.args.gib or (2.0 if self.cuda else 0.25))

    @property
    def disk_gib(self) -> float:
        """Bytes per disk transfer, in GiB."""
        return float(self.args.disk_gib or (2.0 if self.cuda else 0.25))

    @property
    def ttft_lengths(self) -> list[int]:
        """Prompt lengths of the time-to-first-token rows."""
        if self.args.ttft_tokens:
            return list(self.args.ttft_tokens)
        return [4096, 16384, 32768] if self.cuda else [256, 1024]


def _latency(run: Run) -> None:
    with frozen_heap():
        latency_scenarios(run.rep, run.dev)


SCENARIOS: dict[str, tuple[Callable[[Run], None], ...]] = {
    "host": (lambda r: host_scenarios(r.rep, r.lay, r.gib, r.dev, r.base),),
    "busy": (lambda r: busy_caller_scenarios(r.rep, r.lay, min(r.gib, 0.5), r.dev, r.base, r.args.busy_seconds),
             lambda r: app_thread_scenario(r.rep, r.lay, r.dev, r.base, r.args.busy_seconds)),
    "layouts": (lambda r: layout_scenarios(r.rep, min(r.gib, 1.0), r.dev, r.base),),
    "layers": (lambda r: first_layer_scenario(r.rep, r.lay, min(r.gib, 1.0), r.dev),),
    "expedited": (lambda r: expedited_scenario(r.rep, r.lay, min(r.gib, 1.0), r.dev),),
    "cancel": (lambda r: cancel_scenario(r.rep, r.lay, 4.0 if r.cuda else min(r.gib, 0.25), r.dev),),
    "compute": (lambda r: under_compute_scenarios(r.rep, r.lay, min(r.gib, 0.5), r.dev, r.args.busy_seconds),),
    "disk": (lambda r: disk_scenarios(r.rep, r.lay, r.disk_gib, r.dev, r.base, r.args.disk_dir, r.args.io_threads),),
    "persist": (lambda r: persistence_scenarios(r.rep, r.lay, r.disk_gib, r.dev, r.args.disk_dir, r.args.io_threads),),
    "remote": (lambda r: remote_scenarios(r.rep, r.lay, min(r.gib, 1.0), r.dev, disk_dir=r.args.disk_dir),),
    "ttft": (lambda r: ttft_scenarios(r.rep, r.dev, r.ttft_lengths, r.args.disk_dir),),
    "sglang": (lambda r: sglang_scenarios(r.rep, min(r.disk_gib, 0.25), r.args.disk_dir),),
    "small": (lambda r: small_transfers(r.rep, r.dev, r.base, r.args.small),),
    "cost": (lambda r: cost_scenario(r.rep, r.dev),),
    "engine": (lambda r: engine_loop_scenario(r.rep, r.lay, min(r.gib, 0.25), r.dev, r.base, r.args.engine_steps, rounds=r.args.engine_rounds),),
    "latency": (_latency,),
}
"""Each scenario's name (for ``--skip`` and ``--only``) -> its steps (one progress line each), in the order they run."""


DTYPES = ("bf16", "fp16", "fp32", "fp8")
"""The dtypes a ``--layout`` may name (:class:`~.cache_layout.Layout`)."""


def layout(text: str) -> Layout:
    """An argparse ``type``: ``--layout LAYERSxD1x...:DTYPE``."""
    want = f"want LAYERSxD1x...[:DTYPE], whole numbers of at least 1 and DTYPE one of {', '.join(DTYPES)}, e.g. 32x2x16x8x128:bf16"
    _dims, _, dt = text.partition(":")
    if dt and dt not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: no dtype {dt!r}; {want}")
    try:
        return Layout(text)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r}: {want}") from None


def scenario_names(text: str) -> set[str]:
    """An argparse ``type``: comma-separated names of :data:`SCENARIOS`."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = names - set(SCENARIOS)
    if unknown:
        raise argparse.ArgumentTypeError(f"no scenario {', '.join(sorted(unknown))} (there are {','.join(SCENARIOS)})")
    return names


def token_counts(text: str) -> list[int]:
    """An argparse ``type``: comma-separated prompt lengths, each at least 1."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"want comma-separated whole numbers of at least 1, got {text!r}")
    return counts


def _writable_file(p: argparse.ArgumentParser, option: str, path: str | None) -> None:
    """``p.error`` now, not after the run, unless ``path`` can be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        p.error(f"argument {option}: {path!r} is a directory")
    if not os.path.isdir(folder):
        p.error(f"argument {option}: no directory {folder!r} to write {os.path.basename(path)!r} in")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        p.error(f"argument {option}: {path!r} cannot be written (permission denied)")


def parser() -> argparse.ArgumentParser:
    """The options of ``kvoffload bench``."""
    p = CommandLineParser(prog="kvoffload bench", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--gib", type=positive_float, default=None, help="bytes per host transfer (default 2 GiB on GPU, 0.25 on CPU)")
    p.add_argument("--disk-gib", type=positive_float, default=None, help="bytes per disk transfer (default 2 GiB on GPU, 0.25 on CPU)")
    p.add_argument("--layout", type=layout, default=Layout(), metavar="LAYOUT",
                   help=f"LAYERSxBLOCK_SHAPE:DTYPE, DTYPE one of {', '.join(DTYPES)} (default 32x2x16x8x128:bf16: 64 KiB per layer per block)")
    p.add_argument("--disk-dir", type=directory, default=None, help="directory for the disk scenarios (default: the temp dir)")
    p.add_argument("--io-threads", type=positive_int, default=4)
    p.add_argument("--ttft-tokens", type=token_counts, default=None,
                   help="prompt lengths of the time-to-first-token rows (default 4096,16384,32768 on GPU, 256,1024 on CPU)")
    p.add_argument("--small", type=positive_int, default=5000, help="one-block transfers in the small-transfer scenario")
    p.add_argument("--engine-steps", type=positive_int, default=20, help="steps per run of the engine-loop scenario")
    p.add_argument("--engine-rounds", type=positive_int, default=24,
                   help="rounds of the engine-loop scenario: in each, one run per system, side by side")
    p.add_argument("--busy-seconds", type=positive_float, default=2.0, help="seconds per measurement of the busy-caller scenario")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--skip", type=scenario_names, default=set(), metavar="NAMES",
                       help=f"comma-separated scenarios not to run, of: {','.join(SCENARIOS)} ({', '.join(sorted(GPU_ONLY))} need a GPU)")
    which.add_argument("--only", type=scenario_names, default=None, metavar="NAMES",
                       help="comma-separated scenarios to run, and no others (the same names as --skip)")
    p.add_argument("--baseline", default=None, help="path of a seed_baseline.py to use instead of kvoffload.bench.seed_baseline")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--plot", default=None, help="write a PNG chart to this file (needs matplotlib)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark: progress while it runs, the tables at the end, optional JSON and PNG."""
    p = parser()
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("argument --plot: needs matplotlib (pip install matplotlib)")
    _writable_file(p, "--json", args.json)
    _writable_file(p, "--plot", args.plot)
    if args.only == set():
        p.error(f"argument --only: want one or more of {','.join(SCENARIOS)}")
    cuda = torch.cuda.is_available()
    lay: Layout = args.layout
    default_gib = 2.0 if cuda else 0.25
    smallest = min(args.gib or default_gib, args.disk_gib or default_gib)
    if 2 * lay.block_bytes > smallest * 2**30:
        p.error(f"argument --layout: a block of {lay.spec} is {lay.block_bytes / 2**20:.1f} MiB, and a transfer of "
                f"{smallest:g} GiB (--gib, --disk-gib) must hold at least 2 of them; give a smaller layout or a larger --gib")
    if args.baseline is not None:
        if not os.path.isfile(args.baseline):
            p.error(f"argument --baseline: no file {args.baseline!r}")
        try:
            base = load_baseline(args.baseline)
        except Exception as e:  # the user's file: a syntax error, a failed import
            p.error(f"argument --baseline: {args.baseline!r} cannot be loaded: {type(e).__name__}: {e}")
    else:
        base = seed_baseline
    chosen = args.only if args.only is not None else set(SCENARIOS) - args.skip
    runnable = chosen if cuda else chosen - GPU_ONLY
    if not runnable:
        p.error(f"argument --only: {', '.join(sorted(chosen))} need{'s' if len(chosen) == 1 else ''} a CUDA device, "
                "and this machine has none")
    if not cuda and chosen & GPU_ONLY:
        print(f"no CUDA device: not running {', '.join(n for n in SCENARIOS if n in chosen & GPU_ONLY)}", flush=True)
    return guarded("kvoffload bench", lambda: _run(args, lay, base, cuda, runnable))


def _run(args: argparse.Namespace, lay: Layout, base: ModuleType, cuda: bool, names: set[str]) -> int:
    """Run the scenarios ``names``, in the order of :data:`SCENARIOS`; print and write the results."""
    dev = torch.device("cuda" if cuda else "cpu")
    todo = [step for name, steps in SCENARIOS.items() if name in names for step in steps]
    run = Run(args, Report(len(todo)), lay, dev, base)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None, "gpu": torch.cuda.get_device_name() if cuda else None,
            "cpus": os.cpu_count(), "layout": lay.spec, "block_bytes": lay.block_bytes, "baseline": base.__file__,
            "scenarios": [n for n in SCENARIOS if n in names]}
    print("kvoffload bench:", json.dumps(meta), flush=True)
    for step in todo:
        step(run)
    rep = run.rep
    print("\n" + rep.summary(), flush=True)
    for line in rep.below_floor():
        print("below its floor:", line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "columns": COLUMNS, "rows": rep.rows, "extra": rep.extra}, f, indent=1)
    if args.plot:
        plot(rep, args.plot)
    return 0
