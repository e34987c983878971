"""The compiled piece copies (``_core/base/piece_copies.c``): what they copy, the descriptors and
launches they hand the driver, and their refusals of bad input. The driver is stood in for by
ctypes callbacks that record their arguments, so every path runs on a machine without CUDA."""

from __future__ import annotations

import ctypes
import random
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kvoffload._core.base.piece_copies import ChunkCopies, context_status, enqueue_pieces, enqueue_ring, enqueue_runs, memcpy_pieces

SLOT = 4096


def cache_and_table(blocks: int = 12, seed: int = 0) -> tuple[list[torch.Tensor], np.ndarray, int]:
    """Three cache tensors of different piece sizes (one of them strided), their piece table, and
    the bytes of a block's pieces back to back."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(0, 256, (blocks, 2, 700), dtype=torch.uint8, generator=g)
    tensors = [
        torch.randint(0, 256, (blocks, 1000), dtype=torch.uint8, generator=g),
        torch.randint(0, 256, (blocks, 24), dtype=torch.uint8, generator=g),
        full[:, 1],  # rows 1400 bytes apart, 700 long
    ]
    table, offset = [], 0
    for t in tensors:
        table.append((t.data_ptr(), t.stride(0), offset, t.shape[1]))
        offset += t.shape[1]
    return tensors, np.array(table, dtype=np.uint64), offset


def test_memcpy_pieces_round_trips_random_blocks_and_rows() -> None:
    tensors, table, used = cache_and_table()
    rng = random.Random(1)
    ids = rng.sample(range(12), 7)
    rows = rng.sample(range(20), 7)
    host = torch.zeros((20, SLOT), dtype=torch.uint8)
    memcpy_pieces(True, host.data_ptr(), host.stride(0), ids, rows, table, 0)
    for b, r in zip(ids, rows):
        assert torch.equal(host[r, :used], torch.cat([t[b] for t in tensors])), (b, r)
        assert not host[r, used:].any(), "bytes past the pieces were written"
    untouched = sorted(set(range(20)) - set(rows))
    assert not host[untouched].any()

    originals = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    memcpy_pieces(False, host.data_ptr(), host.stride(0), ids, rows, table, 0)
    for t, o in zip(tensors, originals):
        assert torch.equal(t[ids], o[ids])
        others = sorted(set(range(12)) - set(ids))
        assert not t[others].any(), "blocks not named were written"


def test_memcpy_pieces_takes_numpy_ids_and_ranges() -> None:
    tensors, table, used = cache_and_table()
    host = torch.zeros((4, SLOT), dtype=torch.uint8)
    memcpy_pieces(True, host.data_ptr(), SLOT, np.array([3, 5], dtype=np.int64), range(2, 4), table.tobytes(), 0)
    assert torch.equal(host[3, :used], torch.cat([t[5] for t in tensors]))


@pytest.mark.parametrize("release_gil_bytes, released", [(0, False), (1 << 40, False), (1 << 20, True)])
def test_memcpy_pieces_releases_the_gil_only_for_copies_of_release_gil_bytes(release_gil_bytes, released) -> None:
    blocks, piece = 64, 1 << 20  # 64 MiB, copied 8 times: long enough for another thread to run meanwhile on a loaded machine
    cache = torch.ones((blocks, piece), dtype=torch.uint8)
    table = np.array([(cache.data_ptr(), piece, 0, piece)], dtype=np.uint64)
    host = torch.zeros((blocks, piece), dtype=torch.uint8)
    counted, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1
            if counted[0] % 1000 == 0:
                time.sleep(1e-4)  # lets the copying thread take the GIL between copies

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # before any thread waits: the GIL changes hands only where a thread gives it up
    counter = threading.Thread(target=count)
    try:
        counter.start()
        while not counted[0]:
            time.sleep(1e-3)
        before = counted[0]
        for _ in range(8):  # the GIL kept between the calls: a Python loop gives it up nowhere
            memcpy_pieces(True, host.data_ptr(), piece, range(blocks), range(blocks), table, release_gil_bytes)
        during = counted[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        counter.join()
    assert host.all(), "not every byte was copied"
    assert (during > 0) == released, f"the other thread counted {during} during the copies"


@pytest.mark.parametrize(
    "ids, rows, table, error",
    [
        ([1, 2], [1], None, ValueError),  # lengths differ
        ([-1], [0], None, OverflowError),
        ([1.5], [0], None, TypeError),
        ([1], ["0"], None, TypeError),
        ([1], [0], b"\0" * 24, ValueError),  # not 4 uint64 per piece
        (5, [0], None, TypeError),
    ],
)
def test_memcpy_pieces_refuses_bad_input_and_copies_nothing(ids, rows, table, error) -> None:
    tensors, good, _ = cache_and_table()
    host = torch.zeros((4, SLOT), dtype=torch.uint8)
    with pytest.raises(error):
        memcpy_pieces(True, host.data_ptr(), SLOT, ids, rows, good if table is None else table, 1)
    assert not host.any()


# -- the driver, stood in for --------------------------------------------------------------------

BATCH = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
    ctypes.c_size_t, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
    ctypes.c_void_p,
)
ONE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
    ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
)


class StandInCopies:
    """Records what the C code hands cuMemcpyBatchAsync or cuMemcpyAsync; ``fail_at``: the copy whose
    enqueueing fails (error 1)."""

    def __init__(self, batched: bool, fail_at: int | None = None) -> None:
        self.copies: list[tuple[int, int, int]] = []
        self.calls: list[int] = []  # the stream of each call
        self.fail_at = fail_at
        self.attrs = ctypes.c_uint64(0)
        self._batch = BATCH(self._on_batch)
        self._one = ONE(self._on_one)
        address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        self.functions = (address(self._batch) if batched else 0, address(self._one), ctypes.addressof(self.attrs))

    def _on_batch(self, dsts, srcs, sizes, n, attrs, attrs_idx, num_attrs, fail_idx, stream) -> int:
        assert attrs == ctypes.addressof(self.attrs) and num_attrs == 1 and attrs_idx[0] == 0
        self.calls.append(stream)
        self.copies += [(dsts[i], srcs[i], sizes[i]) for i in range(n)]
        if self.fail_at is not None:
            fail_idx[0] = self.fail_at
            return 1
        return 0

    def _on_one(self, dst, src, size, stream) -> int:
        self.calls.append(stream)
        if self.fail_at == len(self.copies):
            return 1
        self.copies.append((dst, src, size))
        return 0


def expected_pieces(table: np.ndarray, host: int, ids: list[int], rows: list[int], to_host: bool, pieces: range) -> list[tuple[int, int, int]]:
    out = []
    for b, r in zip(ids, rows):
        for j in pieces:
            base, stride, offset, nbytes = (int(x) for x in table[j])
            cache, h = base + b * stride, host + r * SLOT + offset
            out.append((h, cache, nbytes) if to_host else (cache, h, nbytes))
    return out


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("blocks", [1, 3, 40])  # 40 blocks x 3 pieces: past the descriptors kept on the stack
def test_enqueue_pieces_hands_the_driver_one_copy_per_block_and_piece(batched, to_host, blocks) -> None:
    _tensors, table, _ = cache_and_table(blocks=64)
    driver = StandInCopies(batched)
    ids = random.Random(blocks).sample(range(64), blocks)
    rows = list(range(100, 100 + blocks))
    assert enqueue_pieces(driver.functions, 77, to_host, 1 << 40, SLOT, ids, rows, table, 0, 3) is None
    assert driver.copies == expected_pieces(table, 1 << 40, ids, rows, to_host, range(3))
    assert driver.calls == ([77] if batched else [77] * (3 * blocks))


def test_enqueue_pieces_of_a_span_of_tensors() -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInCopies(batched=True)
    enqueue_pieces(driver.functions, 1, False, 4096, SLOT, [4, 2], [0, 9], table, 1, 3)
    assert driver.copies == expected_pieces(table, 4096, [4, 2], [0, 9], False, range(1, 3))


@pytest.mark.parametrize("batched", [True, False])
def test_enqueue_reports_the_driver_error_and_the_copy_it_failed_on(batched) -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInCopies(batched, fail_at=4)
    assert enqueue_pieces(driver.functions, 1, True, 0, SLOT, [0, 1, 2], [0, 1, 2], table, 0, 3) == (1, "copy", 4)
    if not batched:
        assert len(driver.copies) == 4, "copies after the failed one were enqueued"


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("to_host", [True, False])
def test_enqueue_runs_hands_the_driver_one_copy_per_run_of_rows(batched, to_host) -> None:
    driver = StandInCopies(batched)
    rows = [5, 6, 7, 9, 3, 4, 100] + list(range(200, 300))
    assert enqueue_runs(driver.functions, 3, to_host, 1 << 30, 1 << 20, SLOT, rows) is None
    runs = [(0, 5, 3), (3, 9, 1), (4, 3, 2), (6, 100, 1), (7, 200, 100)]  # (staging row, host row, rows)
    want = []
    for stage, host, n in runs:
        h, s = (1 << 30) + host * SLOT, (1 << 20) + stage * SLOT
        want.append((h, s, n * SLOT) if to_host else (s, h, n * SLOT))
    assert driver.copies == want


def test_enqueue_refuses_bad_input_without_calling_the_driver() -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInCopies(batched=True)
    with pytest.raises(ValueError, match="pieces"):
        enqueue_pieces(driver.functions, 1, True, 0, SLOT, [0], [0], table, 2, 4)  # past the table
    with pytest.raises(ValueError):
        enqueue_pieces(driver.functions, 1, True, 0, SLOT, [0, 1], [0], table, 0, 3)
    with pytest.raises(ValueError, match="no copy function"):
        enqueue_runs((0, 0, 0), 1, True, 0, 0, SLOT, [0])
    with pytest.raises(TypeError):
        enqueue_runs([1, 2, 3], 1, True, 0, 0, SLOT, [0])
    with pytest.raises(OverflowError):
        enqueue_runs(driver.functions, 1, True, 0, 0, SLOT, [0, -3])
    assert driver.calls == []


RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
K, C, BETWEEN, FREE, DONE = 11, 22, 33, 44, 55  # the kernel and copy streams, and events
STAGING = (1 << 36, 1 << 37)


class StandInDriver(StandInCopies):
    """Records, in order, every call a :class:`ChunkCopies` makes: stream waits, event records, copies
    and kernel launches (with the kernel parameters as they were at the launch); ``fail``: the call
    (name, occurrence) that returns error 9."""

    def __init__(self, batched: bool = True, max_blocks: int = 4, fail: tuple[str, int] | None = None) -> None:
        super().__init__(batched)
        self.log: list[tuple] = []
        self.fail = fail
        self._seen: dict[str, int] = {}

        class Blocks(ctypes.Structure):
            _fields_ = [("n", ctypes.c_int), ("first", ctypes.c_int), ("ids", ctypes.c_int * max_blocks)]

        self.blocks = Blocks()
        self.params = (ctypes.c_void_p * 1)(ctypes.addressof(self.blocks))
        self.staging, self.gather = ctypes.c_uint64(0), ctypes.c_int(-1)
        self.cancel, self.generation = ctypes.c_uint64(0), ctypes.c_int(0)
        self._record, self._wait, self._launch = RECORD(self._on_record), WAIT(self._on_wait), LAUNCH(self._on_launch)
        self.max_blocks = max_blocks

    def _result(self, call: str) -> int:
        self._seen[call] = self._seen.get(call, 0) + 1
        return 9 if self.fail == (call, self._seen[call] - 1) else 0

    def _on_record(self, event, stream) -> int:
        self.log.append(("record", event, stream))
        return self._result("record")

    def _on_wait(self, stream, event, flags) -> int:
        assert flags == 0
        self.log.append(("wait", stream, event))
        return self._result("wait")

    def _on_batch(self, dsts, srcs, sizes, n, attrs, attrs_idx, num_attrs, fail_idx, stream) -> int:
        self.log.append(("copies", stream, [(dsts[i], srcs[i], sizes[i]) for i in range(n)]))
        err = self._result("copies")
        fail_idx[0] = 1 if err else 0
        return err

    def _on_launch(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
        assert (f, gy, gz, by, bz, shared, extra, params) == (1234, 1, 1, 1, 1, 0, None, ctypes.addressof(self.params))
        b = self.blocks
        self.log.append(("launch", stream, gx, bx, b.first, list(b.ids[: b.n]), self.staging.value, self.gather.value,
                         self.cancel.value, self.generation.value))
        return self._result("launch")

    def chunk_copies(self, table: np.ndarray, kernel: bool = True, max_ctas: int = 0) -> ChunkCopies:
        address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        a = ctypes.addressof
        params = (address(self._launch), 1234, a(self.params), a(self.blocks), self.max_blocks, len(table), 256, max_ctas,
                  a(self.staging), a(self.gather), a(self.cancel), a(self.generation))
        return ChunkCopies(self.functions, address(self._record), address(self._wait), K, C, BETWEEN, SLOT, table, STAGING,
                           params if kernel else None)


def runs_of(rows: list[int], host: int, staging: int, to_host: bool) -> list[tuple[int, int, int]]:
    out, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            h, st, n = host + rows[start] * SLOT, staging + start * SLOT, (i - start) * SLOT
            out.append((h, st, n) if to_host else (st, h, n))
            start = i
    return out


def test_chunk_copies_store_staged_waits_gathers_then_copies_runs_to_host() -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    chunks = driver.chunk_copies(table)
    rows, ids = [7, 8, 9, 2], [5, 1, 9, 3]
    assert chunks.copy(True, False, 1 << 30, rows, ids, 1, FREE, DONE, 777, 3, False, None) is None
    assert driver.log == [
        ("wait", K, FREE),  # the staging buffer's last use
        ("launch", K, 12, 256, 0, ids, STAGING[1], 1, 777, 3),  # a CTA per piece, gathering, the cancel flag
        ("record", BETWEEN, K),
        ("wait", C, BETWEEN),
        ("copies", C, runs_of(rows, 1 << 30, STAGING[1], True)),
        ("record", DONE, C),
    ]


def test_chunk_copies_load_staged_copies_runs_then_scatters() -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    chunks = driver.chunk_copies(table, max_ctas=5)
    rows, ids = [3, 4, 0, 1, 2, 9], [10, 11, 4, 5, 6, 0]
    assert chunks.copy(False, False, 4096, rows, ids, 0, 0, DONE, 0, 0, False, None) is None  # no last use to wait for
    assert driver.log == [
        ("copies", C, runs_of(rows, 4096, STAGING[0], False)),
        ("record", BETWEEN, C),
        ("wait", K, BETWEEN),
        ("launch", K, 5, 256, 0, ids[:4], STAGING[0], 0, 0, 0),  # max_blocks 4 ids per launch, CTAs capped at 5
        ("launch", K, 5, 256, 4, ids[4:], STAGING[0], 0, 0, 0),
        ("record", DONE, K),
    ]


def test_chunk_copies_on_one_stream_store_gathers_then_copies_on_the_copy_stream() -> None:
    """One stream (a chunk short of full): every call on the stream the store ends on, no event between."""
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    rows, ids = [7, 8, 9, 2], [5, 1, 9, 3]
    assert driver.chunk_copies(table).copy(True, False, 1 << 30, rows, ids, 1, FREE, DONE, 777, 3, True, None) is None
    assert driver.log == [
        ("wait", C, FREE),
        ("launch", C, 12, 256, 0, ids, STAGING[1], 1, 777, 3),
        ("copies", C, runs_of(rows, 1 << 30, STAGING[1], True)),
        ("record", DONE, C),
    ]


def test_chunk_copies_on_one_stream_load_copies_then_scatters_on_the_kernel_stream() -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    rows, ids = [3, 4, 0], [10, 11, 4]
    assert driver.chunk_copies(table).copy(False, False, 4096, rows, ids, 0, FREE, DONE, 0, 0, True, None) is None
    assert driver.log == [
        ("wait", K, FREE),
        ("copies", K, runs_of(rows, 4096, STAGING[0], False)),
        ("launch", K, 9, 256, 0, ids, STAGING[0], 0, 0, 0),
        ("record", DONE, K),
    ]


@pytest.mark.parametrize("to_host", [True, False])
def test_chunk_copies_direct_on_one_stream_copies_on_the_stream_the_transfer_ends_on(to_host) -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    ids, rows = [4, 2], [0, 9]
    assert driver.chunk_copies(table, kernel=False).copy(to_host, True, 1 << 20, rows, ids, 0, 0, DONE, 0, 0, True, None) is None
    stream = C if to_host else K
    assert driver.log == [("copies", stream, expected_pieces(table, 1 << 20, ids, rows, to_host, range(3))), ("record", DONE, stream)]


@pytest.mark.parametrize("to_host", [True, False])
def test_chunk_copies_direct_copies_every_piece_on_the_copy_stream(to_host) -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    chunks = driver.chunk_copies(table, kernel=False)
    ids, rows = [4, 2], [0, 9]
    assert chunks.copy(to_host, True, 1 << 20, rows, ids, 0, 0, DONE, 0, 0, False, None) is None
    copies = ("copies", C, expected_pieces(table, 1 << 20, ids, rows, to_host, range(3)))
    if to_host:
        assert driver.log == [copies, ("record", DONE, C)]
    else:  # a load ends on the kernel stream, as staged ones do
        assert driver.log == [copies, ("record", BETWEEN, C), ("wait", K, BETWEEN), ("record", DONE, K)]


CALLER = 66  # the caller's current stream


@pytest.mark.parametrize("one_stream", [True, False], ids=["one stream", "full chunk"])
def test_chunk_copies_after_the_callers_stream_wait_for_it_on_the_stream_they_start_on(one_stream) -> None:
    """A transfer's first chunk waits for the caller's work so far (its own event recorded there) on
    the one stream it starts on: its other stream follows that one, and later chunks follow both."""
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    rows, ids = [7, 8, 9, 2], [5, 1, 9, 3]
    assert driver.chunk_copies(table).copy(True, False, 1 << 30, rows, ids, 1, FREE, DONE, 0, 0, one_stream, CALLER) is None
    first = C if one_stream else K
    assert driver.log[:3] == [("record", BETWEEN, CALLER), ("wait", first, BETWEEN), ("wait", first, FREE)]
    assert [c for c in driver.log if c[0] == "wait" and c[2] == BETWEEN and c[1] != first] == ([] if one_stream else [("wait", C, BETWEEN)])
    assert driver.log[-1] == ("record", DONE, C)


@pytest.mark.parametrize("caller", [CALLER, 0], ids=["a stream", "the legacy default stream"])
@pytest.mark.parametrize("to_host", [True, False])
def test_chunk_copies_direct_after_the_callers_stream_wait_on_the_stream_they_copy_on(to_host, caller) -> None:
    """The legacy default stream, torch's usual current stream, is handle 0: waited for like any
    other (None means no caller's stream)."""
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    ids, rows = [4, 2], [0, 9]
    assert driver.chunk_copies(table, kernel=False).copy(to_host, True, 1 << 20, rows, ids, 0, 0, DONE, 0, 0, True, caller) is None
    stream = C if to_host else K
    assert driver.log == [("record", BETWEEN, caller or None), ("wait", stream, BETWEEN),  # (ctypes passes a NULL handle as None)
                          ("copies", stream, expected_pieces(table, 1 << 20, ids, rows, to_host, range(3))), ("record", DONE, stream)]


def test_chunk_copies_on_one_stream_wait_for_a_staging_buffer_only_if_its_last_use_ended_elsewhere() -> None:
    """Stream order already keeps a chunk off a staging buffer that the last chunk through it still
    uses on the same stream: only a last use that ended on another stream (a store's buffer, then a
    load's), or one not known to have been enqueued whole (a failed chunk), is waited for."""
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    chunks = driver.chunk_copies(table)
    free_waits = lambda: [c for c in driver.log if c[0] == "wait" and c[2] == FREE]  # noqa: E731
    rows, ids = [0, 1], [2, 3]
    assert chunks.copy(True, False, 0, rows, ids, 0, FREE, DONE, 0, 0, False, None) is None  # a full store chunk: ends on the copy stream
    assert free_waits() == [("wait", K, FREE)]
    driver.log.clear()
    assert chunks.copy(True, False, 0, rows, ids, 0, FREE, DONE, 0, 0, True, None) is None  # a short one on the copy stream: no wait
    assert chunks.copy(True, False, 0, rows, ids, 0, FREE, DONE, 0, 0, True, None) is None
    assert free_waits() == [] and driver.log[-1] == ("record", DONE, C)
    assert chunks.copy(True, False, 0, rows, ids, 1, FREE, DONE, 0, 0, True, None) is None  # the other buffer: never used yet, waited for
    assert free_waits() == [("wait", C, FREE)]
    driver.log.clear()
    assert chunks.copy(False, False, 0, rows, ids, 0, FREE, DONE, 0, 0, True, None) is None  # a load on the kernel stream: waits
    assert chunks.copy(False, False, 0, rows, ids, 0, FREE, DONE, 0, 0, True, None) is None  # its last use ended there: none
    assert free_waits() == [("wait", K, FREE)]
    driver.log.clear()
    driver.fail = ("launch", driver._seen.get("launch", 0))  # the next launch fails: that chunk is not whole
    assert chunks.copy(False, False, 0, rows, ids, 0, FREE, DONE, 0, 0, True, None) is not None
    driver.fail = None
    driver.log.clear()
    assert chunks.copy(False, False, 0, rows, ids, 0, FREE, DONE, 0, 0, True, None) is None
    assert free_waits() == [("wait", K, FREE)]


def test_chunk_copies_wait_makes_both_streams_wait() -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    assert driver.chunk_copies(table).wait(FREE) is None
    assert driver.log == [("wait", K, FREE), ("wait", C, FREE)]


@pytest.mark.parametrize("fail, reported", [(None, None), (("record", 0), (9, "cuEventRecord", 0)), (("wait", 1), (9, "cuStreamWaitEvent", 0))])
def test_chunk_copies_wait_for_stream_records_there_then_both_streams_wait(fail, reported) -> None:
    """What a store or load enqueued at call time starts with: the caller's stream's work so far,
    marked by the copier's own event and waited for by both of its streams; the first failure stops it."""
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver(fail=fail)
    assert driver.chunk_copies(table).wait_for_stream(CALLER) == reported
    calls = [("record", BETWEEN, CALLER), ("wait", K, BETWEEN), ("wait", C, BETWEEN)]
    assert driver.log == (calls if fail is None else calls[: 1 + fail[1] + (fail[0] == "wait")])


HOST_FUNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


@pytest.mark.parametrize("fail", [None, "wait", "host function"])
def test_enqueue_ring_waits_for_the_event_then_enqueues_the_host_function(fail) -> None:
    log: list[tuple] = []

    def wait(stream, event, flags) -> int:
        log.append(("wait", stream, event, flags))
        return 7 if fail == "wait" else 0

    def launch(stream, fn, data) -> int:
        log.append(("host function", stream, fn, data))
        return 8 if fail == "host function" else 0

    callbacks = WAIT(wait), HOST_FUNC(launch)
    address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    outcome = enqueue_ring(address(callbacks[0]), address(callbacks[1]), 5, 6, 7, 8)
    assert outcome == {None: None, "wait": (7, "cuStreamWaitEvent", 0), "host function": (8, "cuLaunchHostFunc", 0)}[fail]
    expected = [("wait", 5, 6, 0), ("host function", 5, 7, 8)]
    assert log == (expected[:1] if fail == "wait" else expected)
    with pytest.raises(ValueError, match="is 0"):
        enqueue_ring(0, address(callbacks[1]), 5, 6, 7, 8)
    with pytest.raises(TypeError):
        enqueue_ring(1, 2, 3, 4, 5)
    assert len(log) == len(expected[:1] if fail == "wait" else expected)


CTX_GET_CURRENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))


@pytest.mark.parametrize("context, err, status", [(0x1234, 0, 0), (0, 0, -1), (0, 3, 3)])
def test_context_status_tells_a_current_context_from_none_and_from_an_error(context, err, status) -> None:
    def get_current(out) -> int:
        out[0] = context
        return err

    fn = CTX_GET_CURRENT(get_current)
    assert context_status(ctypes.cast(fn, ctypes.c_void_p).value) == status
    with pytest.raises(ValueError):
        context_status(0)


@pytest.mark.parametrize(
    "fail, reported, calls",
    [
        (("wait", 0), (9, "cuStreamWaitEvent", 0), 1),
        (("launch", 1), (9, "cuLaunchKernel(move_pieces)", 0), 3),
        (("record", 0), (9, "cuEventRecord", 0), 4),
        (("copies", 0), (9, "copy", 1), 6),
        (("record", 1), (9, "cuEventRecord", 0), 7),
    ],
)
def test_chunk_copies_stop_at_the_first_failed_call_and_report_it(fail, reported, calls) -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver(fail=fail)
    assert driver.chunk_copies(table).copy(True, False, 0, [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], 0, FREE, DONE, 0, 0, False, None) == reported
    assert len(driver.log) == calls, driver.log


def test_chunk_copies_refuse_bad_input_without_calling_the_driver() -> None:
    _tensors, table, _ = cache_and_table()
    driver = StandInDriver()
    with_kernel, without = driver.chunk_copies(table), driver.chunk_copies(table, kernel=False)
    with pytest.raises(ValueError, match="staging"):
        without.copy(True, False, 0, [0], [0], 0, 0, DONE, 0, 0, False, None)  # staged, but no kernel
    with pytest.raises(ValueError, match="staging"):
        with_kernel.copy(True, False, 0, [0], [0], 2, 0, DONE, 0, 0, False, None)  # no staging buffer 2
    with pytest.raises(ValueError, match="done"):
        with_kernel.copy(True, True, 0, [0], [0], 0, 0, 0, 0, 0, False, None)
    with pytest.raises(ValueError, match="host rows"):
        with_kernel.copy(True, True, 0, [0, 1], [0], 0, 0, DONE, 0, 0, False, None)
    with pytest.raises(OverflowError, match="kernel's int"):
        with_kernel.copy(True, False, 0, [0, 1], [0, 2**31], 0, 0, DONE, 0, 0, False, None)
    with pytest.raises(TypeError):
        with_kernel.copy(True, False, 0, [0], [0], 0, 0, DONE, 0, 0)  # an argument short
    assert driver.log == []
    with pytest.raises(ValueError, match="kernel"):
        ChunkCopies(driver.functions, 1, 1, K, C, BETWEEN, SLOT, table, STAGING, (1, 2, 3, 4, 0, 6, 7, 8, 9, 10, 11, 12))
    with pytest.raises(ValueError, match="is 0"):
        ChunkCopies(driver.functions, 1, 1, K, C, 0, SLOT, table, STAGING, None)
    with pytest.raises(ValueError, match="4 uint64"):
        ChunkCopies(driver.functions, 1, 1, K, C, BETWEEN, SLOT, b"\0" * 8, STAGING, None)


class EventDriver:
    """The driver's four event functions stood in for by ctypes callbacks: handles counted from 1,
    what each was asked logged, queries answered from ``outcome`` (600: still running)."""

    def __init__(self, max_pooled: int = 2) -> None:
        from kvoffload._core.base.piece_copies import EventCalls

        self.made = 0
        self.log: list[tuple[str, int]] = []
        self.outcome: dict[int, int] = {}
        void_p, c_int = ctypes.c_void_p, ctypes.c_int

        def create(out, flags):
            self.made += 1
            ctypes.c_void_p.from_address(out).value = self.made
            self.log.append(("create", flags))
            return 0

        self.callbacks = (
            ctypes.CFUNCTYPE(c_int, void_p, ctypes.c_uint)(create),
            ctypes.CFUNCTYPE(c_int, void_p)(lambda h: self.log.append(("destroy", h)) or 0),
            ctypes.CFUNCTYPE(c_int, void_p, void_p)(lambda h, s: self.log.append(("record", h)) or (701 if s == 99 else 0)),
            ctypes.CFUNCTYPE(c_int, void_p)(lambda h: self.outcome.get(h, 600)),
        )

        def check(call: str, err: int) -> None:
            raise RuntimeError(f"{call} {err}")

        self.calls = EventCalls(*[ctypes.cast(f, void_p).value for f in self.callbacks], 7, max_pooled, check, self.callbacks)


def test_events_are_made_from_a_bounded_pool_recorded_and_queried_in_c() -> None:
    """``Event``: made by cuEventCreate (with the table's flags) only when no gone event's handle waits
    in its device's pool, that pool bounded (the rest destroyed); ``query()`` False while running,
    True once done, the table's ``check`` raising any other code; a failed record raises too."""
    from kvoffload._core.base.piece_copies import Event, use_event_calls

    driver = EventDriver(max_pooled=2)
    previous = use_event_calls(driver.calls)
    try:
        a, b, c = Event(0), Event(0), Event(1)
        assert (a.handle, b.handle, c.handle, c.device) == (1, 2, 3, 1) and driver.log == [("create", 7)] * 3
        assert a.record(5) is a and driver.log[-1] == ("record", 1)
        assert a.query() is False
        driver.outcome[1] = 0
        assert a.query() is True
        driver.outcome[2] = 700
        with pytest.raises(RuntimeError, match="cuEventQuery 700"):
            b.query()
        with pytest.raises(RuntimeError, match="cuEventRecord 701"):
            b.record(99)
        d = Event(0)
        del a, b, d  # two pooled on device 0, the third destroyed
        assert driver.calls.pooled(0) == 2 and driver.log[-1] == ("destroy", 4)
        again = [Event(0), Event(0)]
        assert {e.handle for e in again} == {1, 2} and driver.made == 4, "the pooled handles were not reused"
        assert Event(0).handle == 5 and driver.calls.pooled(1) == 0
        with pytest.raises(ValueError):
            Event(-1)
    finally:
        use_event_calls(previous)


def test_chunk_copies_chunk_chooses_direct_or_staged_takes_buffers_in_turn_and_waits_for_their_last_use() -> None:
    """``ChunkCopies.chunk``: a chunk of at most ``direct_max_copies`` pieces and no cancel flag goes
    direct; others are staged through the two buffers in turn, on one stream when shorter than
    ``chunk_blocks``, each buffer's last chunk waited for unless it ended on the stream this one starts
    on; each returns its own end event, and a failed chunk leaves the buffer's last use as it was."""
    from kvoffload._core.base.piece_copies import Event, use_event_calls

    _tensors, table, _ = cache_and_table()  # 3 pieces a block
    events = EventDriver(max_pooled=0)
    previous = use_event_calls(events.calls)
    try:
        driver = StandInDriver(fail=("copies", 5))
        address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        a = ctypes.addressof
        params = (address(driver._launch), 1234, a(driver.params), a(driver.blocks), 4, len(table), 256, 0,
                  a(driver.staging), a(driver.gather), a(driver.cancel), a(driver.generation))
        chunks = ChunkCopies(driver.functions, address(driver._record), address(driver._wait), K, C, BETWEEN, SLOT, table, STAGING,
                             params, event_type=Event, device=0, direct_max_copies=3, chunk_blocks=4)

        def chunk(to_host: bool, n: int, cancel: int = 0, caller: int | None = None) -> tuple[object, list]:
            start = len(driver.log)
            done = chunks.chunk(to_host, 1 << 30, list(range(n)), list(range(10, 10 + n)), caller, cancel, 1 if cancel else 0)
            return done, driver.log[start:]

        direct, log = chunk(True, 1, caller=0)  # 3 pieces: direct, after the caller's (legacy default) stream
        assert [e[0] for e in log] == ["record", "wait", "copies", "record"] and log[0] == ("record", BETWEEN, None)  # ctypes: NULL as None
        assert isinstance(direct, Event) and log[-1] == ("record", direct.handle, C) and len(log[2][2]) == 3

        short, log = chunk(True, 2)  # staged in buffer 0, one stream (shorter than a chunk): no last use yet
        assert [e[0] for e in log] == ["launch", "copies", "record"] and log[0][1] == C and log[0][6] == STAGING[0]

        full, log = chunk(True, 4)  # buffer 1, both streams
        assert [e[0] for e in log] == ["launch", "record", "wait", "copies", "record"] and log[0][1] == K and log[0][6] == STAGING[1]

        again, log = chunk(True, 2)  # buffer 0 again: its last use (short) ended on the copy stream, where this one runs
        assert log[0][0] == "launch" and log[0][6] == STAGING[0], log

        cancellable, log = chunk(False, 1, cancel=777)  # one block but a cancel flag: staged, in buffer 1 after `full`
        assert log[0] == ("wait", K, full.handle) and log[1][:2] == ("copies", K)
        assert log[2][0] == "launch" and log[2][6] == STAGING[1] and log[2][8] == 777

        failed, log = chunk(False, 2)  # buffer 0; its copies fail (the 6th batch): what failed comes back
        assert failed == (9, "copy", 1) and log[-1][0] == "copies"
        _, log = chunk(False, 2)  # buffer 1: its last use is still `cancellable`, which ended on the kernel stream
        assert log[0][0] == "copies" and log[0][1] == K, log
        _, log = chunk(False, 2)  # buffer 0: its last use is `again`, not the failed chunk
        assert log[0] == ("wait", K, again.handle), log
        assert len({e.handle for e in (direct, short, full, again, cancellable)}) == 5
    finally:
        use_event_calls(previous)
