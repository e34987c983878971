"""SGLang 0.5.23's own classes on a CPU machine, for tests/test_sglang.py and the bench.

SGLang is installed with ``pip install --no-deps sglang==0.5.23`` beside the pinned CPU torch, and
the ``test`` extra adds the pure-Python packages its HiCache modules import. Two imports cannot be
satisfied that way, and are stubbed here before SGLang is imported (:func:`install_stubs`), each only
when the real package is missing:

* ``torchvision``: PyPI's wheels are built against CUDA torch (their ``_C`` needs ``libc10_cuda.so``)
  and fail at import beside a CPU torch. SGLang's model configs import ``torchvision.transforms`` at
  module level (never called here). The stub is a package whose every module has
  ``InterpolationMode`` (a real enum with torchvision's members: transformers builds a mapping from
  them when it sees torchvision) and whose other names are classes that raise if instantiated.
* ``IPython``: ``sglang/utils.py`` imports ``IPython.display`` (``HTML``, ``display``: notebook output) at
  module level. The stub gives those two names, raising if used.

Nothing else is stubbed: SGLang's storage interface, backend factory, device pools
(``MHATokenToKVPool``/``MLATokenToKVPool`` on ``device="cpu"``), host pools and cache controller are
SGLang's own code.
"""

from __future__ import annotations

import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

SGLANG_VERSION = "0.5.23"


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode's members."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Unavailable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__module__}.{type(self).__name__} is a test stub (torchvision is not installed)")


def _stub_attribute(module: str):
    def attribute(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Unavailable,), {"__module__": module})
    return attribute


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``torchvision`` module, stubbed (found only when no real torchvision is)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__version__ = "0.0.0+stub"  # type: ignore[attr-defined]
        module.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
        module.__getattr__ = _stub_attribute(module.__name__)  # type: ignore[method-assign]


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def install_stubs() -> list[str]:
    """Stub what SGLang imports that cannot be installed beside a CPU torch; the names stubbed."""
    stubbed = []
    if not any(isinstance(f, _TorchvisionStub) for f in sys.meta_path) and _missing("torchvision"):
        sys.meta_path.append(_TorchvisionStub())
        stubbed.append("torchvision")
    if "IPython" not in sys.modules and _missing("IPython"):
        ipython = types.ModuleType("IPython")
        ipython.__spec__ = importlib.machinery.ModuleSpec("IPython", None, is_package=True)
        ipython.__path__ = []
        display = types.ModuleType("IPython.display")
        display.__spec__ = importlib.machinery.ModuleSpec("IPython.display", None)
        display.HTML = type("HTML", (_Unavailable,), {"__module__": "IPython.display"})  # type: ignore[attr-defined]

        def show(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("IPython.display.display is a test stub (IPython is not installed)")

        display.display = show  # type: ignore[attr-defined]
        ipython.display = display  # type: ignore[attr-defined]
        sys.modules["IPython"] = ipython
        sys.modules["IPython.display"] = display
        stubbed.append("IPython")
    return stubbed


def sglang_available() -> str | None:
    """None when SGLang's HiCache classes import here, else why not."""
    if _missing("sglang"):
        return f"SGLang is not installed: pip install --no-deps sglang=={SGLANG_VERSION}"
    install_stubs()
    try:
        for module in ("sglang.srt.mem_cache.pool_host.mha", "sglang.srt.mem_cache.storage.backend_factory"):
            importlib.import_module(module)
    except ImportError as e:
        return f"SGLang's HiCache classes do not import: {e}"
    return None


# -- SGLang's real pools on CPU tensors ----------------------------------------------------------

def device_pool(mla: bool, *, tokens: int = 256, page_size: int = 4, layers: int = 3, dtype: Any = None) -> Any:
    """SGLang's own device KV pool on ``device="cpu"``: MHA (2 heads of 16) or MLA (rank 32 + rope 16)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    dtype = dtype or torch.bfloat16
    if mla:
        return MLATokenToKVPool(tokens, page_size, dtype, 32, 16, layers, "cpu", False, start_layer=0, end_layer=layers)
    return MHATokenToKVPool(tokens, page_size, dtype, 2, 16, layers, "cpu", False, start_layer=0, end_layer=layers)


def host_pool(device: Any, layout: str, *, ratio: float = 2.0) -> Any:
    """SGLang's own host pool over ``device`` (unpinned: CPU machines), in ``layout``."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    info = device.get_device_pool_infos()[0].buffer_info
    common = dict(device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer)
    if isinstance(device, MLATokenToKVPool):
        return MLATokenToKVPoolHost(info, ratio, 0, device.page_size, layout, pin_memory=False,
                                    target_layer_num=device.layer_num, override_kv_cache_dim=device.kv_cache_dim, **common)
    return MHATokenToKVPoolHost(info, ratio, 0, device.page_size, layout, pin_memory=False,
                                write_back_staging=device.hicache_write_back_staging, **common)


def storage_config(extra: dict[str, Any], *, mla: bool = False, model: str = "test/model", tp_rank: int = 0,
                   tp_size: int = 1, dp_rank: int = 0, metrics: bool = False, page_first: bool = False) -> Any:
    """SGLang's ``HiCacheStorageConfig`` as its cache controller builds it for one rank."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=metrics, is_page_first_layout=page_first, model_name=model, dp_rank=dp_rank,
        extra_config=dict(extra),
    )


def backend_config(**kvoffload: Any) -> dict[str, Any]:
    """The extra config of ``--hicache-storage-backend dynamic`` for kvoffload, with ``kvoffload``'s settings."""
    return {"backend_name": "kvoffload", "module_path": "kvoffload.sglang", "class_name": "KvoffloadStorage",
            "interface_v1": 1, **kvoffload}


def create_backend(config: Any, pool: Any) -> Any:
    """The backend built as SGLang's cache controller builds it: the factory, then the host pool."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend
