"""Model-based test: random sequences of operations on a small two-tier offloader, checked against a plain model.

A hypothesis state machine drives one offloader (4 host slots, 8 disk slots, one slot per chunk so
every transfer spans chunks) through stores, loads, lookups, discards, transfers cancelled at a
random point (by ``Transfer.cancel()`` from the copying thread, by cancelling the awaiting task,
by an ``asyncio.timeout`` that fires mid-transfer, or right after the call) and close/reopen.

The model is a dict ``key -> bytes stored`` plus the LRU order of each tier as docs/reference/api.md documents
it: stores go to host memory; when it needs room its least-recently-used entries are spilled to disk;
when the disk is full too its least-recently-used entries are dropped (``stats().evicted``); a store
larger than the host tier sends its first keys to disk (the disk's least-recently-used entries make
room) and its last ones to host memory; a load makes its keys the most recently used of their tier.
Promotion: a load's disk-resident keys take the host slots free when it is called (in the load's
order), and become the most recently used host entries once loaded, keeping their disk copies as
clean copies; a host victim with a clean copy goes back to disk without a write (not spilled), and
disk room is made by dropping clean copies (oldest promotion first) before evicting anything. After
a cancelled store the outcome is not fixed (how many spills and chunks landed), so the test reads it
back and checks that it is one the documented semantics allow: spills complete in LRU order, the new
keys visible are a prefix of the store's new keys, and none is visible unless all spills completed;
likewise a cancelled load has promoted a prefix of its promotion candidates.

After every step: every key is visible exactly when the model has it (so a stored key that was
neither evicted nor discarded never disappears, and the keys dropped are exactly those the LRU
policy names: ``stats().evicted`` must match the model's count), ``lookup`` agrees, the slot counts
add up per tier (clean copies included), ``spilled`` and ``promoted`` match the model, and nothing
stays pending, pinned, spilling or in flight. While a transfer runs, every copy and IO call checks
that the slot accounting adds up (capacity is never exceeded).

Bytes: every load checks what it loaded; the ``verify_all`` rule loads every visible key (in a random
order), and every sequence ends (and every close is preceded) by loading every visible key. The full
check is a rule rather than an invariant on purpose: a load touches the LRU order, and a check in the
model's order after every step would silently repair an LRU divergence before an eviction exposes it.

A transfer that does not end within 30 s fails its step (a hang is a failure, not a stuck CI job).

CI budget: 300 sequences of up to 70 steps, about 15,000 operations in 20-25 s on 2 cores; the
summary line (operations, cancels, spills, evictions) is printed at the end of the pytest run.
Soak: ``KVOFFLOAD_SOAK=1`` (2,000 sequences of 100 steps; ``KVOFFLOAD_SOAK_EXAMPLES`` /
``KVOFFLOAD_SOAK_STEPS`` override), e.g. ``KVOFFLOAD_SOAK=1 python -m pytest -q tests/test_model.py``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

import kvoffload
from kvoffload._testing import disk_io
from support.caches import random_caches, same_bytes
from support.figures import report_figure
from support.process import kvoffload_threads
from kvoffload._core.workers.copier import CpuBlockCopier

SOAK = os.environ.get("KVOFFLOAD_SOAK", "") not in ("", "0")
MAX_EXAMPLES = int(os.environ.get("KVOFFLOAD_SOAK_EXAMPLES", "2000")) if SOAK else 300
STEPS = int(os.environ.get("KVOFFLOAD_SOAK_STEPS", "100")) if SOAK else 70

NUM_BLOCKS = 32
HOST_SLOTS = 4
DISK_SLOTS = 8
CHECK_BLOCKS = list(range(NUM_BLOCKS - HOST_SLOTS - DISK_SLOTS, NUM_BLOCKS))  # where the byte check loads to
KEYS = ["a", "b", b"c", b"d", ("e", 0), ("e", 1), 7, 8, "i", "j", b"k", ("l",), 13, "n", "o", b"p"]
CANCEL_WAYS = ["transfer", "task", "timeout", "right-after-call"]

FIGURES: Counter[str] = Counter()


# -- hooks in every copy and IO call ----------------------------------------------------------


class Hooks:
    """Runs in each chunk copy (copier) and each disk IO call before it happens.

    Always: checks the slot accounting of the running offloader. When armed: runs ``action`` at
    the ``at``-th call (the random point where a transfer is cancelled).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.off: kvoffload.Offloader | None = None
        self.calls = 0
        self.at: int | None = None
        self.action = None
        self.fired = False
        self.violations: list[str] = []

    def arm(self, at: int, action) -> None:
        """Run ``action`` at the ``at``-th call from now."""
        with self.lock:
            self.calls, self.at, self.action, self.fired = 0, at, action, False

    def disarm(self) -> None:
        with self.lock:
            self.at, self.action = None, None

    def hit(self, where: str) -> None:
        off = self.off
        if off is not None:
            c = off._running_storage().index.counts()  # stats() with the pending entries per tier
            # Host slots: free + ready + pending, minus the spilling entries whose slot a pending entry borrows,
            # plus the slots promoting loads read into.
            if c.host_free + c.host_ready + c.host_pending - c.spilling + c.host_promoting != c.host_slots:
                self.violations.append(f"{where}: host slots do not add up: {c}")
            # Disk slots: free + ready + pending (a large store's first keys) + the spills' destinations + clean copies.
            if c.disk_free + c.disk_ready + c.disk_pending + c.spilling + c.disk_clean != c.disk_slots:
                self.violations.append(f"{where}: disk slots do not add up: {c}")
            FIGURES["accounting-checks"] += 1
            if c.host_ready > c.host_slots or c.disk_ready > c.disk_slots:
                self.violations.append(f"{where}: more entries than slots: {c}")
        with self.lock:
            self.calls += 1
            action = None
            if self.action is not None and self.calls == self.at:
                action, self.action, self.fired = self.action, None, True
        if action is not None:
            action()


HOOKS = Hooks()


def install_io_hooks(off: kvoffload.Offloader) -> None:
    io = disk_io(off)
    real_w, real_r = io.pwritev, io.preadv

    def pwritev(fd, bufs, offset):
        HOOKS.hit("pwritev")
        return real_w(fd, bufs, offset)

    def preadv(fd, bufs, offset):
        HOOKS.hit("preadv")
        return real_r(fd, bufs, offset)

    io.pwritev, io.preadv = pwritev, preadv


# -- the model --------------------------------------------------------------------------------


class Model:
    """What the docs say the offloader holds: bytes per key, LRU order per tier, counters."""

    def __init__(self) -> None:
        self.data: dict = {}  # key -> {tensor name: block bytes}
        self.host: list = []  # least recently used first
        self.disk: list = []
        self.clean: list = []  # host keys with a clean disk copy, oldest promotion first
        self.evicted = 0
        self.spilled = 0
        self.promoted = 0

    def plan_store(self, keys: list):
        """(new keys, skipped keys, spill victims, dropped keys, disk list after the drops, clean copies
        left, victims gone back to their clean copies, how many new keys go to disk) or None for CapacityError."""
        new = [k for k in keys if k not in self.data]
        skipped = [k for k in keys if k in self.data]
        if len(new) > HOST_SLOTS + DISK_SLOTS:  # nothing is pinned between steps: every entry is evictable
            return None
        direct = max(0, len(new) - HOST_SLOTS)  # a store larger than the host tier: its first keys go to disk
        shortfall = max(0, len(new) - direct - (HOST_SLOTS - len(self.host)))
        victims = self.host[:shortfall]
        clean = list(self.clean)
        disk = list(self.disk)
        demoted = [v for v in victims if v in clean]  # back to their clean copies, nothing written
        for v in demoted:
            clean.remove(v)
            disk.append(v)
        dropped: list = []

        def make_room() -> None:  # one disk slot: a clean copy goes (oldest promotion first), else the LRU disk entry
            if clean:
                clean.pop(0)
            else:
                dropped.append(disk.pop(0))

        while DISK_SLOTS - len(disk) - len(clean) < direct:
            make_room()
        disk_free = DISK_SLOTS - len(disk) - len(clean) - direct
        spills = []
        for v in victims:
            if v in demoted:
                continue
            if disk_free:
                disk_free -= 1
                spills.append(v)
            elif clean or disk:
                make_room()
                spills.append(v)
            else:
                dropped.append(v)
        return new, skipped, spills, dropped, disk, clean, demoted, direct

    def apply_store(self, plan, blocks_bytes: dict, spills_done: int, published: int) -> None:
        new, _, spills, dropped, disk, clean, demoted, direct = plan
        moved = spills[:spills_done]
        gone = set(map(_h, dropped)) | set(map(_h, moved)) | set(map(_h, demoted))
        self.host = [k for k in self.host if _h(k) not in gone] + new[direct:published]
        self.disk = disk + moved + new[: min(published, direct)]
        self.clean = clean
        for k in dropped:
            del self.data[k]
        for k in new[:published]:
            self.data[k] = blocks_bytes[k]
        self.evicted += len(dropped)
        self.spilled += spills_done
        FIGURES["evictions"] += len(dropped)
        FIGURES["spills"] += spills_done
        FIGURES["returns to clean copies"] += len(demoted)

    def pin(self, keys: list) -> list:
        """A load pins its keys in mapping order: each becomes the most recently used of its tier, and
        its disk-resident keys take the free host slots, in order. Returns those (the candidates)."""
        for k in keys:
            lru = self.host if k in self.host else self.disk
            lru.remove(k)
            lru.append(k)
        return [k for k in keys if k in self.disk][: HOST_SLOTS - len(self.host)]

    def promote(self, keys: list) -> None:
        """``keys`` landed in their host slots: the most recently used host entries, with clean disk copies."""
        for k in keys:
            self.disk.remove(k)
            self.host.append(k)
            self.clean.append(k)
        self.promoted += len(keys)
        FIGURES["promotions"] += len(keys)

    def discard(self, keys) -> int:
        n = 0
        for k in dict.fromkeys(keys):
            if k in self.data:
                n += 1
                del self.data[k]
                (self.host if k in self.host else self.disk).remove(k)
                if k in self.clean:
                    self.clean.remove(k)
        return n

    def lookup(self, keys) -> int:
        n = 0
        for k in keys:
            if k not in self.data:
                break
            n += 1
        return n


def _h(k):
    return (type(k).__name__, k)  # 7 and 7.0 would collide in a set otherwise; keys are never both


def block_of(caches, b: int) -> dict:
    return {n: t[b].clone() for n, t in caches.items()}


# -- the state machine --------------------------------------------------------------------------


class OffloaderMachine(RuleBasedStateMachine):
    workdir: str = "."

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.caches = random_caches(NUM_BLOCKS, seed=1)
        self.gen = torch.Generator().manual_seed(12345)
        self.path = os.path.join(self.workdir, "kv.bin")
        self.off: kvoffload.Offloader | None = None
        self.model = Model()
        self.hung: list[asyncio.Task] = []
        FIGURES["examples"] += 1

    # -- plumbing --

    def open(self) -> None:
        self.off = kvoffload.Offloader(
            self.caches, host_blocks=HOST_SLOTS, disk_path=self.path, disk_blocks=DISK_SLOTS,
            chunk_bytes=kvoffload.BlockLayout.of(self.caches).slot_bytes, io_threads=2,
        ).start()
        install_io_hooks(self.off)
        HOOKS.off = self.off
        self.model = Model()
        self.steps_since_open = 0

    def run(self, coro, timeout: float = 30.0):
        """Run ``coro`` on the machine's loop; a transfer that hangs fails the step instead of blocking the test."""
        task = self.loop.create_task(coro)
        done, _ = self.loop.run_until_complete(asyncio.wait([task], timeout=timeout))
        if not done:
            self.hung.append(task)
            raise AssertionError(f"a transfer did not end within {timeout} s: {self.off.stats()}")
        return task.result()

    def refill(self, blocks) -> None:
        """Fresh random bits in the given blocks, so that every store writes bytes no key holds yet."""
        for t in self.caches.values():
            for b in set(blocks):
                raw = torch.randint(0, 256, (t[b].numel() * t.element_size(),), generator=self.gen, dtype=torch.uint8)
                t[b].copy_(raw.view(t.dtype).view(t[b].shape))

    def count(self, what: str) -> None:
        self.steps_since_open += 1
        FIGURES["operations"] += 1
        FIGURES[what] += 1

    def check_load(self, keys, dests) -> None:
        for k, b in zip(keys, dests):
            want = self.model.data[k]
            for n, t in self.caches.items():
                assert same_bytes(t[b], want[n]), f"key {k!r} loaded wrong bytes into block {b} ({n})"

    def teardown(self) -> None:
        HOOKS.off = None
        HOOKS.disarm()
        try:
            if self.off is not None and not self.off.closed:
                self.load_everything()  # every sequence ends with a full byte check
        finally:
            try:
                if self.off is not None:
                    self.off.close()  # ends hung transfers (cancelled), which wakes their waiters
                if self.hung:
                    self.loop.run_until_complete(asyncio.wait(self.hung, timeout=10))
            finally:
                self.loop.close()
        assert not os.path.exists(self.path)

    @initialize()
    def start(self) -> None:
        self.open()

    # -- rules --

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=HOST_SLOTS + 1, unique=True),
          sources=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=HOST_SLOTS + 1, max_size=HOST_SLOTS + 1))
    def store(self, keys, sources) -> None:
        self.do_store(keys, sources)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=HOST_SLOTS - 1, max_size=HOST_SLOTS, unique=True),
          sources=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=HOST_SLOTS, max_size=HOST_SLOTS))
    def store_batch(self, keys, sources) -> None:
        """Larger stores (fills the tiers so that spills and evictions happen often)."""
        self.do_store(keys, sources)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=HOST_SLOTS + 1, max_size=HOST_SLOTS + DISK_SLOTS + 1, unique=True),
          sources=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=HOST_SLOTS + DISK_SLOTS + 1, max_size=HOST_SLOTS + DISK_SLOTS + 1))
    def store_large(self, keys, sources) -> None:
        """Stores larger than the host tier (through it to disk), and larger than both tiers (refused)."""
        self.do_store(keys, sources)

    def do_store(self, keys, sources) -> None:
        self.count("store")
        srcs = sources[: len(keys)]
        self.refill(srcs)
        blocks = dict(zip(keys, srcs))
        plan = self.model.plan_store(keys)
        before = self.off.stats()
        if plan is None:
            with pytest.raises(kvoffload.CapacityError):
                self.off.store(blocks)
            assert self.off.stats() == before, "a refused store changed the offloader"
            return
        snap = {k: block_of(self.caches, b) for k, b in blocks.items()}
        r = self.run(self._await(self.off.store(blocks)))
        new, skipped = plan[0], plan[1]
        assert list(r.keys) == new and list(r.skipped) == skipped
        assert r.nbytes == len(new) * self.off.layout.block_bytes
        self.model.apply_store(plan, snap, spills_done=len(plan[2]), published=len(new))

    @rule(pick=st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True),
          missing=st.sampled_from(KEYS), with_missing=st.booleans(), dests=st.permutations(range(NUM_BLOCKS)))
    def load(self, pick, missing, with_missing, dests) -> None:
        self.count("load")
        keys = self.loadable(pick)
        if not keys:
            with pytest.raises(kvoffload.MissingKeysError):
                self.off.load({missing: 0})
            return
        if with_missing and missing not in self.model.data:
            before = self.off.stats()
            with pytest.raises(kvoffload.MissingKeysError) as ei:
                self.off.load({**dict(zip(keys, dests)), missing: dests[len(keys)]})
            assert ei.value.missing == (missing,)
            assert self.off.stats() == before  # nothing pinned, nothing moved
            return  # and the LRU order was not touched (the model's invariants check it later)
        promoting = self.model.pin(keys)
        r = self.run(self._await(self.off.load(dict(zip(keys, dests)))))
        assert list(r.keys) == keys
        self.model.promote(promoting)
        self.check_load(keys, dests)

    def loadable(self, pick: list) -> list:
        """The picked keys that are stored, else as many stored keys as were picked (the draws never depend on state)."""
        keys = [k for k in pick if k in self.model.data]
        return keys or sorted(self.model.data, key=repr)[: len(pick)]

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6))
    def lookup(self, keys) -> None:
        self.count("lookup")
        assert self.off.lookup(keys) == self.model.lookup(keys)
        for k in keys:
            assert (k in self.off) == (k in self.model.data)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def discard(self, keys) -> None:
        self.count("discard")
        assert self.off.discard(keys) == self.model.discard(keys)

    @rule(freed=st.integers(0, 2), picks=st.lists(st.integers(0, DISK_SLOTS - 1), min_size=1, max_size=3, unique=True),
          dests=st.permutations(range(NUM_BLOCKS)))
    def load_from_disk(self, freed, picks, dests) -> None:
        """Discard the ``freed`` least recently used host entries, then load disk-resident keys (promotions)."""
        self.count("load-from-disk")
        victims = self.model.host[:freed]
        assert self.off.discard(victims) == self.model.discard(victims)
        keys = list(dict.fromkeys(self.model.disk[i % len(self.model.disk)] for i in picks)) if self.model.disk else []
        if not keys:
            return
        promoting = self.model.pin(keys)
        self.run(self._await(self.off.load(dict(zip(keys, dests)))))
        self.model.promote(promoting)
        self.check_load(keys, dests)

    @rule(kind=st.sampled_from(["store", "load"]), how=st.sampled_from(CANCEL_WAYS), at=st.integers(1, 6),
          pick=st.lists(st.sampled_from(KEYS), min_size=1, max_size=HOST_SLOTS + 3, unique=True),
          sources=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=HOST_SLOTS + 3, max_size=HOST_SLOTS + 3),
          dests=st.permutations(range(NUM_BLOCKS)))
    def cancel(self, kind, how, at, pick, sources, dests) -> None:
        """Start a transfer and cancel it at the ``at``-th copy or IO call it makes (or right after the call)."""
        if kind == "load" and not self.model.data:
            kind = "store"
        self.count(f"cancel-{kind}")
        if kind == "store":
            keys = pick
            srcs = sources[: len(keys)]
            self.refill(srcs)
            blocks = dict(zip(keys, srcs))
            plan = self.model.plan_store(keys)
            assert plan is not None
            snap = {k: block_of(self.caches, b) for k, b in blocks.items()}
        else:
            keys = self.loadable(pick)
            blocks = dict(zip(keys, dests))
        outcome = self.run(self._cancelled_transfer(kind, blocks, how, at))
        FIGURES[f"cancel-{outcome}"] += 1
        s = self.off.stats()
        assert s.in_flight == 0 and s.pending == 0 and s.pinned == 0 and s.spilling == 0, s
        if kind == "load":
            promoting = self.model.pin(keys)  # pinned at call time, whatever happened next
            promoted = s.host_ready - len(self.model.host)  # those whose chunk landed before the cancel
            assert 0 <= promoted <= len(promoting), (promoted, promoting, s)
            if outcome == "done":
                assert promoted == len(promoting), (promoted, promoting)
            self.model.promote(promoting[:promoted])
            if outcome == "done":
                self.check_load(keys, [blocks[k] for k in keys])
            return
        # Read back what the cancelled store left and check it is an outcome the semantics allow.
        new, _, spills, _dropped, disk_after_drops, _clean, _demoted, direct = plan
        visible = [k in self.off for k in new]
        published = sum(visible)
        assert visible == [True] * published + [False] * (len(new) - published), (
            f"a cancelled store published keys out of order: {list(zip(new, visible))}")
        spills_done = s.disk_ready - len(disk_after_drops) - min(published, direct)
        assert 0 <= spills_done <= len(spills), (spills_done, plan, s)
        assert published == 0 or spills_done == len(spills), "keys published before the spills making room for them completed"
        if outcome == "done":
            assert published == len(new) and spills_done == len(spills)
        self.model.apply_store(plan, snap, spills_done, published)

    @precondition(lambda self: self.steps_since_open >= 10)  # let the tiers fill up first
    @rule()
    def close_and_reopen(self) -> None:
        self.count("reopen")
        self.load_everything()
        self.off.close()
        assert not os.path.exists(self.path), "the disk file outlived close()"
        assert not kvoffload_threads(), kvoffload_threads()
        with pytest.raises(kvoffload.ClosedError):
            self.off.lookup(KEYS)
        self.open()

    # -- transfers driven from the machine's own event loop --

    @staticmethod
    async def _await(t: kvoffload.Transfer):
        return await t

    async def _cancelled_transfer(self, kind: str, blocks: dict, how: str, at: int) -> str:
        loop = asyncio.get_running_loop()
        ready = threading.Event()
        box: dict = {}

        def fire() -> None:  # runs in the copying thread (worker loop or IO pool)
            assert ready.wait(10)
            if how == "transfer":
                box["t"].cancel()
            elif how == "task":
                loop.call_soon_threadsafe(box["task"].cancel)
            else:
                def expire() -> None:
                    if not box["t"].done():  # still inside the ``async with``
                        box["cm"].reschedule(loop.time())

                loop.call_soon_threadsafe(expire)

        if how != "right-after-call":
            HOOKS.arm(at, fire)
        try:
            t = self.off.store(blocks) if kind == "store" else self.off.load(blocks)
            box["t"] = t
            if how == "right-after-call":
                t.cancel()

            async def waiter():
                if how == "timeout":
                    async with asyncio.timeout(None) as cm:
                        box["cm"] = cm
                        ready.set()
                        return await t
                return await t

            task = asyncio.ensure_future(waiter())
            box["task"] = task
            if how != "timeout":
                ready.set()
            raised = None
            try:
                await task
            except (asyncio.CancelledError, TimeoutError, kvoffload.TransferCancelled) as e:
                raised = e
            if how == "transfer" and t.cancelled():
                assert isinstance(raised, kvoffload.TransferCancelled), f"cancelled by Transfer.cancel(), the waiter got {raised!r}"
            elif how in ("task", "timeout") and raised is not None:
                assert not isinstance(raised, kvoffload.TransferCancelled), f"the waiter's own cancellation came as {raised!r}"
            assert t.done(), "the awaiting task ended before the transfer"
            if t.cancelled():
                assert raised is not None, "a cancelled transfer returned a result"
                return "cancelled"
            # It finished before the cancel reached it (the waiter may still have been cancelled late).
            assert t.exception() is None
            return "done"
        finally:
            ready.set()
            HOOKS.disarm()

    # -- checked after every step --

    @invariant()
    def matches_the_model(self) -> None:
        if self.off is None:
            return
        assert not HOOKS.violations, HOOKS.violations[:3]
        s = self.off.stats()
        m = self.model
        assert (s.pending, s.pinned, s.spilling, s.in_flight) == (0, 0, 0, 0), s
        assert s.host_free + s.host_ready == HOST_SLOTS and s.disk_free + s.disk_ready + len(m.clean) == DISK_SLOTS, (s, m.clean)
        assert (s.host_ready, s.disk_ready, s.ready) == (len(m.host), len(m.disk), len(m.data)), (s, m.host, m.disk)
        assert s.evicted == m.evicted, f"evicted {s.evicted}, the documented LRU policy drops {m.evicted}"
        assert s.spilled == m.spilled, (s.spilled, m.spilled)
        assert s.promoted == m.promoted, (s.promoted, m.promoted)
        # Which entries keep a clean disk copy, oldest promotion first (the order the disk drops them in):
        # no count shows it, and a wrong choice only shows much later, as a spill where none was due.
        clean = list(self.off._running_storage().index._clean)
        assert clean == m.clean, (clean, m.clean)
        for k in KEYS:
            # a stored key neither evicted nor discarded does not disappear; nothing else appears
            assert (k in self.off) == (k in m.data), f"key {k!r}: offloader {k in self.off}, model {k in m.data}"
        assert self.off.lookup(m.host + m.disk) == len(m.data)

    @rule(order=st.permutations(KEYS))
    def verify_all(self, order) -> None:
        """Load every visible key, in a random order (which the model follows: a load touches the LRU order)."""
        self.count("verify-all")
        self.load_everything(order)

    def load_everything(self, order=KEYS) -> None:
        keys = [k for k in order if k in self.model.data]
        if not keys:
            return
        FIGURES["full-checks"] += 1
        dests = CHECK_BLOCKS[: len(keys)]
        for t in self.caches.values():
            t[dests].zero_()
        promoting = self.model.pin(keys)
        self.run(self._await(self.off.load(dict(zip(keys, dests)))))
        self.model.promote(promoting)
        self.check_load(keys, dests)


@pytest.mark.timeout(900)  # passing takes ~20 s; a failure may spend minutes shrinking the sequence
@pytest.mark.slow
def test_random_operations_match_the_model(tmp_path, monkeypatch):
    real_to_host, real_to_device = CpuBlockCopier.to_host, CpuBlockCopier.to_device

    def to_host(self, *a):
        HOOKS.hit("to_host")
        return real_to_host(self, *a)

    def to_device(self, *a):
        HOOKS.hit("to_device")
        return real_to_device(self, *a)

    # A failing sequence is shrunk for at most a minute (hypothesis' default is five).
    from hypothesis.internal.conjecture import engine

    if hasattr(engine, "MAX_SHRINKING_SECONDS"):
        monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 60)
    monkeypatch.setattr(CpuBlockCopier, "to_host", to_host)
    monkeypatch.setattr(CpuBlockCopier, "to_device", to_device)
    HOOKS.violations.clear()
    FIGURES.clear()
    OffloaderMachine.workdir = str(tmp_path)
    t0 = time.perf_counter()
    try:
        run_state_machine_as_test(
            OffloaderMachine,
            settings=settings(
                max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        f = FIGURES
        report_figure(
            f"test_model: {f['operations']} operations in {f['examples']} sequences ({time.perf_counter() - t0:.1f} s"
            f"{', soak' if SOAK else ''}): {f['store']} stores, {f['load'] + f['load-from-disk']} loads, {f['lookup']} lookups, "
            f"{f['discard']} discards, {f['cancel-store'] + f['cancel-load']} cancel attempts "
            f"({f['cancel-cancelled']} ended cancelled, {f['cancel-done']} completed first), "
            f"{f['reopen']} close/reopen; {f['full-checks']} full byte checks, "
            f"{f['accounting-checks']} slot-accounting checks mid-transfer; {f['spills']} spills, {f['evictions']} evictions, "
            f"{f['promotions']} promotions, {f['returns to clean copies']} returns to clean copies"
        )
    assert not HOOKS.violations, HOOKS.violations[:3]
    assert f["cancel-cancelled"] > 0 and f["store"] > 0 and f["load"] > 0
    assert f["promotions"] > 0 and f["returns to clean copies"] > 0
