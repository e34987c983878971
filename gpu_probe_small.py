import asyncio, time, torch, threading, cProfile, pstats, io
from kvoffload import Offloader
from kvoffload.bench import _in_flight_rate
caches = {"kv": torch.randint(0, 255, (4096, 64 << 10), dtype=torch.uint8, device="cuda")}
def T(label, fn, n=2000):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{label}: {dt:.1f} us")
with Offloader(caches, host_blocks=30000) as off:
    rt = off._runtime; w = rt.workers[0]; cp = w.copier
    T("caller_event", cp.caller_event)
    ev = cp.caller_event()
    T("wait_for", lambda: cp.wait_for(ev))
    rows = rt.storage.host.rows
    T("to_host 1 block", lambda: cp.to_host([5], rows, [7]))
    T("torch.cuda.current_stream", lambda: torch.cuda.current_stream(torch.device("cuda")))
    from kvoffload._core.cuda.driver import DriverEvent
    T("DriverEvent()", lambda: DriverEvent(0))
    e = DriverEvent(0).record(cp._cstream)
    T("event.query", e.query)
    k = [0]
    def st():
        k[0] += 1
        return off.store({("a", k[0]): k[0] % 4096})
    T("store() call", st, 3000)
    torch.cuda.synchronize(); time.sleep(0.2)
    # latency breakdown with per-thread profiles
    async def main():
        lat = []
        pc = cProfile.Profile(); pc.enable()
        for i in range(300):
            await asyncio.sleep(0.0005)
            t0 = time.perf_counter(); await off.store({("b", i): i % 64}); lat.append(time.perf_counter() - t0)
        pc.disable()
        lat.sort(); print("one-block store latency p50 us", lat[len(lat)//2]*1e6)
        s = io.StringIO(); pstats.Stats(pc, stream=s).sort_stats("tottime").print_stats(16); print("=== latency", s.getvalue()[:4000])
        r = await _in_flight_rate(lambda i: off.store({("c", i): i % 4096}), 5000)
        print("64 in flight rate", r)
        pc = cProfile.Profile(); pc.enable()
        r = await _in_flight_rate(lambda i: off.store({("d", i): i % 4096}), 5000)
        pc.disable()
        print("64 in flight rate (profiled)", r)
        s = io.StringIO(); pstats.Stats(pc, stream=s).sort_stats("tottime").print_stats(22); print("=== inflight", s.getvalue()[:5000])
    asyncio.run(main())
