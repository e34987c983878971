"""Time each step of CudaMover.to_host / to_device (GPU machine; not part of the suite)."""
import time, torch
from kvoffload.layout import BlockLayout, runs
from kvoffload.cuda.mover import CudaMover
from kvoffload.hostmem import HostBuffer
from kvoffload.demo import make_cache

caches = make_cache(256, 32, torch.device("cuda"))
L = BlockLayout.of(caches)
m = CudaMover(L, caches, chunk_bytes=64 << 20)
hb = HostBuffer(256 * L.slot_bytes, pin=True)
rows = hb.tensor.view(256, L.slot_bytes)
idx = torch.randperm(256, device="cuda")[:32]
st = torch.empty((32, L.slot_bytes), dtype=torch.uint8, device="cuda")
p0, r0 = m._pieces[3], m._rows[3]
view = st[:, p0.offset:p0.offset + p0.nbytes]
try:
    torch.index_select(r0, 0, idx, out=view)
    print("index_select out=noncontig ok:", torch.equal(view, r0[idx]), view.data_ptr() == st.data_ptr() + p0.offset)
except Exception as e:
    print("index_select out=noncontig fails:", e)
for n in (1, 4, 32):
    ids = list(range(n)); rr = list(range(100, 100 + n))
    for _ in range(20): m.to_host(ids, rows, rr); m.to_device(rows, rr, ids)
    torch.cuda.synchronize()
    for name, fn in [
        ("to_host", lambda: m.to_host(ids, rows, rr)),
        ("to_device", lambda: m.to_device(rows, rr, ids)),
        ("_index", lambda: m._index(ids)),
        ("runs", lambda: runs(rr)),
        ("_dma", lambda: m._dma(m._staging[0], rows, rr, True)),
        ("_direct_dma", lambda: m._direct_dma(ids, rows, rr, True)),
        ("event", lambda: m._record(m.copy_stream)),
        ("gather", lambda: [m._staging[0][:n, p.offset:p.offset + p.nbytes].copy_(r.index_select(0, torch.arange(n, device='cuda'))) for p, r in zip(m._pieces, m._rows)]),
        ("stream ctx", lambda: torch.cuda.stream(m.kernel_stream).__enter__()),
    ]:
        torch.cuda.synchronize()
        t0 = time.perf_counter(); k = 100
        for _ in range(k): fn()
        dt = (time.perf_counter() - t0) / k
        torch.cuda.synchronize()
        print(f"n={n:3d} {name:10s} {dt * 1e6:8.1f} us")
