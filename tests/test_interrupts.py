"""Ctrl-C inside ``store()``/``load()``: an asynchronous exception (``KeyboardInterrupt`` from a signal
handler) may land at any point of the call; whatever it interrupts, it leaks no slot, pin or
in-flight count, and every key that becomes visible holds exactly the bytes stored under it. Also
on the GPU path (driven on the CPU: ``kvoffload._testing.take_gpu_path``), where transfers of more
than one chunk submit their copies under the index's lock, before their entries or pins are made."""

from __future__ import annotations

import traceback

import pytest

import kvoffload
import kvoffload._testing

from support.caches import block_bytes, random_caches

from support.interrupts import interrupter
from support.standins import CopiesAtOnce

from support.waiting import wait_for_transfers_to_end

BOUND_S = 30.0
MAX_CALLS = 20_000


def _kvoffload_frames(tb) -> set[str]:
    return {f"{f.name}" for f in traceback.extract_tb(tb) if "kvoffload" in f.filename and "tests" not in f.filename}


# An interrupt may also land in another library's gc callback (hypothesis registers one), which
# swallows it: Python reports it as unraisable, and the iteration simply sees no interrupt.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("tiers", ["host", "host+disk", "host, GPU path"])
def test_interrupts_anywhere_in_store_and_load_and_stats_leak_nothing(tmp_path, tiers, caplog):
    caches = random_caches(64, seed=7)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    disk = {"disk_path": tmp_path / "kv", "disk_blocks": 48} if tiers == "host+disk" else {}
    off = kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=2 * slot, **disk).start()
    if tiers == "host, GPU path":  # stores of 3 blocks and loads of up to 4 are more than a chunk (2 blocks)
        kvoffload._testing.take_gpu_path(off, lambda kind, copier: CopiesAtOnce(copier))
    landed_in: set[str] = set()
    interrupted = calls = 0
    with interrupter(seed=1) as ctrl_c:
        # Until 400 calls were cut short: how many end before their interrupt depends on the machine's speed.
        for i in range(MAX_CALLS):
            if interrupted >= 400:
                break
            calls = i + 1
            src = [(i * 7 + j) % 32 for j in range(3)]
            keys = {("k", i, b): b for b in src}
            try:
                ctrl_c.arm()  # an interrupt at a random point of the call (or none, if it ends first)
                if i % 3 == 2:  # a load of what is stored now, into the upper half of the cache
                    stored = [k for k in (("k", i - n, (i - n) * 7 % 32) for n in range(1, 12)) if k in off][:4]
                    off.load({k: 32 + n for n, k in enumerate(stored)})
                else:
                    off.store(keys)
                if i % 10 == 9:  # the counters folded, also under an interrupt
                    off.stats()
                ctrl_c.armed = False
            except KeyboardInterrupt as e:
                ctrl_c.armed = False
                interrupted += 1
                landed_in |= _kvoffload_frames(e.__traceback__)
            except kvoffload.CapacityError:  # every slot taken by running transfers: not a leak
                ctrl_c.armed = False
    assert interrupted >= 400, f"{interrupted} of {calls} calls interrupted"
    assert len(landed_in) >= 20, f"the interrupts landed in too few places: {sorted(landed_in)}"
    swallowed = [r for r in caplog.records if r.exc_info and r.exc_info[0] is KeyboardInterrupt]
    assert not swallowed, f"{len(swallowed)} interrupts were logged instead of raised"

    wait_for_transfers_to_end(off, BOUND_S)
    s = off.stats()
    assert (s.in_flight, s.pending, s.pinned, s.spilling) == (0, 0, 0, 0), s
    assert s.host_free + s.host_ready == 16 and s.disk_free + s.disk_ready + s.disk_clean == s.disk_slots, s
    # Every visible key holds its bytes, and every slot can be had again.
    for i in range(calls):
        for b in [(i * 7 + j) % 32 for j in range(3)]:
            if ("k", i, b) in off:
                off.load({("k", i, b): 63}).result(BOUND_S)
                assert block_bytes(caches, 63) == block_bytes(caches, b)
    off.store({("fresh", b): b for b in range(16)}).result(BOUND_S)
    off.close()
