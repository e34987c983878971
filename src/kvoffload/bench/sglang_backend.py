"""kvoffload as SGLang's HiCache L3 backend (``kvoffload.sglang``) beside SGLang's own file backend
(``HiCacheFile``, ``--hicache-storage-backend file``), over one real SGLang host pool, in one run.

Both are built by SGLang's ``StorageBackendFactory`` and driven as SGLang's cache controller drives
them, in batches of up to 128 pages: kvoffload through the zero-copy calls (``batch_set_v1`` /
``batch_get_v1`` with host indices), the file backend through its generic calls (each page copied
out with ``get_data_page`` and written as a file; read into a staging page and copied back with
``set_from_flat_data_page``). Rows give GB/s and pages per second (in the note). Skipped where
SGLang's HiCache classes do not import (no SGLang installed).
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from .report import Report

__all__ = ["sglang_scenarios"]

_SHAPE = dict(layers=16, heads=8, head_dim=64, page_size=32)
"""One page: 2 x 16 layers x 32 tokens x 8 heads x 64 x bf16 = 1 MiB, in the page_first layout."""


def sglang_unavailable() -> str | None:
    """Why SGLang's classes cannot run here, or None."""
    try:
        for module in ("sglang.srt.mem_cache.storage.backend_factory", "sglang.srt.mem_cache.pool_host.mha",
                       "sglang.srt.mem_cache.memory_pool"):
            importlib.import_module(module)
    except Exception as e:  # not installed, or its imports fail here
        return f"SGLang's HiCache classes do not import ({type(e).__name__}: {e}); pip install sglang"
    return None


def _pool(pages: int) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    s = _SHAPE
    tokens = pages * s["page_size"]
    device = MHATokenToKVPool(tokens, s["page_size"], torch.bfloat16, s["heads"], s["head_dim"], s["layers"], "cpu", False,
                              start_layer=0, end_layer=s["layers"])
    pool = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, s["page_size"], "page_first",
                                pin_memory=torch.cuda.is_available(), device_capacity_tokens=device.size, start_layer=0,
                                end_layer=s["layers"], write_back_staging=device.hicache_write_back_staging)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    return pool


def _config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench/model", extra_config=extra)


def sglang_scenarios(rep: Report, gib: float, disk_dir: str | None = None, rounds: int = 2) -> None:
    """Store and load ``gib`` of pages through each backend, in SGLang's batches, ``rounds`` times;
    the best round of each. The file backend goes through the page cache (its reads after its
    writes come from RAM); kvoffload's disk tier does O_DIRECT."""
    what = f"SGLang L3: {gib:.2f} GiB of 1 MiB pages, kvoffload.sglang (v1 calls) beside SGLang's file backend"
    reason = sglang_unavailable()
    if reason is not None:
        rep.skip(what, reason)
        return
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    rep.begin(what)
    page_bytes = 2 * _SHAPE["layers"] * _SHAPE["page_size"] * _SHAPE["heads"] * _SHAPE["head_dim"] * 2
    n = max(1, int(gib * 2**30) // page_bytes)
    pool = _pool(max(n, STORAGE_BATCH_SIZE))
    ps = pool.page_size
    tmp = tempfile.mkdtemp(prefix="kvoffload-bench-sglang-", dir=disk_dir)
    figures: dict[str, list[float]] = {k: [] for k in ("set_v1", "get_v1", "file_set", "file_get")}
    try:
        ours = StorageBackendFactory.create_backend("dynamic", _config({
            "backend_name": "kvoffload", "module_path": "kvoffload.sglang", "class_name": "KvoffloadStorage",
            "interface_v1": 1, "disk_path": os.path.join(tmp, "kvoffload"), "disk_pages": rounds * n + STORAGE_BATCH_SIZE,
        }), pool)
        ours.register_mem_pool_host(pool)
        theirs = StorageBackendFactory.create_backend("file", _config({"file_storage_path": os.path.join(tmp, "file")}), pool)
        theirs.register_mem_pool_host(pool)
        try:
            for r in range(rounds):
                keys = [f"{r:04d}{i:060d}" for i in range(n)]
                batches = [(keys[i:i + STORAGE_BATCH_SIZE], list(range(i, min(n, i + STORAGE_BATCH_SIZE))))
                           for i in range(0, n, STORAGE_BATCH_SIZE)]

                def indices(pages: list[int]) -> torch.Tensor:
                    return torch.tensor([p * ps + t for p in pages for t in range(ps)], dtype=torch.int64)

                t0 = time.perf_counter()
                for ks, pages in batches:
                    assert all(ours.batch_set_v1(ks, indices(pages)))
                figures["set_v1"].append(n * page_bytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for ks, pages in batches:
                    assert all(ours.batch_get_v1(ks, indices(pages)))
                figures["get_v1"].append(n * page_bytes / (time.perf_counter() - t0) / 1e9)
                # SGLang's cache controller on its generic path (_generic_page_set / _generic_page_get)
                t0 = time.perf_counter()
                for ks, pages in batches:
                    assert theirs.batch_set(ks, [pool.get_data_page(p * ps) for p in pages])
                figures["file_set"].append(n * page_bytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                for ks, pages in batches:
                    got = theirs.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in pages])
                    for p, page in zip(pages, got):
                        assert page is not None
                        pool.set_from_flat_data_page(p * ps, page)
                figures["file_get"].append(n * page_bytes / (time.perf_counter() - t0) / 1e9)
        finally:
            ours.close()
            theirs.clear()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    best = {k: max(v) for k, v in figures.items()}
    per_s = {k: v * 1e9 / page_bytes for k, v in best.items()}
    rep.row("SGLang L3 batch_set_v1 (kvoffload disk)", "GB/s", best["set_v1"], ceiling=best["file_set"],
            note=f"ceiling = SGLang's file backend batch_set; {per_s['set_v1']:.0f} vs {per_s['file_set']:.0f} pages/s")
    rep.row("SGLang L3 batch_get_v1 (kvoffload disk)", "GB/s", best["get_v1"], ceiling=best["file_get"],
            note=f"ceiling = SGLang's file backend batch_get (page cache); {per_s['get_v1']:.0f} vs "
                 f"{per_s['file_get']:.0f} pages/s")
