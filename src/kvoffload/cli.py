"""Command line: ``kvoffload demo`` and ``kvoffload bench``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvoffload`` console script."""
    parser = argparse.ArgumentParser(prog="kvoffload", description="Offload KV-cache blocks to host memory and back.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="store and load a real cache, verify every byte, print GB/s")
    demo.add_argument("--device", default="auto", help="auto (GPU if present), cpu, or cuda[:N]")
    demo.add_argument("--gib", type=float, default=None, help="cache size in GiB (default 2 on GPU, 0.25 on CPU)")
    demo.add_argument("--layers", type=int, default=32, help="layers (2 MiB per block at 32)")
    sub.add_parser("bench", help="benchmark against the ceiling (see 'kvoffload bench --help')", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command != "bench" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.device, args.gib, args.layers)
    from .bench import main as bench_main

    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
