"""Block geometry of a KV cache, and validation of the block mappings users pass.

A *block* is one index along dim 0 across every tensor of ``kv_caches``. In host
memory and on disk a block lives in one *slot*: the block's bytes of every tensor
packed back to back, padded to :data:`SLOT_ALIGN` so that a slot can be the
buffer of an O_DIRECT read or write as it is.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SLOT_ALIGN", "BlockLayout", "TensorPiece", "check_block_mapping", "runs"]

SLOT_ALIGN = 4096
"""Slot size and slot addresses are multiples of this (safe for O_DIRECT)."""


def round_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


@dataclass(frozen=True)
class TensorPiece:
    """Where one tensor's bytes of a block sit inside a slot."""

    name: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    """Geometry shared by every tier: block count, bytes per block, slot packing."""

    pieces: tuple[TensorPiece, ...]
    num_blocks: int
    block_bytes: int
    slot_bytes: int
    device: torch.device

    @classmethod
    def of(cls, kv_caches: Mapping[str, torch.Tensor]) -> BlockLayout:
        """Validate ``kv_caches`` and describe its blocks.

        Raises ``TypeError`` for a non-mapping, non-tensor values, and tensors
        torch cannot view as bytes (quantized, sparse, nested, some dtypes);
        ``ValueError`` for an empty mapping, zero blocks, differing block counts,
        tensors on different devices, conjugate or negative views, or tensors
        whose blocks are not contiguous.
        """
        if not isinstance(kv_caches, Mapping):
            raise TypeError(f"kv_caches must be a mapping of name -> torch.Tensor, got {type(kv_caches).__name__}")
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        pieces = []
        offset = 0
        num_blocks = None
        device = None
        for name, t in kv_caches.items():
            if not isinstance(name, str):
                raise TypeError(f"kv_caches keys must be str, got {type(name).__name__}")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_caches[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
            _check_plain_memory(name, t)
            if t.dim() < 1 or t.shape[0] == 0:
                raise ValueError(f"kv_caches[{name!r}] has no blocks along dim 0 (shape {tuple(t.shape)})")
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"kv_caches[{name!r}] is on {t.device}; only cpu and cuda are supported")
            if num_blocks is None:
                num_blocks, device = t.shape[0], t.device
            elif t.shape[0] != num_blocks:
                raise ValueError(f"kv_caches[{name!r}] has {t.shape[0]} blocks, the first tensor has {num_blocks}")
            elif t.device != device:
                raise ValueError(f"kv_caches[{name!r}] is on {t.device}, the first tensor is on {device}")
            if not t.is_contiguous():
                raise ValueError(
                    f"kv_caches[{name!r}] is not contiguous (strides {t.stride()}): each block must be one contiguous run of bytes"
                )
            nbytes = t.numel() // t.shape[0] * t.element_size()  # not stride(0): a size-1 dim may have any stride
            if nbytes == 0:
                raise ValueError(f"kv_caches[{name!r}] has blocks of zero bytes (shape {tuple(t.shape)})")
            try:  # what block_rows does; a dtype torch cannot view as bytes fails here, not at start()
                t.view(-1).view(torch.uint8)
            except (RuntimeError, NotImplementedError) as e:
                raise TypeError(f"kv_caches[{name!r}] ({t.dtype}) cannot be viewed as bytes: {e}") from None
            pieces.append(TensorPiece(name, offset, nbytes))
            offset += nbytes
        assert num_blocks is not None and device is not None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(tuple(pieces), int(num_blocks), offset, round_up(offset, SLOT_ALIGN), device)

    @property
    def is_cuda(self) -> bool:
        """True when the cache lives in GPU memory."""
        return self.device.type == "cuda"

    def block_rows(self, kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor viewed as ``uint8[num_blocks, piece_bytes]`` (no copy)."""
        return [kv_caches[p.name].view(-1).view(torch.uint8).view(self.num_blocks, p.nbytes) for p in self.pieces]


def _check_plain_memory(name: str, t: torch.Tensor) -> None:
    """Refuse tensors whose memory is not simply their values (``TypeError`` / ``ValueError``).

    Checked before anything else touches ``t`` (a quantized cache, once accepted,
    crashed the process at ``start()``).
    """
    if t.is_nested:
        raise TypeError(f"kv_caches[{name!r}] is a nested tensor; pass dense (torch.strided) tensors")
    if t.layout != torch.strided:
        raise TypeError(f"kv_caches[{name!r}] has layout {t.layout}; pass dense (torch.strided) tensors")
    if t.is_quantized:
        raise TypeError(
            f"kv_caches[{name!r}] is quantized ({t.dtype}): its scale and zero point are not in its memory; "
            "keep the cache in a plain dtype"
        )
    if t.is_conj():
        raise ValueError(
            f"kv_caches[{name!r}] is a conjugate view: its memory holds the unconjugated values; pass the tensor it views"
        )
    if t.is_neg():
        raise ValueError(
            f"kv_caches[{name!r}] is a negative view: its memory holds the negated values; pass the tensor it views"
        )


def check_block_mapping(blocks: object, num_blocks: int, *, unique_ids: bool) -> dict[Hashable, int]:
    """Validate a ``key -> block id`` mapping before anything is queued.

    Returns a plain dict with the ids as ``int``. ``TypeError`` for a non-mapping
    or a non-integer id; ``ValueError`` for an id outside ``[0, num_blocks)`` or,
    with ``unique_ids``, two keys naming the same block.
    """
    if not isinstance(blocks, Mapping):
        raise TypeError(f"blocks must be a mapping of key -> block id, got {type(blocks).__name__}")
    checked: dict[Hashable, int] = {}
    for key, block in blocks.items():
        if type(block) is int and 0 <= block < num_blocks:  # the common case, checked cheaply
            checked[key] = block
            continue
        if isinstance(block, bool) or getattr(block, "dtype", None) in (torch.bool, np.bool_):
            raise TypeError(f"block id for key {key!r} must be an integer, got a bool")
        try:
            bid = operator.index(block)
        except TypeError:
            raise TypeError(f"block id for key {key!r} must be an integer, got {type(block).__name__}") from None
        if not 0 <= bid < num_blocks:
            raise ValueError(f"block id {bid} for key {key!r} is out of range [0, {num_blocks})")
        checked[key] = bid
    if unique_ids and len(set(checked.values())) != len(checked):
        seen: dict[int, Hashable] = {}
        for key, bid in checked.items():
            if bid in seen:
                raise ValueError(f"keys {seen[bid]!r} and {key!r} both name destination block {bid}")
            seen[bid] = key
    return checked


def runs(*seqs: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Split equal-length index sequences where any of them stops counting up by one.

    Returns ``(starts, lengths)``: positions ``starts[j] .. starts[j]+lengths[j]-1``
    are consecutive in every sequence, so each run is one contiguous copy.
    """
    n = len(seqs[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if n <= 32:  # small transfers: plain Python beats numpy's per-call overhead
        starts = [0]
        for i in range(1, n):
            if any(s[i] != s[i - 1] + 1 for s in seqs):
                starts.append(i)
        st = np.array(starts, dtype=np.int64)
        return st, np.diff(np.append(st, n))
    breaks = np.zeros(n - 1, dtype=bool)
    for s in seqs:
        breaks |= np.diff(np.asarray(s, dtype=np.int64)) != 1
    at = np.concatenate(([0], np.flatnonzero(breaks) + 1))
    return at, np.diff(np.concatenate((at, [n])))
