import asyncio, time, torch, statistics
from kvoffload import Offloader
from kvoffload._core.cuda.driver import DriverEvent
caches = {"kv": torch.randint(0, 255, (4096, 64 << 10), dtype=torch.uint8, device="cuda")}
def p50(xs): return f"{statistics.median(xs) * 1e6:.0f}"
with Offloader(caches, host_blocks=8000) as off:
    rt = off._runtime; w = rt.workers[0]; cp = w.copier; rows = rt.storage.host.rows
    a, b, c, d = [], [], [], []
    for i in range(300):
        time.sleep(0.0005)
        t0 = time.perf_counter(); ev = cp.caller_event(); cp.wait_for(ev); e = cp.to_host([i % 64], rows, [i])
        while not e.query(): pass
        a.append(time.perf_counter() - t0)
    for i in range(300):
        time.sleep(0.0005)
        t0 = time.perf_counter(); off.store({("r", i): i % 64}).result(); b.append(time.perf_counter() - t0)
    import threading
    for i in range(300):
        time.sleep(0.0005)
        t0 = time.perf_counter(); t = off.store({("s", i): i % 64})
        while not t.done(): pass
        c.append(time.perf_counter() - t0)
    for i in range(300):
        time.sleep(0.0005)
        t0 = time.perf_counter(); t = off.store({("t", i): i % 64}); d.append(time.perf_counter() - t0)
        t.result()
    print("caller_event+wait_for+to_host+spin", p50(a), "| store().result()", p50(b), "| store() spin on done()", p50(c), "| store() call alone", p50(d))
for kind in ("poll", "thread"):
    with Offloader(caches, host_blocks=8000, completion=kind) as off:
        async def main():
            lat = []
            for i in range(300):
                await asyncio.sleep(0.0005)
                t0 = time.perf_counter(); await off.store({("b", i): i % 64}); lat.append(time.perf_counter() - t0)
            lat2 = []
            for i in range(300):
                time.sleep(0.0005)
                t0 = time.perf_counter(); await off.store({("c", i): i % 64}); lat2.append(time.perf_counter() - t0)
            return lat, lat2
        lat, lat2 = asyncio.run(main())
        print(kind, "await after asyncio.sleep", p50(lat), "| await after time.sleep", p50(lat2))
