"""kvoffload: asyncio-native offload of LLM KV-cache blocks to pinned host memory and back.

>>> async with kvoffload.Offloader(kv_caches, host_blocks=1024) as off:
...     await off.store({key: 3})
...     await off.load({key: 11})
"""

from .errors import CapacityError, ClosedError, MissingKeysError, OffloadError, TransferError
from .layout import BlockLayout
from .offloader import Offloader, OffloaderStats
from .transfer import Transfer, TransferResult

__all__ = [
    "Offloader",
    "OffloaderStats",
    "Transfer",
    "TransferResult",
    "BlockLayout",
    "OffloadError",
    "TransferError",
    "CapacityError",
    "MissingKeysError",
    "ClosedError",
]
__version__ = "0.1.0"
