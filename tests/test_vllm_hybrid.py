"""kvoffload's vLLM backend serving a hybrid model (full attention + sliding window) under vLLM 0.33's
real ``Scheduler``.

The model has three full-attention layers and two sliding-window layers, so vLLM makes two KV cache
groups over three layer positions: the sliding window group uses two of the three KV tensors. Each
group's blocks are written and checked byte for byte in that group's layers
(``support.vllm_scheduler.Engine`` with ``groups``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM 0.33 is not installed with what its Scheduler imports (the test extra)")

from vllm.v1.kv_cache_interface import KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_offload.base import get_offload_group_idx  # noqa: E402

from kvoffload.vllm import slot_bytes_for  # noqa: E402
from support.vllm_scheduler import BLOCK, BPC, PAGE, TIERS, Engine, attention, hits, prompt, tiers  # noqa: E402

WINDOW = 40
"""Tokens of the sliding window: two chunks (of ``BPC * BLOCK`` = 32 tokens) reach back that far."""
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(5)]
GROUPS = [
    KVCacheGroupSpec([NAMES[0], NAMES[2], NAMES[4]], attention()),
    KVCacheGroupSpec([NAMES[1], NAMES[3]], attention(sliding_window=WINDOW)),
]
"""vLLM's groups for this model: full attention first (its first layer comes first), then the window."""
FULL, SLIDING = 0, 1


@pytest.fixture
def make_engine(tmp_path: Any) -> Any:
    engines: list[Engine] = []

    def make(extra: dict[str, Any], **kwargs: Any) -> Engine:
        engines.append(Engine(tmp_path, extra, groups=GROUPS, **kwargs))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def vllm_hits(engine: Engine) -> int:
    """Tokens of connector hits so far, as vLLM's prefix cache metrics count them."""
    return sum(engine.hit_sources.values())


def stored_per_group(engine: Engine) -> dict[int, int]:
    return dict(collections.Counter(get_offload_group_idx(k) for k in engine.manager.stored_keys()))


@pytest.mark.parametrize("tier", list(TIERS))
def test_a_hybrid_models_prefixes_round_trip_through_the_real_scheduler(
    make_engine: Callable[..., Engine], tmp_path: Any, tier: str,
) -> None:
    engine = make_engine(tiers(tier, tmp_path))
    a = prompt(1, chunks=3)
    (first,) = engine.run(a)
    assert hits(engine, first) == 0 and vllm_hits(engine) == 0
    # full attention stores every chunk; the window only the two chunks it reaches back from the prompt's end
    assert stored_per_group(engine) == {FULL: 3, SLIDING: 2}

    engine.drop_gpu_prefix_cache()
    (again,) = engine.run(a + [7, 8, 9])
    assert hits(engine, again) == 3 * BPC * BLOCK and vllm_hits(engine) == 3 * BPC * BLOCK
    # the window's load is its last WINDOW - 1 tokens: blocks 3 to 5, from the middle of chunk 1
    assert engine.checked_loads[-1] == (again.request_id, (3 * BPC, 3), (0, 3))

    # Mid-chunk: the GPU prefix cache keeps block 0 of both groups, so full attention loads from block 1, inside chunk 0.
    engine.drop_gpu_prefix_cache()
    engine.run(a[:BLOCK + 5])
    (mid,) = engine.run(a + [4])
    assert hits(engine, mid) == 3 * BPC * BLOCK - BLOCK
    assert vllm_hits(engine) == 2 * 3 * BPC * BLOCK - BLOCK
    assert engine.checked_loads[-1] == (mid.request_id, (3 * BPC - 1, 3), (1, 3))

    assert engine.loads_checked == 2
    assert {first.request_id, again.request_id, mid.request_id} <= engine.contexts_checked
    s = engine.worker.offloader.stats()
    assert (s.evicted, s.failed, s.in_flight) == (0, 0, 0), s


@pytest.mark.parametrize("tier", list(TIERS))
def test_chunks_of_every_group_share_the_capacity_and_the_offloader_never_evicts(
    make_engine: Callable[..., Engine], tmp_path: Any, tier: str,
) -> None:
    engine = make_engine(tiers(tier, tmp_path))  # room for 8 chunks, of either group
    prompts = [prompt(30 + i, chunks=2) for i in range(4)]  # each stores 2 chunks per group: 16 through 8 of room
    for p in prompts:
        engine.run(p)
    assert stored_per_group(engine) == {FULL: 4, SLIDING: 4}
    engine.drop_gpu_prefix_cache()
    for p in prompts[2:]:  # the 2 most recent prompts are stored, in both groups: each loads whole
        (r,) = engine.run(p + [1])
        assert hits(engine, r) == 2 * BPC * BLOCK
        assert engine.checked_loads[-1] == (r.request_id, (2 * BPC, 3), (0, 1))
    (r,) = engine.run(prompts[0] + [1])  # evicted by the manager: computed again
    assert hits(engine, r) == 0
    assert engine.loads_checked == 2 and vllm_hits(engine) == 2 * 2 * BPC * BLOCK
    s = engine.worker.offloader.stats()
    assert (s.evicted, s.failed) == (0, 0), "the offloader evicted behind the manager's back"


def test_host_bytes_buy_slots_of_one_row_of_the_tensors_the_groups_share(make_engine: Callable[..., Engine]) -> None:
    """vLLM counts a block of this model as one row of the KV allocation both groups share: three pages,
    not five. ``host_bytes`` buys slots of that size, each holding the whole row the worker copies."""
    slot = slot_bytes_for(3 * PAGE)
    engine = make_engine({"host_bytes": 64 * slot})
    assert engine.worker.offloader.layout.slot_bytes == slot
    assert engine.worker.offloader.stats().host_slots == 64 and engine.manager.capacity == 64 // BPC
