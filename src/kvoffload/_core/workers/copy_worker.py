"""A *copy worker*: one direction's worker loop, its block copier and its completion bridge,
and the three mechanisms that move a transfer's copies (each in a module of its own):

* :mod:`.copy_submission`: the copier's calls, from callers' threads at call time or coalesced
  on the loop, under one lock;
* :mod:`.host_copy_jobs`: transfers between the cache and host slots, run without a task;
* :mod:`.transfer_tasks`: everything else, as tasks on the loop.

A transfer ends the same way whichever ran it (:func:`~.transfer_end.end_transfer`); what its
foreign calls raise becomes :class:`TransferError` at one place
(:func:`~..base.foreign.as_transfer_error`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from .copier import BlockCopier
from .copy_submission import CopyCalls, CopySubmitter, HandOver
from ..cuda.events import CompletionBridge
from .host_copy_jobs import HostCopyJobs
from .transfer import TransferControl
from .transfer_end import EndHook, JobSteps, end_transfer
from .transfer_tasks import TransferTasks
from .worker_loop import WorkerLoop

__all__ = ["CopyWorker", "CopyWorkers"]

log = logging.getLogger("kvoffload")


class CopyWorker:
    """One direction's worker: loop thread + block copier + completion bridge (None: CPU copies,
    complete when submitted), and its three mechanisms (see the module docstring)."""

    def __init__(
        self, kind: Literal["store", "load"], loop: WorkerLoop, copier: BlockCopier, bridge: CompletionBridge | None, calls: CopyCalls,
        depth: int = 3,
    ) -> None:
        self.kind = kind
        self.loop = loop
        self.submitter = CopySubmitter(kind, copier, calls)
        self.host_jobs = HostCopyJobs(kind, loop, self.submitter, bridge)
        self.tasks = TransferTasks(kind, loop, self.submitter, bridge, depth)

    @property
    def copier(self) -> BlockCopier:
        """The block copier (its submitter's)."""
        return self.submitter.copier

    @copier.setter
    def copier(self, copier: BlockCopier) -> None:
        self.submitter.copier = copier

    @property
    def bridge(self) -> CompletionBridge | None:
        """The completion bridge its host-copy jobs and tasks follow copies with."""
        return self.tasks.bridge

    @bridge.setter
    def bridge(self, bridge: CompletionBridge | None) -> None:
        self.host_jobs.bridge = self.tasks.bridge = bridge

    def abandon(self, hand_over: HandOver, control: TransferControl, steps: JobSteps, on_end: EndHook) -> None:
        """After an exception (a signal handler's ``KeyboardInterrupt``, say) cut short the hand-over of
        a transfer (``control``) anywhere between the making of ``hand_over`` and the worker's taking it: if the
        worker took it, cancel it (the worker ends it, once its copies have landed); else withdraw it
        (no worker touches it) and end it cancelled here: its copies waited for, ``steps.cleanup()``
        (slots and pins go back), ``on_end``, the end. Call from the interrupted thread, then re-raise."""
        if not hand_over.withdraw():
            control.transfer.cancel()
            return
        if hand_over.copies is not None:
            hand_over.copies.release()
        end_transfer(self.loop.name, control, steps.cleanup, on_end, None, None, True)


@dataclass(frozen=True)
class CopyWorkers:
    """The offloader's workers: stores and loads never wait behind each other, and expedited
    loads (host memory to the cache, on higher-priority streams) never wait behind loads."""

    store: CopyWorker
    load: CopyWorker
    expedited: CopyWorker | None = None
    """Only with ``Options.expedited_loads``."""
