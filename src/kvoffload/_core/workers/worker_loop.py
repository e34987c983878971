"""Dedicated event loops, each running in its own thread.

The offloader runs stores on one :class:`WorkerLoop` and loads on another, so a
long store never delays a load; the remote tier has one of its own. A worker loop
knows nothing of transfers: it runs what is posted to its :attr:`WorkerLoop.mailbox`,
and at :meth:`WorkerLoop.stop` cancels the tasks registered with
:meth:`WorkerLoop.track` first, then the helpers they left behind.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..base.cross_thread import Mailbox
from ..base.helper_threads import mark_own_thread

__all__ = ["WorkerLoop"]

log = logging.getLogger("kvoffload")


class WorkerLoop:
    """An asyncio loop running forever in a named daemon thread."""

    def __init__(self, name: str, on_thread_start: Callable[[], Any] | None = None) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.mailbox = Mailbox(self.loop, quiet=True)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop_hooks: list[Callable[[], Any]] = []
        self._on_thread_start = on_thread_start
        self._ready = threading.Event()
        self._stop_requested = False
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self.mailbox.close()
            self.loop.close()
            raise self._start_error

    def _run(self) -> None:
        mark_own_thread()
        asyncio.set_event_loop(self.loop)
        try:
            if self._on_thread_start is not None:
                self._on_thread_start()
        except BaseException as e:  # surfaced to the constructor
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            try:
                self.loop.run_forever()
                return  # stopped by stop()
            except BaseException:  # a SystemExit or KeyboardInterrupt out of a callback: keep serving
                log.exception("%s: a callback raised out of the event loop", self.name)

    def add_stop_hook(self, hook: Callable[[], Any]) -> None:
        """Run ``hook()`` on the loop when :meth:`stop` begins, before the tasks are cancelled."""
        self._stop_hooks.append(hook)

    def in_thread(self) -> bool:
        """True when called from this loop's own thread."""
        return threading.current_thread() is self._thread

    def track(self, task: asyncio.Task[Any]) -> None:
        """On the loop: ``task`` is one :meth:`stop` cancels and waits for before any other (the helper
        tasks it may leave behind, such as buffer releases, end after it)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self, timeout: float | None) -> bool:
        """Cancel every task, wait for them to end, stop the loop and join the thread.

        Returns False if the thread did not end within ``timeout`` seconds (None: no limit); call
        again to go on waiting (the shutdown is requested once). Not from the
        loop's own thread (RuntimeError).
        """
        if self.in_thread():
            raise RuntimeError(f"{self.name}: stop() called from the loop's own thread")
        if not self._thread.is_alive():
            self._close_loop()
            return True

        async def cancel_all() -> None:
            for hook in self._stop_hooks:
                try:
                    hook()
                except BaseException:
                    log.exception("%s: a stop hook raised", self.name)
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks)
            # Then the helpers transfers left behind (buffer releases, pollers): their work has ended.
            others = asyncio.all_tasks() - {asyncio.current_task()}
            for t in others:
                t.cancel()
            if others:
                await asyncio.wait(others)
            # Let done callbacks (transfer completion, cleanup) run.
            await asyncio.sleep(0)

        def shutdown() -> None:
            fut = asyncio.ensure_future(cancel_all())
            fut.add_done_callback(lambda _: self.loop.stop())

        if not self._stop_requested:
            self._stop_requested = True
            self.loop.call_soon_threadsafe(shutdown)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._close_loop()  # no run_until_complete here: the caller's thread may be running a loop
        return True

    def _close_loop(self) -> None:
        if not self.loop.is_closed():
            self.mailbox.close()
            self.loop.close()
