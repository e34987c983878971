"""What stats() tells an operator, and the Prometheus collector that exports it.

Each figure is driven by transfers whose effect is known (keys per tier, evictions, IO errors,
cancellations after some chunks landed) and checked exactly.
"""

from __future__ import annotations

import asyncio
import errno
import sys
import threading

import pytest

import kvoffload
from support.caches import random_caches


@pytest.mark.asyncio
async def test_lookups_and_hits_are_counted():
    async with kvoffload.Offloader(random_caches(8, seed=50), host_blocks=8) as off:
        await off.store({"a": 0, "b": 1, "c": 2})
        assert off.lookup(["a", "b", "x", "c"]) == 2
        assert off.lookup(["x"]) == 0
        assert off.lookup(iter(["a", "b", "c"])) == 3
        s = off.stats()
        assert (s.lookups, s.lookup_hits) == (3, 5)


@pytest.mark.asyncio
async def test_transfers_with_nothing_to_copy_are_counted_as_done():
    async with kvoffload.Offloader(random_caches(8, seed=52), host_blocks=8) as off:
        await off.store({"a": 0, "b": 1})
        skipped = await off.store({"a": 2, "b": 3})  # every key stored already
        assert skipped.skipped == ("a", "b") and skipped.keys == ()
        await off.load({})
        s = off.stats()
        assert (s.stores, s.loads, s.in_flight, s.bytes_stored) == (2, 1, 0, 2 * off.layout.block_bytes)
        assert s.latency[("store", "done", "total")].count == 2


def test_counts_stay_exact_across_thousands_of_ends_from_several_threads_read_meanwhile():
    """Ends are counted lazily (folded by each read, and every 256 ends): whatever the interleaving of
    ends from several threads and reads from another, every read sees counts that only grow, and the
    last one counts every transfer once."""
    caches = random_caches(64, seed=55)
    off = kvoffload.Offloader(caches, host_blocks=64).start()
    try:
        off.store({("base", b): b for b in range(8)}).result(10)
        threads, per_thread, stop = 4, 500, threading.Event()
        seen: list[tuple[int, int, int]] = []
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                for i in range(per_thread):
                    off.store({("t", t, i): 8 + t}).result(10)
                    off.load({("base", i % 8): 32 + t}).result(10)
                    off.discard([("t", t, i)])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def read() -> None:
            while not stop.is_set():
                s = off.stats()
                seen.append((s.stores, s.loads, s.latency[("store", "done", "total")].count if ("store", "done", "total") in s.latency else 0))

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        reader = threading.Thread(target=read)
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads switch between almost any two steps of a fold or an end
        try:
            reader.start()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            stop.set()
            reader.join()
            sys.setswitchinterval(interval)
        assert not errors, errors
        assert len(seen) > 10, "the reader hardly ran"
        assert all(a <= b for x, y in zip(seen, seen[1:]) for a, b in zip(x, y)), "a count went down"
        s = off.stats()
        n = threads * per_thread
        assert (s.stores, s.loads, s.in_flight, s.failed, s.cancelled) == (1 + n, n, 0, 0, 0), s
        assert s.latency[("store", "done", "total")].count == 1 + n and s.latency[("load", "done", "total")].count == n
        assert s.bytes_loaded == n * off.layout.block_bytes and s.keys_loaded_from_host == n
    finally:
        off.close()


def test_a_fold_counts_every_end_as_one_observation_per_end_and_phase_would():
    """The ends' fold (grouped, each phase's durations counted sorted, a bisection per bucket bound)
    gives exactly the counts, bytes and histograms of observing each end's three phases one by one,
    on random ends of every kind and outcome, durations on and around the buckets' bounds, some never
    taken by a worker, and clocks that went backwards (counted as 0)."""
    import bisect
    import random

    from kvoffload._core.tiers.stats import LATENCY_BOUNDS, EndTotals

    rng = random.Random(7)
    for _ in range(50):
        ends = []
        for _ in range(rng.randrange(0, 300)):
            kind = rng.choice(["store", "load"])
            outcome = rng.choice(["done", "done", "failed", "cancelled", "no result"])
            keys = tuple(range(rng.randrange(1, 9)))
            result = kvoffload.TransferResult(kind, keys, (), rng.randrange(1 << 30), 0.0) if outcome == "done" else None
            started = rng.uniform(0, 100)
            bound = rng.choice(LATENCY_BOUNDS)
            taken = None if rng.random() < 0.1 else started + rng.choice([bound, rng.uniform(-1e-3, 1.0), 0.0])
            now = (taken if taken is not None else started) + rng.choice([bound, rng.uniform(-1e-3, 100.0), 0.0])
            ends.append((kind, result, outcome == "failed", outcome == "cancelled", started, taken, now,
                         rng.randrange(1 << 20), rng.randrange(len(keys) + 1) if kind == "load" else 0, rng.random() < 0.9))
        before = EndTotals().plus(ends[: len(ends) // 3])
        got = before.plus(ends[len(ends) // 3 :])
        want: dict = {name: 0 for name in EndTotals.__slots__[:-1]}
        hist: dict = {}
        for kind, result, failed, cancelled, started, taken, now, partial, from_disk, counted in ends:
            outcome = "cancelled" if cancelled else "failed" if failed or result is None else "done"
            want["ended_in_flight"] += counted
            want["bytes_stored_partially"] += partial
            if outcome != "done":
                want[outcome] += 1
            elif kind == "store":
                want["stores"] += 1
                want["bytes_stored"] += result.nbytes
            else:
                want["loads"] += 1
                want["bytes_loaded"] += result.nbytes
                want["keys_loaded_from_disk"] += from_disk
                want["keys_loaded_from_host"] += len(result.keys) - from_disk
            t = started if taken is None else taken
            for phase, seconds in enumerate((max(t - started, 0.0), max(now - t, 0.0), max(now - started, 0.0))):
                counts, total, n = hist.get((kind, outcome, phase), ([0] * (len(LATENCY_BOUNDS) + 1), 0.0, 0))
                counts[bisect.bisect_left(LATENCY_BOUNDS, seconds)] += 1
                hist[(kind, outcome, phase)] = (counts, total + seconds, n + 1)
        assert {name: getattr(got, name) for name in want} == want
        assert set(got.latency) == {(k, o) for k, o, _ in hist}
        for (kind, outcome), phases in got.latency.items():
            for phase, h in enumerate(phases):
                counts, total, n = hist[(kind, outcome, phase)]
                assert (h.counts, h.count) == (counts, n) and h.sum == pytest.approx(total, rel=1e-9, abs=1e-9)


def test_latency_quantiles_check_q():
    h = kvoffload.LatencyHistogram(bounds=(1.0, 2.0), counts=(1, 1, 0), sum=2.5, count=2)
    assert h.quantile(0.5) == 1.0 and h.quantile(1) == 2.0 and h.quantile(0) == 1.0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="q must be in"):
            h.quantile(bad)
    with pytest.raises(TypeError):
        h.quantile("0.5")  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_loads_per_source_tier_evictions_per_tier_and_disk_bytes(tmp_path):
    caches = random_caches(16, seed=51)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    async with kvoffload.Offloader(caches, host_blocks=2, disk_path=tmp_path / "kv", disk_blocks=2) as off:
        for i in range(4):
            await off.store({i: i})  # the two oldest spill to disk
        s = off.stats()
        assert (s.spilled, s.disk_ready, s.host_ready) == (2, 2, 2) and s.disk_bytes_written == 2 * slot
        await off.load({i: 8 + i for i in range(4)})
        s = off.stats()
        assert (s.keys_loaded_from_host, s.keys_loaded_from_disk) == (2, 2) and s.disk_bytes_read == 2 * slot
        for i in range(4, 7):
            await off.store({i: i})  # host full and disk full: the disk's oldest go, then host entries spill
        s = off.stats()
        assert s.evicted == s.evicted_host + s.evicted_disk and s.evicted_disk > 0, s
    async with kvoffload.Offloader(caches, host_blocks=2) as off:  # no disk: host entries are evicted
        for i in range(3):
            await off.store({i: i})
        assert (off.stats().evicted_host, off.stats().evicted_disk) == (1, 0)


@pytest.mark.asyncio
async def test_disk_io_errors_are_counted(tmp_path, faults):
    caches = random_caches(8, seed=52)
    async with kvoffload.Offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=8) as off:
        faults.fail(off, "pwritev", OSError(errno.EIO, "Input/output error"))
        with pytest.raises(kvoffload.TransferError):
            await off.store({"a": 0})
        faults.restore()
        await off.store({"b": 1})
        s = off.stats()
        assert s.disk_io_errors >= 1 and s.failed == 1 and s.disk_bytes_written > 0


@pytest.mark.asyncio
async def test_a_spill_whose_victim_was_discarded_meanwhile_is_not_counted(tmp_path, faults):
    caches = random_caches(8, seed=54)
    slot = kvoffload.BlockLayout.of(caches).slot_bytes
    async with kvoffload.Offloader(caches, host_blocks=1, disk_path=tmp_path / "kv", disk_blocks=4, chunk_bytes=slot) as off:
        await off.store({"victim": 0})
        gate = faults.gate(off, "pwritev")
        store = off.store({"heir": 1})  # spills "victim" to disk first
        await asyncio.to_thread(gate.wait_entered)
        assert off.discard(["victim"]) == 1  # discarded while its bytes are written
        gate.open()
        await store
        s = off.stats()
        assert s.spilled == 0 and s.disk_ready == 0 and "victim" not in off, s
        await off.store({"next": 2})  # a spill that moves its victim is counted
        assert off.stats().spilled == 1


@pytest.mark.asyncio
async def test_a_cancelled_store_counts_the_bytes_it_left_stored(faults):
    caches = random_caches(32, seed=53)
    block = kvoffload.BlockLayout.of(caches).block_bytes
    async with kvoffload.Offloader(caches, host_blocks=16, chunk_bytes=kvoffload.BlockLayout.of(caches).slot_bytes) as off:
        gate = faults.gate(off, "to_host")
        t = off.store({i: i for i in range(8)})
        gate.allow(3)
        await gate.entered_async(count=4)
        t.cancel()
        gate.open()
        with pytest.raises(kvoffload.TransferCancelled):
            await t
        visible = off.lookup(range(8))
        s = off.stats()
        assert visible >= 3 and s.bytes_stored_partially == visible * block and s.bytes_stored == 0, s


@pytest.mark.asyncio
async def test_latency_histograms_per_kind_outcome_and_phase(faults):
    async with kvoffload.Offloader(random_caches(16, seed=54), host_blocks=16) as off:
        for i in range(5):
            await off.store({i: i})
        await off.load({0: 10, 1: 11})
        gate = faults.gate(off, "to_host")
        t = off.store({"x": 5})
        await gate.entered_async()
        t.cancel()
        gate.open()
        with pytest.raises(kvoffload.TransferCancelled):
            await t
        lat = off.stats().latency
        assert {k: h.count for k, h in lat.items() if k[2] == "total"} == {
            ("store", "done", "total"): 5, ("load", "done", "total"): 1, ("store", "cancelled", "total"): 1,
        }
        for kind, outcome in [("store", "done"), ("load", "done"), ("store", "cancelled")]:
            q, c, total = (lat[(kind, outcome, p)] for p in ("queue", "copy", "total"))
            assert q.count == c.count == total.count and sum(total.counts) == total.count
            assert q.sum + c.sum == pytest.approx(total.sum, rel=1e-6, abs=1e-9)  # the phases add up
            assert 0 < total.quantile(0.5) <= total.quantile(1.0) and total.sum > 0


def test_prometheus_collector_exposes_the_documented_names():
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvoffload.prometheus import OffloaderCollector

    with kvoffload.Offloader(random_caches(8, seed=55), host_blocks=4) as off:
        off.store({"a": 0, "b": 1}).result()
        off.load({"a": 5}).result()
        off.lookup(["a", "b", "c"])
        registry = prometheus_client.CollectorRegistry()
        registry.register(OffloaderCollector(off, name="gpu0"))
        get = registry.get_sample_value
        labels = {"offloader": "gpu0"}
        assert get("kvoffload_transfers_total", {**labels, "kind": "store", "outcome": "done"}) == 1
        assert get("kvoffload_transfers_total", {**labels, "kind": "load", "outcome": "done"}) == 1
        assert get("kvoffload_transfer_seconds_count", {**labels, "kind": "load", "outcome": "done", "phase": "total"}) == 1
        assert get("kvoffload_transfer_seconds_bucket", {**labels, "kind": "load", "outcome": "done", "phase": "total", "le": "+Inf"}) == 1
        assert get("kvoffload_lookups_total", labels) == 1 and get("kvoffload_lookup_hit_keys_total", labels) == 2
        assert get("kvoffload_loaded_keys_total", {**labels, "tier": "host"}) == 1
        assert get("kvoffload_stored_bytes_total", labels) == 2 * off.layout.block_bytes
        assert get("kvoffload_ready_keys", {**labels, "tier": "host"}) == 2
        assert get("kvoffload_free_slots", {**labels, "tier": "host"}) == 2
        assert get("kvoffload_transfers_in_flight", labels) == 0
        text = prometheus_client.generate_latest(registry).decode()
    documented = _documented_metric_names()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    exported = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum").removesuffix("_created") for n in exported}
    assert exported == documented, f"exported but not documented: {exported - documented}; documented only: {documented - exported}"


def test_two_offloaders_in_one_registry_are_scraped_each_under_its_own_label():
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_text
    from prometheus_client.openmetrics.parser import text_string_to_metric_families
    from kvoffload.prometheus import OffloaderCollector, register

    registry = prometheus_client.CollectorRegistry(auto_describe=True)  # checks names, as the default REGISTRY does
    with kvoffload.Offloader(random_caches(8, seed=56), host_blocks=4) as first, \
            kvoffload.Offloader(random_caches(8, seed=57), host_blocks=6) as second, \
            kvoffload.Offloader(random_caches(8, seed=58), host_blocks=2) as named:
        first.store({"a": 0}).result()
        second.store({"a": 0, "b": 1}).result()
        assert register(first, registry=registry) is register(second, registry=registry)  # one collector per registry
        register(named, name="gpu1", registry=registry)
        get = registry.get_sample_value
        block = first.layout.block_bytes
        assert [get("kvoffload_slots", {"offloader": n, "tier": "host"}) for n in ("0", "1", "gpu1")] == [4, 6, 2]
        assert [get("kvoffload_stored_bytes_total", {"offloader": n}) for n in ("0", "1", "gpu1")] == [block, 2 * block, 0]
        assert get("kvoffload_transfers_total", {"offloader": "1", "kind": "store", "outcome": "done"}) == 1
        # One family per name, as a Prometheus server's strict (OpenMetrics) parser requires.
        families = list(text_string_to_metric_families(openmetrics_text(registry).decode()))
        slots = next(f for f in families if f.name == "kvoffload_slots")
        assert {(s.labels["offloader"], s.labels["tier"]) for s in slots.samples} == {
            (n, t) for n in ("0", "1", "gpu1") for t in ("host", "disk")}
        with pytest.raises(ValueError, match="gpu1"):
            register(first, name="gpu1", registry=registry)  # a name is one offloader's
        with pytest.raises(ValueError, match="Duplicated"):
            registry.register(OffloaderCollector(first))  # a second collector would repeat every name


def _documented_metric_names() -> set[str]:
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "how-to" / "metrics.md").read_text()
    section = page.split("\n## Prometheus\n", 1)[1].split("\n## ", 1)[0]
    rows = [row for row in section.splitlines() if row.startswith("| `kvoffload_")]
    return {row.split("`")[1] for row in rows if "(with `remote=`)" not in row}  # an offloader without a remote tier
