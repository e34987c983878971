"""Throwaway device experiments: small-transfer throughput by bridge, both-directions by chunk size."""
import asyncio, sys, time
import torch
import kvoffload
from kvoffload.cuda import events

def small(kind, count=5000, yield_gil=False, switch=None):
    if switch: sys.setswitchinterval(switch)
    events.PollBridge.yield_gil = yield_gil
    caches = {"kv": torch.randint(0, 255, (4096, 64 << 10), dtype=torch.uint8, device="cuda")}
    async def run():
        async with kvoffload.Offloader(caches, host_blocks=count + 8, completion=kind) as off:
            await asyncio.gather(*(off.store({("w", i): i}) for i in range(8)))
            c0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(off.store({i: i % 4096}) for i in range(count)))
            dt = time.perf_counter() - t0
            t1 = time.perf_counter()
            ts = [off.store({("x", i): i % 4096}) for i in range(count)]
            submit = time.perf_counter() - t1
            await asyncio.gather(*ts)
            return count / dt, (time.process_time() - c0) / count / 2 * 1e6, submit / count * 1e6
    r = asyncio.run(run())
    sys.setswitchinterval(0.005)
    print(f"small kind={kind} yield={yield_gil} switch={switch}: {r[0]:.0f}/s, {r[1]:.0f} us CPU/transfer, submit {r[2]:.1f} us/call", flush=True)

def one_latency(kind, n=300):
    caches = {"k": torch.zeros((64, 64 << 10), dtype=torch.uint8, device="cuda")}
    async def run():
        lat = []
        async with kvoffload.Offloader(caches, host_blocks=n + 1, completion=kind) as off:
            for i in range(n):
                await asyncio.sleep(0.0002)
                t0 = time.perf_counter()
                t = off.store({i: i % 64})
                t1 = time.perf_counter()
                await t
                lat.append((time.perf_counter() - t0, t1 - t0))
        lat.sort()
        return lat[n // 2]
    tot, call = asyncio.run(run())
    print(f"one-block {kind}: total {tot*1e6:.0f} us, store() call {call*1e6:.0f} us", flush=True)

def both(chunk_mib, gib=2.0):
    from kvoffload.bench import Layout
    lay = Layout()
    n = lay.blocks_for(gib)
    caches = lay.cache(2 * n, torch.device("cuda"))
    with kvoffload.Offloader(caches, host_blocks=2 * n, chunk_bytes=chunk_mib << 20) as off:
        off.store({i: i for i in range(n)}).result()
        best = 0
        for _ in range(3):
            off.discard(range(n, 2 * n)); torch.cuda.synchronize()
            t0 = time.perf_counter()
            a = off.store({i: i for i in range(n, 2 * n)}); b = off.load({i: i for i in range(n)})
            ra, rb = a.result(), b.result()
            best = max(best, 2 * n * lay.block_bytes / (time.perf_counter() - t0) / 1e9)
        print(f"both chunk={chunk_mib} MiB: {best:.1f} GB/s (store alone {ra.gbps:.1f} load alone-ish {rb.gbps:.1f})", flush=True)

for kind in ("poll", "thread"):
    one_latency(kind)
small("poll"); small("thread"); small("poll", yield_gil=True); small("poll", switch=0.0002)
for c in (64, 128, 256):
    both(c)
