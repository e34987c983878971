"""Time to first token of a transformers Llama with its prompt's KV reloaded through kvoffload (from
host memory, from disk, a 90% hit, from a remote tier) against recomputing the prompt."""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from .remote_tier import redis_server, redis_unavailable
from .report import Report

__all__ = ["ttft_scenarios"]


def ttft_scenarios(rep: Report, dev: torch.device, lengths: list[int], disk_dir: str | None) -> None:
    """Time to first token of a transformers Llama (:mod:`kvoffload.bench.prefix_cache_model`):
    recompute, reload from host memory, reload from disk, a 90% hit, and reload from a redis-server
    on loopback (where one and redis-py are installed); Llama-3-8B's shape in bfloat16 on a GPU, a
    tiny model on CPU."""
    cuda = dev.type == "cuda"
    what = f"time to first token: {'Llama-3-8B shape, bf16' if cuda else 'tiny Llama, float32'}, prompts of {lengths} tokens"
    if importlib.util.find_spec("transformers") is None:
        rep.skip(what, "needs transformers")
        return
    from .prefix_cache_model import build_model, measure_ttft

    rep.begin(what)
    no_remote = redis_unavailable()
    if no_remote is not None:
        print(f"    no remote row: {no_remote}", flush=True)
    model = build_model("8b" if cuda else "tiny", device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
    try:
        with redis_server() if no_remote is None else contextlib.nullcontext() as remote:
            rows = measure_ttft(model, lengths, repeat=2, disk_dir=disk_dir, remote=remote)
    finally:
        del model
        if cuda:
            torch.cuda.empty_cache()
    recompute = {r["tokens"]: r["ttft_s"] for r in rows if r["case"] == "recompute"}
    for r in rows:
        first = r["case"] == "recompute"
        rep.row(f"TTFT {r['tokens']} tokens, {r['case']}", "ms", r["ttft_s"] * 1e3, None if first else recompute[r["tokens"]] * 1e3, None,
                note="ceiling = recompute" if not first else f"{r['recomputed_tokens']} tokens computed")
