"""Prefix caching for a transformers causal LM through kvoffload, checked token for token.

A Llama model is built from a config with seeded random weights (nothing is downloaded); its KV
lives in a paged buffer of 16-token blocks, each full block of a prompt keyed by a hash chained
from the token ids, as serving engines do. The model, the paged buffer and the prefix cache over
kvoffload are in ``kvoffload.bench.prefix_cache_model`` (the bench's time-to-first-token rows run
the same code): ``PrefixCache.store`` stores a computed prompt's new blocks, ``PrefixCache.load``
looks up the hits (``lookup(keys, hold=True)``), loads them (``load(..., lease=lease)``) into free
blocks and fills the model's own cache object (``transformers.DynamicCache``) from them.

A first request prefills a long shared prefix and stores its blocks. Later requests with the same
prefix and other suffixes load the hits and run only the rest of the prompt. Greedy generation from
the loaded prefix gives exactly the tokens, and bit-identical logits, of the same model continuing
from the cache that never left the device: through host memory, and through the disk tier.

    python examples/prefix_cache_transformers.py                      # tiny Llama on CPU: a few seconds
    python examples/prefix_cache_transformers.py --model 8b --measure  # Llama-3-8B shape, bf16, on the GPU

``--measure`` prints the time to first token of a prompt four ways: recomputed (a prefill of the
whole prompt), reloaded from host memory, reloaded from disk, and a 90% hit (the last 10%
recomputed), each with its ratio to recomputing (``measure_ttft()`` returns the same rows).
A model has to run at least the prompt's last token to give the next one, so a "reload" loads
every full block but the last token's and runs that last block's tokens (1 to 16) through the
model, as serving engines do.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from typing import Any

import torch
from transformers import LlamaForCausalLM

import kvoffload
from kvoffload.bench.prefix_cache_model import (
    BLOCK_TOKENS,
    MODELS,
    PagedKV,
    PrefixCache,
    build_model,
    cache_prefix,
    deterministic_attention,
    file_system,
    greedy,
    kv_bytes_per_block,
    measure_ttft,
    prefill,
    print_ttft,
)


# -- the demonstration ------------------------------------------------------------------------


async def demo(model: LlamaForCausalLM, prefix_tokens: int, steps: int, disk_dir: str) -> None:
    """Requests sharing a prefix, answered from a host tier, then from a host tier too small that spills to disk."""
    device, vocab, config = model.device, model.config.vocab_size, model.config
    deterministic_attention()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, vocab, (prefix_tokens,), generator=g).tolist()
    first = prefix + torch.randint(0, vocab, (37,), generator=g).tolist()
    blocks = len(first) // BLOCK_TOKENS
    paged = PagedKV(config, blocks, device=device, dtype=model.dtype)
    print(f"model: {config.num_hidden_layers} layers, {config.num_key_value_heads} KV heads; "
          f"{kv_bytes_per_block(model)} bytes of KV per block; prefix of {prefix_tokens} tokens on {device}")

    start = time.perf_counter()
    never_offloaded = prefill(model, first)  # the first request: the whole prompt is computed
    print(f"first request: prefill of {len(first)} tokens in {(time.perf_counter() - start) * 1e3:.1f} ms")

    tiers: list[tuple[str, dict[str, Any]]] = [
        ("host memory", dict(host_blocks=blocks)),
        ("disk (host tier of 4 blocks)", dict(host_blocks=4, disk_path=os.path.join(disk_dir, "kv"), disk_blocks=blocks)),
    ]
    for tier, options in tiers:
        async with kvoffload.Offloader(paged.tensors, **options) as off:
            pc = PrefixCache(paged, off)
            stored = await pc.store(first, never_offloaded)
            s = off.stats()
            print(f"[{tier}] stored {stored} blocks: {s.host_ready} in host memory, {s.disk_ready} on disk")
            for i in range(2):
                prompt = prefix + torch.randint(0, vocab, (20 + 9 * i,), generator=g).tolist()
                start = time.perf_counter()
                from_disk = off.stats().keys_loaded_from_disk
                cache = await pc.load(prompt)
                from_disk = off.stats().keys_loaded_from_disk - from_disk
                hit = cache.get_seq_length()
                tokens, logits = greedy(model, cache, prompt[hit:], steps)
                seconds = time.perf_counter() - start
                ref_tokens, ref_logits = greedy(model, cache_prefix(config, never_offloaded, hit), prompt[hit:], steps)
                assert tokens == ref_tokens and torch.equal(logits, ref_logits), "generation differs from the never-offloaded cache"
                print(f"[{tier}] request {i + 2}: {hit} of {len(prompt)} prompt tokens loaded ({from_disk} blocks from disk), {len(prompt) - hit} run; "
                      f"{steps} tokens in {seconds * 1e3:.1f} ms {tokens[:6]}...: identical to the never-offloaded cache")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--device", default=None, help="default: cuda for 8b, else cuda if there is one, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--prefix", type=int, default=512, help="shared prefix length of the demonstration, in tokens")
    p.add_argument("--steps", type=int, default=8, help="tokens generated per request")
    p.add_argument("--measure", action="store_true", help="print time to first token: recompute, host, disk, 90%% hit")
    p.add_argument("--lengths", default=None, help="prompt lengths for --measure, comma-separated (default: by model)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per case (the best is reported)")
    p.add_argument("--disk-dir", default=None, help="directory of the disk tier's file (default: the temporary directory)")
    args = p.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() or args.model == "8b" else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    start = time.perf_counter()
    model = build_model(args.model, device=device, dtype=dtype)
    print(f"built a {args.model} Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {dtype}) "
          f"on {device} in {time.perf_counter() - start:.1f} s")
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
        asyncio.run(demo(model, args.prefix, args.steps, tmp))
    if args.measure:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(MODELS[args.model][1])
        disk_dir = args.disk_dir or tempfile.gettempdir()
        print(f"\ntime to first token ({args.model}, {dtype}, {device}; disk tier in {disk_dir}, {file_system(disk_dir)}):")
        print_ttft(measure_ttft(model, lengths, repeat=args.repeat, disk_dir=args.disk_dir))


if __name__ == "__main__":
    main()
