"""A transformers Llama whose prompts' KV goes through kvoffload, as a prefix cache: the model and
cache harness of ``examples/prefix_cache_transformers.py`` (which shows it generating token for token
what the never-offloaded cache generates) and of the bench's time-to-first-token rows.

A Llama model is built from a config with seeded random weights (nothing is downloaded). Its KV
lives in a paged buffer laid out as serving engines lay it out: per layer, ``(num_blocks, 2, 16,
kv_heads, head_dim)`` (blocks of 16 tokens, K and V), one kvoffload block being one block index
across every layer. Each full block of a prompt has a key chained from the token ids, as engines
hash prefixes: ``blake2b(previous block's key + this block's token ids)``, so a key stands for
every token up to the end of its block.

A prompt's blocks are stored once computed; a later prompt with the same prefix looks up the hits
(``lookup(keys, hold=True)``; with a remote tier ``alookup``), loads them into free blocks of the
buffer, fills the model's own cache object (``transformers.DynamicCache``) from them and runs only
the rest of the prompt. :func:`measure_ttft` times the first token of a prompt that way against
recomputing it. Needs ``transformers``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvoffload

from .measure import sync_device

__all__ = ["BLOCK_TOKENS", "MODELS", "PagedKV", "PrefixCache", "block_keys", "build_model", "cache_from_layers", "cache_prefix",
           "deterministic_attention", "file_system", "greedy", "kv_bytes_per_block", "measure_ttft", "prefill", "print_ttft"]

BLOCK_TOKENS = 16

# name -> (LlamaConfig arguments, default prompt lengths for --measure)
MODELS: dict[str, tuple[dict[str, int], tuple[int, ...]]] = {
    # multi-head attention: as many KV heads as query heads, head size 16
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=512, max_position_embeddings=8192), (256, 1024)),
    # grouped-query attention with a head size of its own: 2 KV heads for 8 query heads, head size 32
    "tiny-gqa": (dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=8192), (256, 1024)),
    # Llama-3-8B's shape: 32 layers, 32 query heads, 8 KV heads of 128: 2 MiB per 16-token block in bf16
    "8b": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072), (4096, 16384, 32768)),
}


def build_model(name: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0) -> LlamaForCausalLM:
    """A Llama causal LM of the named shape (see ``MODELS``) with seeded random weights, built on ``device``."""
    config = LlamaConfig(**MODELS[name][0])
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in place in its dtype: an 8B model never exists in float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def block_keys(token_ids: Sequence[int], *, salt: bytes = b"") -> list[bytes]:
    """One key per full block of ``token_ids``: blake2b of the previous key and this block's ids.

    The key of block ``i`` covers tokens ``[0, 16 * (i + 1))``. ``salt`` starts the chain (put the
    model's identity there when several models share an offloader).
    """
    keys: list[bytes] = []
    previous = salt
    for end in range(BLOCK_TOKENS, len(token_ids) + 1, BLOCK_TOKENS):
        ids = b"".join(int(t).to_bytes(8, "little") for t in token_ids[end - BLOCK_TOKENS:end])
        previous = hashlib.blake2b(previous + ids, digest_size=16).digest()
        keys.append(previous)
    return keys


def cache_from_layers(config: LlamaConfig, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """The model's own cache object holding ``(keys, values)`` per layer, each ``[1, kv_heads, tokens, head_dim]``."""
    cache = DynamicCache(config=config)
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def cache_prefix(config: LlamaConfig, cache: DynamicCache, tokens: int) -> DynamicCache:
    """A new cache holding the first ``tokens`` tokens of ``cache`` (which is left as it is), in fresh
    contiguous memory as :meth:`PagedKV.read` makes it: the attention kernels a GPU picks can depend on
    the layout, and two caches compared token for token must not differ in it."""
    return cache_from_layers(
        config, [(layer.keys[:, :, :tokens].contiguous(), layer.values[:, :, :tokens].contiguous()) for layer in cache.layers],
    )


class PagedKV:
    """The model's KV in blocks of 16 tokens: per layer a ``(num_blocks, 2, 16, kv_heads, head_dim)`` tensor.

    ``tensors`` is what kvoffload offloads; ``allocate``/``free`` hand out block ids, lowest first.
    """

    def __init__(self, config: LlamaConfig, num_blocks: int, *, device: str | torch.device, dtype: torch.dtype) -> None:
        self.config = config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (num_blocks, 2, BLOCK_TOKENS, config.num_key_value_heads, head_dim)
        self.tensors = {f"layer.{i}": torch.zeros(shape, device=device, dtype=dtype)
                        for i in range(config.num_hidden_layers)}
        self._free = list(range(num_blocks))

    def allocate(self, n: int) -> list[int]:
        """``n`` free block ids (the lowest ones); ``MemoryError`` if fewer are free."""
        if n > len(self._free):
            raise MemoryError(f"{n} blocks asked, {len(self._free)} free")
        self._free.sort()
        ids, self._free = self._free[:n], self._free[n:]
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(block_ids)

    def write(self, cache: DynamicCache, first_block: int, block_ids: Sequence[int]) -> None:
        """Copy blocks ``first_block, first_block + 1, ...`` of ``cache``'s tokens into ``block_ids``."""
        n, start = len(block_ids), first_block * BLOCK_TOKENS
        ids = torch.tensor(block_ids, device=next(iter(self.tensors.values())).device)
        for layer, paged in zip(cache.layers, self.tensors.values()):
            for kv, states in enumerate((layer.keys, layer.values)):
                heads, dim = states.shape[1], states.shape[3]
                blocks = states[0, :, start:start + n * BLOCK_TOKENS].reshape(heads, n, BLOCK_TOKENS, dim)
                paged[ids, kv] = blocks.permute(1, 2, 0, 3)  # (blocks, tokens, heads, dim)

    def read(self, block_ids: Sequence[int]) -> DynamicCache:
        """A ``DynamicCache`` of the tokens in ``block_ids``, in that order (a copy: the blocks can be reused)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=next(iter(self.tensors.values())).device)
        layers = []
        for paged in self.tensors.values():
            blocks = paged.index_select(0, ids)  # (blocks, 2, tokens, heads, dim)
            k, v = (blocks[:, kv].permute(2, 0, 1, 3).reshape(1, blocks.shape[3], -1, blocks.shape[4]) for kv in (0, 1))
            layers.append((k, v))
        return cache_from_layers(self.config, layers)


class PrefixCache:
    """A model's prompts' blocks, stored in and loaded from one offloader over a ``PagedKV``."""

    def __init__(self, paged: PagedKV, off: kvoffload.Offloader) -> None:
        self.paged = paged
        self.off = off

    async def store(self, token_ids: Sequence[int], cache: DynamicCache) -> int:
        """Store the full blocks of ``cache`` (which holds ``token_ids``) not stored yet; returns how many."""
        keys = block_keys(token_ids[:cache.get_seq_length()])
        stored = self.off.lookup(keys)
        new = keys[stored:]
        block_ids = self.paged.allocate(len(new))
        try:
            self.paged.write(cache, stored, block_ids)
            await self.off.store(dict(zip(new, block_ids)))
        finally:
            self.paged.free(block_ids)
        return len(new)

    async def load(self, token_ids: Sequence[int], *, max_blocks: int | None = None) -> DynamicCache:
        """A cache of the longest stored prefix of ``token_ids`` (at most ``max_blocks`` blocks).

        The prompt's last token is never in it: the model has to run it to give the next token.
        """
        keys = block_keys(token_ids[:len(token_ids) - 1])[:max_blocks]
        with self.off.lookup(keys, hold=True) as lease:
            return await self._read(lease.keys, lease)

    async def load_shared(self, token_ids: Sequence[int]) -> DynamicCache:
        """As :meth:`load`, with the hits of the offloader's remote tier too (``alookup``: one round trip
        to the server for the keys past the local hits); those are read from the server on the way."""
        keys = block_keys(token_ids[:len(token_ids) - 1])
        hits = await self.off.alookup(keys)
        return await self._read(keys[:hits])

    async def _read(self, keys: Sequence[Hashable], lease: kvoffload.Lease | None = None) -> DynamicCache:
        """Load ``keys`` into free blocks and read them out as a cache; the blocks are free again after."""
        block_ids = self.paged.allocate(len(keys))
        try:
            await self.off.load(dict(zip(keys, block_ids)), lease=lease)
            return self.paged.read(block_ids)
        finally:
            self.paged.free(block_ids)


@torch.inference_mode()
def deterministic_attention() -> None:
    """Attention whose results do not vary from run to run, for comparing two generations bit for bit:
    PyTorch's cuDNN attention backend is not run-to-run deterministic on every GPU (on an H200, two
    caches with equal bytes continued the same prompt with logits 0.04 apart); flash attention is."""
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)


def greedy(model: LlamaForCausalLM, cache: DynamicCache, token_ids: Sequence[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Run ``token_ids`` (the prompt's tokens not in ``cache``), then generate ``steps`` tokens greedily.

    Returns the tokens and the logits they were chosen from (``[steps, vocab]``); extends ``cache``.
    """
    device = model.device
    ids = torch.tensor([list(token_ids)], device=device)
    tokens: list[int] = []
    logits = []
    for _ in range(steps):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        last = out.logits[0, -1].float()
        logits.append(last)
        tokens.append(int(last.argmax()))
        ids = torch.tensor([[tokens[-1]]], device=device)
    return tokens, torch.stack(logits)


@torch.inference_mode()
def prefill(model: LlamaForCausalLM, token_ids: Sequence[int]) -> DynamicCache:
    """The cache of ``token_ids`` after one forward pass over them all."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([list(token_ids)], device=model.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def kv_bytes_per_block(model: LlamaForCausalLM) -> int:
    """Bytes of one 16-token block across every layer (K and V)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return int(c.num_hidden_layers * 2 * BLOCK_TOKENS * c.num_key_value_heads * head_dim * model.dtype.itemsize)


# -- time to first token ----------------------------------------------------------------------


def file_system(path: str) -> str:
    """The file system type of ``path`` (from /proc/mounts; "?" where that cannot be read)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return "?"
    path = os.path.realpath(path)
    best = max((m for m in mounts if path == m[1] or path.startswith(m[1].rstrip("/") + "/")), key=lambda m: len(m[1]), default=None)
    return best[2] if best else "?"


async def _measure(model: LlamaForCausalLM, lengths: Sequence[int], repeat: int, disk_dir: str, hit_fraction: float,
                   seed: int, remote: str | None) -> list[dict[str, Any]]:
    device, vocab = model.device, model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    most_blocks = max(lengths) // BLOCK_TOKENS
    paged = PagedKV(model.config, most_blocks, device=device, dtype=model.dtype)

    def first_token(cache: DynamicCache, rest: Sequence[int]) -> int:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(rest)], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())  # int() waits for the device

    async def recompute(prompt: list[int]) -> tuple[float, dict[str, Any]]:
        sync_device(device)
        start = time.perf_counter()
        first_token(DynamicCache(config=model.config), prompt)
        return time.perf_counter() - start, {"loaded_tokens": 0, "recomputed_tokens": len(prompt), "load_s": 0.0}

    async def reload(pc: PrefixCache, prompt: list[int], max_blocks: int | None, shared: bool = False) -> tuple[float, dict[str, Any]]:
        if shared:  # every hit comes from the server: no copy of an earlier run kept here
            pc.off.discard(block_keys(prompt))
        sync_device(device)
        start = time.perf_counter()
        # lookup, load, and the DynamicCache filled
        cache = await (pc.load_shared(prompt) if shared else pc.load(prompt, max_blocks=max_blocks))
        sync_device(device)
        loaded = time.perf_counter()
        hit = cache.get_seq_length()
        first_token(cache, prompt[hit:])
        return time.perf_counter() - start, {"loaded_tokens": hit, "recomputed_tokens": len(prompt) - hit, "load_s": loaded - start}

    async def best_of(run: Callable[[], Awaitable[tuple[float, dict[str, Any]]]]) -> tuple[float, dict[str, Any]]:
        await run()  # warm-up
        return min([await run() for _ in range(repeat)], key=lambda r: r[0])

    first_token(DynamicCache(config=model.config), torch.randint(0, vocab, (min(lengths),), generator=g).tolist())  # warm-up
    rows: list[dict[str, Any]] = []
    for n in lengths:
        prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
        results = {"recompute": await best_of(lambda: recompute(prompt))}
        computed = prefill(model, prompt)
        hit_blocks = int((n - 1) // BLOCK_TOKENS * hit_fraction)
        cases: list[tuple[str, dict[str, Any], int | None]] = [
            ("host", dict(host_blocks=most_blocks), None),
            ("disk", dict(host_blocks=0, disk_path=os.path.join(disk_dir, "kv"), disk_blocks=most_blocks), None),
            (f"{hit_fraction:.0%} hit", dict(host_blocks=most_blocks), hit_blocks),
        ]
        for case, options, max_blocks in cases:
            async with kvoffload.Offloader(paged.tensors, **options) as off:
                pc = PrefixCache(paged, off)
                await pc.store(prompt, computed)
                results[case] = await best_of(lambda: reload(pc, prompt, max_blocks))
        if remote is not None:  # stored by one offloader (written through), loaded by another
            async with kvoffload.Offloader(paged.tensors, host_blocks=most_blocks, remote=remote) as writer:
                await PrefixCache(paged, writer).store(prompt, computed)
                while writer.stats().remote_writes_pending:
                    await asyncio.sleep(0.001)
            async with kvoffload.Offloader(paged.tensors, host_blocks=most_blocks, remote=remote, remote_write="none") as reader:
                pc = PrefixCache(paged, reader)
                results["remote"] = await best_of(lambda: reload(pc, prompt, None, shared=True))
        del computed
        for case, (seconds, info) in results.items():
            rows.append({"tokens": n, "case": case, "ttft_s": seconds, "vs_recompute": seconds / results["recompute"][0], **info})
    return rows


def measure_ttft(model: LlamaForCausalLM, lengths: Sequence[int], *, repeat: int = 3, disk_dir: str | None = None,
                 hit_fraction: float = 0.9, seed: int = 0, remote: str | None = None) -> list[dict[str, Any]]:
    """Time to first token of random prompts of each length: recomputed, reloaded from host memory,
    reloaded from a disk-only offloader, and with ``hit_fraction`` of the blocks reloaded from host memory;
    with ``remote`` (a Redis URL), also reloaded from that server: written through by one offloader,
    found by ``alookup`` and loaded by another that keeps no copy between runs.

    One row per length and case: ``tokens``, ``case`` ("recompute", "host", "disk", "90% hit", "remote"),
    ``ttft_s`` (best of ``repeat``), ``vs_recompute`` (``ttft_s`` over the recompute's), ``loaded_tokens``,
    ``recomputed_tokens``, ``load_s`` (lookup, load and filling the ``DynamicCache``). The disk tier's
    file goes in ``disk_dir`` (default: the temporary directory), read with O_DIRECT where the file
    system allows it. Call it outside a running event loop.
    """
    with tempfile.TemporaryDirectory(dir=disk_dir) as tmp:
        return asyncio.run(_measure(model, lengths, repeat, tmp, hit_fraction, seed, remote))


def print_ttft(rows: list[dict[str, Any]]) -> None:
    print(f"{'tokens':>7} {'case':>10} {'TTFT ms':>9} {'vs recompute':>13} {'load ms':>8} {'recomputed':>10}")
    for r in rows:
        print(f"{r['tokens']:7d} {r['case']:>10} {r['ttft_s'] * 1e3:9.1f} {r['vs_recompute']:12.3f}x "
              f"{r['load_s'] * 1e3:8.1f} {r['recomputed_tokens']:10d}")
