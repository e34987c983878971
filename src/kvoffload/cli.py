"""Command line: ``kvoffload demo``, ``kvoffload bench`` and ``kvoffload info``.

A mistake in what was typed (an unknown option, a value out of range, a device this machine does
not have, a cache larger than its memory) is answered the argparse way, on one line: ``kvoffload
demo: error: ...`` on stderr and exit status 2, never a traceback. An interrupt (Ctrl-C) ends a
command with one line and exit status 130.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = ["CommandLineParser", "directory", "guarded", "main", "positive_float", "positive_int"]


class CommandLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE`` on one line (with where to look for the options) and exit 2."""
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see '{self.prog} --help')\n")


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a number above 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"want a number above 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a whole number of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"want a whole number of at least 1, got {text!r}")
    return value


def guarded(prog: str, body: Callable[[], int]) -> int:
    """Run a command's ``body``; an interrupt (Ctrl-C) ends it with one line on stderr and status 130."""
    try:
        return body()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130


def directory(text: str) -> str:
    """An argparse ``type``: the path of an existing directory."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory" if os.path.exists(text) else f"no directory {text!r}")
    return text


def _parsers() -> tuple[CommandLineParser, dict[str, CommandLineParser]]:
    """The ``kvoffload`` parser, and its commands' parsers by name."""
    from . import __version__

    parser = CommandLineParser(prog="kvoffload", description="Offload KV-cache blocks to host memory and back.")
    parser.add_argument("--version", action="version", version=f"kvoffload {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,info}")
    demo = sub.add_parser("demo", help="store and load a real cache, verify every byte, print GB/s",
                          description="Store a random KV cache, wipe it, load it back and verify every byte: through "
                                      "the host tier, then through a small host tier in front of a temporary disk tier "
                                      "(in the temporary directory: TMPDIR).")
    demo.add_argument("--device", default="auto", help="auto (a GPU if there is one), cpu, cuda or cuda:N (default: auto)")
    demo.add_argument("--gib", type=positive_float, default=None,
                      help="cache size in GiB (default 2 on a GPU, 0.25 on CPU); on CPU it needs about 3x that of memory")
    demo.add_argument("--layers", type=positive_int, default=32, help="layers: 64 KiB per layer per block (default 32)")
    sub.add_parser("bench", help="benchmark against the ceiling and the seed-style baseline (see 'kvoffload bench --help')",
                   add_help=False)
    info = sub.add_parser("info", help="print the environment report to paste into a bug report",
                          description="Versions (kvoffload, Python, torch, cuda-bindings, redis-py, ...), the CUDA driver "
                                      "and runtime, the GPUs, cuMemcpyBatchAsync and NVRTC, the compiled extensions, "
                                      "host memory, and what the file system at --path supports (O_DIRECT, free space).")
    info.add_argument("--path", type=directory, default=None, metavar="DIR",
                      help="a directory where a disk tier would live (default: the temporary directory)")
    return parser, {"demo": demo, "info": info}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvoffload`` console script."""
    parser, commands = _parsers()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    command = commands[args.command]
    if rest:
        command.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "info":
        from .info import run_info

        return guarded(command.prog, lambda: run_info(args.path))
    from .demo import DemoPlan

    try:
        plan = DemoPlan.check(args.device, args.gib, args.layers)
    except ValueError as e:
        command.error(str(e))
    return guarded(command.prog, plan.run)


if __name__ == "__main__":
    sys.exit(main())
