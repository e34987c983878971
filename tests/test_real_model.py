"""A transformers Llama given KV that went through kvoffload generates exactly what it would have generated.

The model (seeded random weights, built from a config) and the paged prefix cache are those of
kvoffload.bench.prefix_cache_model (which examples/prefix_cache_transformers.py and the bench's
time-to-first-token rows run). A first request computes its whole prompt and stores its
blocks; a later request with the same prefix loads the hits and runs the rest. Its greedy tokens
and every logit they were chosen from must equal, bit for bit, those of the same model continuing
from the first request's cache, which never left the device. (The reference is that cache, not a
fresh forward pass over the whole prompt: attention over a cache and one pass over all tokens
differ in the last bits; ``test_loaded_prefix_agrees_with_a_full_forward_pass`` checks that
agreement to a tolerance.)
"""

from __future__ import annotations

import asyncio
import gc
import math
from typing import Any

import pytest
import torch

import kvoffload
from support.interrupts import NotingCancel

pytest.importorskip("transformers")

from kvoffload.bench import prefix_cache_model as pc  # noqa: E402

BLOCK = pc.BLOCK_TOKENS
STEPS = 8
PREFIX_BLOCKS = 12
MODELS = ["tiny", "tiny-gqa"]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    return pc.build_model(request.param, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def gqa_model():
    return pc.build_model("tiny-gqa", device="cpu", dtype=torch.float32)


def prompts(vocab: int, prefix_tokens: int = PREFIX_BLOCKS * BLOCK, seed: int = 0) -> tuple[list[int], list[int]]:
    """Two prompts sharing ``prefix_tokens`` tokens, then differing (suffixes of 21 and 27 tokens)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (prefix_tokens,), generator=g).tolist()
    return prefix + torch.randint(0, vocab, (21,), generator=g).tolist(), prefix + torch.randint(0, vocab, (27,), generator=g).tolist()


def assert_same_generation(model, loaded, never_offloaded, later: list[int], hit_tokens: int) -> list[int]:
    """``loaded`` holds ``hit_tokens`` tokens; it continues ``later`` exactly as ``never_offloaded``'s first ``hit_tokens`` do."""
    config = model.config
    assert loaded.get_seq_length() == hit_tokens
    reference = pc.cache_prefix(config, never_offloaded, hit_tokens)
    for got, want in zip(loaded.layers, reference.layers):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values), "loaded KV differs from the device's"
    tokens, logits = pc.greedy(model, loaded, later[hit_tokens:], STEPS)
    ref_tokens, ref_logits = pc.greedy(model, reference, later[hit_tokens:], STEPS)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits), f"logits differ by up to {(logits - ref_logits).abs().max().item()}"
    return tokens


def two_requests(model, *, first_tokens: int | None = None):
    """The first prompt (cut to ``first_tokens`` tokens, if given), the later one, the first's cache, and a paged buffer."""
    first, later = prompts(model.config.vocab_size)
    first = first[:first_tokens] if first_tokens else first
    never_offloaded = pc.prefill(model, first)
    paged = pc.PagedKV(model.config, 2 * len(later) // BLOCK, device="cpu", dtype=model.dtype)
    return first, later, never_offloaded, paged


@pytest.mark.asyncio
async def test_generation_from_host_tier_is_exact(model):
    first, later, never_offloaded, paged = two_requests(model)
    async with kvoffload.Offloader(paged.tensors, host_blocks=64) as off:
        prefix_cache = pc.PrefixCache(paged, off)
        assert await prefix_cache.store(first, never_offloaded) == len(first) // BLOCK
        for t in paged.tensors.values():
            t.fill_(math.nan)  # nothing left on the device: the KV can only come from kvoffload
        loaded = await prefix_cache.load(later)
        assert off.stats().keys_loaded_from_host == PREFIX_BLOCKS
    assert_same_generation(model, loaded, never_offloaded, later, PREFIX_BLOCKS * BLOCK)


@pytest.mark.asyncio
@pytest.mark.parametrize("host_blocks", [3, 0], ids=["host-tier-too-small", "disk-only"])
async def test_generation_from_disk_tier_is_exact(model, tmp_path, host_blocks):
    first, later, never_offloaded, paged = two_requests(model)
    options = dict(host_blocks=host_blocks, disk_path=str(tmp_path / "kv"), disk_blocks=64)
    async with kvoffload.Offloader(paged.tensors, **options) as off:
        prefix_cache = pc.PrefixCache(paged, off)
        await prefix_cache.store(first, never_offloaded)
        for t in paged.tensors.values():
            t.fill_(math.nan)
        loaded = await prefix_cache.load(later)
        s = off.stats()
        assert s.keys_loaded_from_disk >= PREFIX_BLOCKS - host_blocks and s.keys_loaded_from_disk > 0
    assert_same_generation(model, loaded, never_offloaded, later, PREFIX_BLOCKS * BLOCK)


class NotingLoads:
    """The offloader as ``PrefixCache`` uses it, calling ``on_cancel`` once a load's awaiting task was cancelled."""

    def __init__(self, off: kvoffload.Offloader, on_cancel) -> None:
        self.off = off
        self.on_cancel = on_cancel

    def lookup(self, *args, **kwargs):
        return self.off.lookup(*args, **kwargs)

    def load(self, *args, **kwargs):
        return NotingCancel(self.off.load(*args, **kwargs), self.on_cancel)


@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["host", "disk"])
async def test_cancelled_load_retried_is_exact(gqa_model, tmp_path, faults, tier):
    model = gqa_model
    first, later, never_offloaded, paged = two_requests(model)
    slot = kvoffload.BlockLayout.of(paged.tensors).slot_bytes
    options: dict[str, Any] = dict(host_blocks=64, chunk_bytes=slot)  # one block per chunk: the cancel lands mid-load
    if tier == "disk":
        options.update(host_blocks=0, disk_path=str(tmp_path / "kv"), disk_blocks=64)
    async with kvoffload.Offloader(paged.tensors, **options) as off:
        prefix_cache = pc.PrefixCache(paged, off)
        await prefix_cache.store(first, never_offloaded)
        for t in paged.tensors.values():
            t.fill_(math.nan)
        gate = faults.gate(off, "to_device" if tier == "host" else "preadv")
        told = asyncio.Event()
        prefix_cache.off = NotingLoads(off, told.set)
        task = asyncio.create_task(prefix_cache.load(later))
        gate.allow(2)
        await gate.entered_async(count=3)  # two blocks landed, the third is being copied
        task.cancel()  # as a server does when its client hangs up
        await asyncio.wait_for(told.wait(), 10)  # the load has been told to stop
        gate.open()
        with pytest.raises(asyncio.CancelledError):
            await task
        s = off.stats()
        assert s.cancelled == 1 and s.pinned == 0 and s.in_flight == 0
        layer0 = paged.tensors["layer.0"]
        assert layer0[PREFIX_BLOCKS - 1].isnan().all(), "the cancelled load ran to its end"
        if tier == "host":  # its first two blocks were copied (from disk they may stop in the bounce buffer)
            assert not layer0[:2].isnan().any()
        prefix_cache.off = off
        loaded = await prefix_cache.load(later)  # into the same blocks, which the cancelled load partly wrote
    assert_same_generation(model, loaded, never_offloaded, later, PREFIX_BLOCKS * BLOCK)


@pytest.mark.asyncio
async def test_partly_stored_prefix_with_the_rest_recomputed_is_exact(model):
    stored_blocks = 5
    # the first request was shorter: its prompt covered 5 full blocks of the prefix (and 7 tokens more)
    first, later, never_offloaded, paged = two_requests(model, first_tokens=stored_blocks * BLOCK + 7)
    async with kvoffload.Offloader(paged.tensors, host_blocks=64) as off:
        prefix_cache = pc.PrefixCache(paged, off)
        assert await prefix_cache.store(first, never_offloaded) == stored_blocks
        loaded = await prefix_cache.load(later)
    # the rest of the prefix (7 blocks) and the suffix are run from the partial cache, as from the device's
    assert_same_generation(model, loaded, never_offloaded, later, stored_blocks * BLOCK)


@pytest.mark.asyncio
async def test_loaded_prefix_agrees_with_a_full_forward_pass(model):
    """The loaded blocks are the later prompt's own prefix, at its positions: the generation matches one
    computed from nothing (to float32 rounding: attention over a cache sums in another order)."""
    first, later, never_offloaded, paged = two_requests(model)
    async with kvoffload.Offloader(paged.tensors, host_blocks=64) as off:
        prefix_cache = pc.PrefixCache(paged, off)
        await prefix_cache.store(first, never_offloaded)
        loaded = await prefix_cache.load(later)
    tokens, logits = pc.greedy(model, loaded, later[loaded.get_seq_length():], STEPS)
    from transformers import DynamicCache

    fresh_tokens, fresh_logits = pc.greedy(model, DynamicCache(config=model.config), later, STEPS)
    torch.testing.assert_close(logits, fresh_logits, rtol=0, atol=1e-5)
    assert tokens == fresh_tokens


def test_block_keys_cover_every_token_up_to_their_block():
    a = list(range(100))
    b = a[:40] + [7] + a[41:]  # differs at token 40, in block 2
    ka, kb = pc.block_keys(a), pc.block_keys(b)
    assert len(ka) == 100 // BLOCK  # a partial block has no key
    assert ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))  # a change reaches every later key
    assert pc.block_keys(a[:48]) == ka[:3] and len(set(ka)) == len(ka)
    assert pc.block_keys(a, salt=b"other model") != ka


def test_measure_ttft_reports_every_case(model, tmp_path):
    rows = pc.measure_ttft(model, [64, 100], repeat=1, disk_dir=str(tmp_path))
    assert [(r["tokens"], r["case"]) for r in rows] == [(n, c) for n in (64, 100) for c in ("recompute", "host", "disk", "90% hit")]
    for r in rows:
        assert r["ttft_s"] > 0 and r["loaded_tokens"] + r["recomputed_tokens"] == r["tokens"]
        if r["case"] == "recompute":
            assert r["vs_recompute"] == 1.0 and r["loaded_tokens"] == 0
        elif r["case"] in ("host", "disk"):
            assert r["loaded_tokens"] == (r["tokens"] - 1) // BLOCK * BLOCK  # all but the last token's block
        else:
            assert r["loaded_tokens"] == int((r["tokens"] - 1) // BLOCK * 0.9) * BLOCK
    assert not list(tmp_path.iterdir()), "the disk tier left a file behind"


def test_measure_ttft_remote_case_loads_the_prompt_from_the_server(model, tmp_path):
    from kvoffload.bench.remote_tier import redis_server, redis_unavailable

    if redis_unavailable() is not None:
        pytest.skip(redis_unavailable())
    with redis_server() as url:
        rows = pc.measure_ttft(model, [64], repeat=1, disk_dir=str(tmp_path), remote=url)
    assert [r["case"] for r in rows] == ["recompute", "host", "disk", "90% hit", "remote"]
    assert rows[-1]["loaded_tokens"] == (64 - 1) // BLOCK * BLOCK and rows[-1]["ttft_s"] > 0


# -- the same on the GPU: Llama-3-8B's shape in bfloat16 ---------------------------------------


@pytest.fixture(scope="module")
def model_8b():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = pc.build_model("8b", device="cuda", dtype=torch.bfloat16)
    pc.deterministic_attention()  # see its docstring: else two never-offloaded caches disagree too
    yield model
    del model
    gc.collect()  # a module tree with reference cycles is freed only by the collector: here, not in a later test
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["host", "disk", "partly stored"])
async def test_8b_bfloat16_generation_through_kvoffload_is_exact(model_8b, tmp_path, tier):
    model = model_8b
    first, later = prompts(model.config.vocab_size, prefix_tokens=1024, seed=1)
    if tier == "partly stored":
        first = first[:40 * BLOCK + 3]
    never_offloaded = pc.prefill(model, first)
    paged = pc.PagedKV(model.config, 2 * len(later) // BLOCK, device="cuda", dtype=torch.bfloat16)
    options: dict[str, Any] = dict(host_blocks=128)
    if tier == "disk":
        options = dict(host_blocks=0, disk_path=str(tmp_path / "kv"), disk_blocks=128)
    async with kvoffload.Offloader(paged.tensors, **options) as off:
        prefix_cache = pc.PrefixCache(paged, off)
        await prefix_cache.store(first, never_offloaded)
        for t in paged.tensors.values():
            t.fill_(math.nan)
        loaded = await prefix_cache.load(later)
    hit = (len(first) // BLOCK) * BLOCK if tier == "partly stored" else 1024
    tokens = assert_same_generation(model, loaded, never_offloaded, later, hit)
    assert len(tokens) == STEPS

