"""Where does a one-block store spend its time? (GPU machine; not part of the suite)"""
import asyncio, time, cProfile, pstats, io
import torch
import kvoffload

caches = {"k": torch.zeros((64, 16384), dtype=torch.uint8, device="cuda")}

from kvoffload.cuda.mover import CudaMover
from kvoffload.tiers.host import HostTier
spent = {"to_host": [], "run_store": []}
def timed(name, fn, is_async=False):
    if is_async:
        async def w(*a, **k):
            t0 = time.perf_counter(); r = await fn(*a, **k); spent[name].append(time.perf_counter() - t0); return r
    else:
        def w(*a, **k):
            t0 = time.perf_counter(); r = fn(*a, **k); spent[name].append(time.perf_counter() - t0); return r
    return w
CudaMover.to_host = timed("to_host", CudaMover.to_host)
HostTier.run_store = timed("run_store", HostTier.run_store, True)
def step_times():
    s = torch.cuda.Stream()
    ids = [3]
    def t(fn, n=200):
        fn(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n): fn()
        dt = (time.perf_counter() - t0) / n
        torch.cuda.synchronize()
        return dt * 1e6
    print("event create+record us", t(lambda: torch.cuda.Event(blocking=True).record(s)))
    print("pin_memory us", t(lambda: torch.tensor(ids, dtype=torch.int64).pin_memory()))
    print("pin+to us", t(lambda: torch.tensor(ids, dtype=torch.int64).pin_memory().to("cuda", non_blocking=True)))
    print("as_tensor cuda us", t(lambda: torch.as_tensor(ids, device="cuda")))
    idx = torch.tensor(ids, device="cuda")
    st = torch.empty((4, 16384), dtype=torch.uint8, device="cuda")
    print("index_select+copy us", t(lambda: st[:1, :].copy_(caches["k"].index_select(0, idx))))

async def e2e(kind, n=300):
    async with kvoffload.Offloader(caches, host_blocks=n + 1, completion=kind) as off:
        for i in range(20):
            await off.store({("w", i): i})
        pr = cProfile.Profile()
        lat = []
        pr.enable()
        for i in range(n):
            t0 = time.perf_counter()
            await off.store({i: i % 64})
            lat.append(time.perf_counter() - t0)
        pr.disable()
        lat.sort()
        print(kind, "p50 us", lat[n // 2] * 1e6)
        for k, v in spent.items():
            v.sort(); print("  worker", k, "p50 us", v[len(v) // 2] * 1e6 if v else None); v.clear()
        sio = io.StringIO(); pstats.Stats(pr, stream=sio).sort_stats("cumulative").print_stats(15); print(sio.getvalue()[:3000])

from kvoffload.cuda.mover import CudaMover
from kvoffload.tiers.host import HostTier
spent = {"to_host": [], "run_store": []}
def timed(name, fn, is_async=False):
    if is_async:
        async def w(*a, **k):
            t0 = time.perf_counter(); r = await fn(*a, **k); spent[name].append(time.perf_counter() - t0); return r
    else:
        def w(*a, **k):
            t0 = time.perf_counter(); r = fn(*a, **k); spent[name].append(time.perf_counter() - t0); return r
    return w
CudaMover.to_host = timed("to_host", CudaMover.to_host)
HostTier.run_store = timed("run_store", HostTier.run_store, True)
step_times()
for kind in ("poll", "thread"):
    asyncio.run(e2e(kind))
