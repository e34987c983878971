"""Stand-ins for the CUDA copier, its events and cancel flags, and the CUDA driver, to drive the GPU
path's worker logic on any machine."""

from __future__ import annotations

import threading

from .waiting import HANG_S


class StandInEvent:
    """Stands in for a CUDA copy's completion event: the test completes it by hand."""

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        self.waited = threading.Event()
        """Set once a thread sleeps in :meth:`synchronize`."""
        self.alarms: list = []
        """Alarms to ring on completion (the copier's ``ring_when_complete``)."""
        self.alarmed = threading.Event()
        """Set once an alarm is to ring on completion."""
        self._lock = threading.Lock()
        if done:
            self._done.set()

    def complete(self) -> None:
        with self._lock:
            self._done.set()
            alarms, self.alarms = self.alarms, []
        for alarm in alarms:
            alarm.ring()

    def ring_on_completion(self, alarm) -> None:
        with self._lock:
            if not self._done.is_set():
                self.alarms.append(alarm)
                self.alarmed.set()
                return
        alarm.ring()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self.waited.set()
        assert self._done.wait(10)


class StandInFlag:
    """A cancel flag whose raise lands on the 'device' when the test says so."""

    def __init__(self, raise_lands_at_once: bool) -> None:
        self.raised: StandInEvent | None = None
        self._at_once = raise_lands_at_once
        self.released = threading.Event()

    def raise_flag(self) -> None:
        self.raised = StandInEvent(done=self._at_once)

    def release(self) -> None:  # idempotent, as the real flag's
        self.released.set()


class StandInCopier:
    """Stands in for the CUDA copier: each chunk's copy returns an event the test completes."""

    chunk_blocks = 4

    def __init__(self, flag: StandInFlag) -> None:
        self.flag = flag
        self.events: list[StandInEvent] = []
        self.stopping: object = None
        self.flagged_chunks = 0

    def caller_event(self) -> None:
        return None

    def wait_for(self, event: object) -> None:
        pass

    def take_cancel_flag(self) -> StandInFlag:
        return self.flag

    def stops_on(self, flag: StandInFlag):
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.stopping = flag
            try:
                yield
            finally:
                self.stopping = None

        return scope()

    def ring_when_complete(self, event: StandInEvent, alarm, in_order: bool = True, for_thread: bool = False) -> None:
        event.ring_on_completion(alarm)

    def to_device(self, host, rows, block_ids) -> StandInEvent:
        self.flagged_chunks += self.stopping is self.flag
        self.events.append(StandInEvent())
        return self.events[-1]

    def close(self) -> None:
        pass


class CopiesAtOnce:
    """Stands in for the CUDA copier of an offloader over CPU caches (``kvoffload._testing.take_gpu_path``):
    copies as the CPU copier does, each chunk returning an event completed already, so the GPU path
    (copies at call time, a landing watcher) runs at the CPU copier's pace."""

    def __init__(self, real) -> None:
        self.real = real
        self.chunk_blocks = real.chunk_blocks

    def caller_event(self) -> None:
        return None

    def wait_for(self, event: object) -> None:
        pass

    def take_cancel_flag(self) -> None:
        return None

    def ring_when_complete(self, event: StandInEvent, alarm, in_order: bool = True, for_thread: bool = False) -> None:
        event.ring_on_completion(alarm)

    def to_host(self, block_ids, host, rows) -> StandInEvent:
        self.real.to_host(block_ids, host, rows)
        return StandInEvent(done=True)

    def to_device(self, host, rows, block_ids) -> StandInEvent:
        self.real.to_device(host, rows, block_ids)
        return StandInEvent(done=True)

    def close(self) -> None:
        self.real.close()


class StandInDriver:
    """Stands in for the CUDA driver under the real ``DriverEvent`` (the ``enqueue_calls()`` function
    table it calls): each event completes when the test says, successfully or with a CUDA error
    (``ILLEGAL_ADDRESS``: error 700, an asynchronous fault). Install it with the ``standin_driver`` fixture."""

    NOT_READY = 600
    ILLEGAL_ADDRESS = 700
    blocking_sync = 0

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._outcome: dict[int, int | None] = {}  # handle -> None while running, then the code it completed with
        self._alarms: dict[int, list] = {}
        self.handles: list[int] = []
        """Every event made, in order."""
        self.synchronizing = threading.Event()
        """Set once a thread sleeps in ``cuEventSynchronize``."""
        self.alarmed = threading.Event()
        """Set once an alarm is to ring at an event's completion."""
        self.event_calls = self._event_calls()
        """The functions the real ``DriverEvent`` is made, recorded and queried with (C calls them):
        this stand-in's, through ctypes callbacks. The ``standin_driver`` fixture puts them in use."""

    def _event_calls(self):
        import ctypes

        from kvoffload._core.base.piece_copies import EventCalls
        from kvoffload._core.cuda.driver import check

        void_p, c_int = ctypes.c_void_p, ctypes.c_int
        self._callbacks = (  # kept alive as long as the stand-in: C calls them by address
            ctypes.CFUNCTYPE(c_int, void_p, ctypes.c_uint)(lambda out, flags: self.event_create(out, flags)),
            ctypes.CFUNCTYPE(c_int, void_p)(lambda handle: self.event_destroy(handle or 0)),
            ctypes.CFUNCTYPE(c_int, void_p, void_p)(lambda handle, stream: self.event_record(handle or 0, stream or 0)),
            ctypes.CFUNCTYPE(c_int, void_p)(lambda handle: self.event_query(handle or 0)),
        )
        addresses = [ctypes.cast(f, void_p).value for f in self._callbacks]
        return EventCalls(*addresses, self.blocking_sync, 4096, check, self._callbacks)

    # -- the function table (returns CUDA error codes, as the driver's entry points do)

    def event_create(self, out_address: int, flags: int) -> int:
        import ctypes

        with self._cond:
            handle = len(self.handles) + 1
            self.handles.append(handle)
            self._outcome[handle] = None
        ctypes.c_void_p.from_address(out_address).value = handle
        return 0

    def event_record(self, handle: int, stream: int) -> int:
        return 0

    def event_destroy(self, handle: int) -> int:
        return 0

    def ensure_context(self, device_index: int) -> None:
        pass

    def event_query(self, handle: int) -> int:
        with self._cond:
            outcome = self._outcome[handle]
        return self.NOT_READY if outcome is None else outcome

    def event_synchronize(self, handle: int) -> int:
        self.synchronizing.set()
        with self._cond:
            if not self._cond.wait_for(lambda: self._outcome[handle] is not None, HANG_S):
                return 999  # never completed: the waiter fails instead of hanging the test
            return self._outcome[handle]

    # -- the test's side

    def complete(self, event, error: int = 0) -> None:
        """Complete ``event`` (a ``DriverEvent``): successfully, or with CUDA error ``error``."""
        with self._cond:
            self._outcome[event.handle] = error
            self._cond.notify_all()
            alarms = self._alarms.pop(event.handle, [])
        for alarm in alarms:
            alarm.ring()

    def ring_when_complete(self, event, alarm, in_order: bool = True, for_thread: bool = False) -> None:
        """What the CUDA copier's ``ring_when_complete`` asks of the driver: ring ``alarm`` once ``event`` completes."""
        with self._cond:
            if self._outcome[event.handle] is None:
                self._alarms.setdefault(event.handle, []).append(alarm)
                self.alarmed.set()
                return
        alarm.ring()
