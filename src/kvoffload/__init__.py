"""kvoffload: asyncio-native offload of LLM KV-cache blocks to pinned host memory and back.

>>> async with kvoffload.Offloader(kv_caches, host_blocks=1024) as off:
...     await off.store({key: 3})
...     await off.load({key: 11})

The implementation lives in the private ``kvoffload._core`` package; everything
public is re-exported here and reports ``kvoffload`` as its module.
"""

from ._core.base.errors import (
    CapacityError,
    ClosedError,
    CloseError,
    MissingKeysError,
    OffloadError,
    StartError,
    TransferCancelled,
    TransferError,
)
from ._core.base.layout import BlockLayout
from ._core.offloader import Lease, Offloader, OffloaderStats
from ._core.base.options import Options
from ._core.tiers.stats import LatencyHistogram
from ._core.workers.transfer import Transfer, TransferResult

# Not public (no name in __all__): helpers kvoffload's own integrations need (kvoffload.vllm), taken
# from here so that this module and kvoffload._testing are the only ones outside _core to import it.
from ._core.base import layout as _layout
from ._core.base import options as _options
from ._core.workers import worker_loop as _worker_loop

_slot_bytes_for = _layout.slot_bytes_for
_parse_size = _options.parse_size
_refuse_unknown_keys = _options.refuse_unknown_keys
_WorkerLoop = _worker_loop.WorkerLoop
del _layout, _options, _worker_loop


def _check_remote_url(url: str) -> None:
    """``ValueError`` unless ``url`` is a Redis URL the remote tier can use (nothing is connected)."""
    from ._core.tiers.remote.redis_store import check_url  # redis-py is optional: imported only for a remote tier

    check_url(url)

__all__ = [
    "Offloader",
    "Lease",
    "Options",
    "OffloaderStats",
    "LatencyHistogram",
    "Transfer",
    "TransferResult",
    "BlockLayout",
    "OffloadError",
    "TransferError",
    "TransferCancelled",
    "CapacityError",
    "MissingKeysError",
    "ClosedError",
    "StartError",
    "CloseError",
]
__version__ = "0.1.0"

# Users see kvoffload.Offloader, not kvoffload._core.offloader.Offloader, in reprs and tracebacks.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
