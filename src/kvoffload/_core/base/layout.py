"""Block geometry of a KV cache, and validation of the block mappings users pass.

A *block* is one index along dim 0 across every tensor of ``kv_caches``. In host
memory and on disk a block lives in one *slot*: the block's bytes of every tensor
packed back to back, padded to :data:`SLOT_ALIGN` so that a slot can be the
buffer of an O_DIRECT read or write as it is.

A tensor's bytes of one block form one or more *pieces*: one when ``t[b]`` is
contiguous (blocks may sit any stride apart: a view into a larger buffer), several
when it is not but splits along dim 1 into contiguous parts (``t.transpose(0, 1)``
of a ``(2, num_blocks, ...)`` tensor: a K piece and a V piece per block). The last
dimension must be contiguous, and no two blocks may share bytes, neither within a tensor nor
across tensors (views of one buffer are fine when they touch different bytes).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .call_checks import block_mapping
from .keys import check_keys

__all__ = ["SLOT_ALIGN", "BlockLayout", "TensorPiece", "check_block_mapping", "runs", "slot_bytes_for"]

SLOT_ALIGN = 4096
"""Slot size and slot addresses are multiples of this (safe for O_DIRECT)."""


def round_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def slot_bytes_for(block_bytes: int) -> int:
    """The size of the slot that holds a block of ``block_bytes``: rounded up to :data:`SLOT_ALIGN`."""
    return round_up(block_bytes, SLOT_ALIGN)


MAX_PIECES_PER_TENSOR = 64
"""A tensor whose blocks split into more pieces than this is refused: copies of tiny pieces crawl."""


@dataclass(frozen=True)
class TensorPiece:
    """Where one piece of a block sits: in its tensor (``name``, then ``index`` along dims 1.. when
    the tensor's blocks split into several pieces) and inside a slot (``offset``)."""

    name: str
    offset: int
    nbytes: int
    stride: int = 0
    """Bytes from one block's piece to the next in the tensor (``nbytes`` when blocks are packed)."""
    index: tuple[int, ...] = ()



@dataclass(frozen=True)
class BlockLayout:
    """Geometry shared by every tier: block count, bytes per block, slot packing."""

    pieces: tuple[TensorPiece, ...]
    num_blocks: int
    block_bytes: int
    slot_bytes: int
    device: torch.device

    @classmethod
    def of(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None = None) -> BlockLayout:
        """Validate ``kv_caches`` and describe its blocks.

        ``num_blocks``, if given, is the block count every tensor must have along dim 0
        (a tensor with blocks along another dim is refused with a hint, not misread).
        Raises ``TypeError`` for a non-mapping, non-tensor values, and tensors
        torch cannot view as bytes (quantized, sparse, nested, some dtypes);
        ``ValueError`` for an empty mapping, zero blocks, differing block counts,
        tensors on different devices, conjugate or negative views, tensors whose last
        dimension is not contiguous, and blocks that share bytes (within a tensor, or two
        tensors viewing the same memory: the message names both).
        """
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(kv_caches, Mapping):
            raise TypeError(f"kv_caches must be a mapping of name -> torch.Tensor, got {type(kv_caches).__name__}")
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        pieces: list[TensorPiece] = []
        placed: list[tuple[str, _Piece]] = []  # where each piece sits in memory, for the shared-bytes check
        offset = 0
        expected = num_blocks
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
            if expected is not None and t.shape[0] != expected:
                hint = _blocks_first_hint(name, t, expected)
                raise ValueError(f"kv_caches[{name!r}] has {t.shape[0]} along dim 0, not num_blocks={expected}{hint}")
            if expected is None:
                expected = t.shape[0]
            elif t.shape[0] != expected:
                raise ValueError(f"kv_caches[{name!r}] has {t.shape[0]} blocks, the first tensor has {expected}")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"kv_caches[{name!r}] is on {t.device}, the first tensor is on {device}")
            if t.numel() == 0:
                raise ValueError(f"kv_caches[{name!r}] has blocks of zero bytes (shape {tuple(t.shape)})")
            try:  # what block_rows does; a dtype torch cannot view as bytes fails here, not at start()
                t.untyped_storage()
                torch.empty(0, dtype=t.dtype).view(torch.uint8)
            except (RuntimeError, NotImplementedError, TypeError) as e:
                raise TypeError(f"kv_caches[{name!r}] ({t.dtype}) cannot be viewed as bytes: {e}") from None
            for piece in _pieces_of(name, t):
                pieces.append(TensorPiece(name, offset, piece.nbytes, piece.stride, piece.index))
                placed.append((name, piece))
                offset += piece.nbytes
        num_blocks = expected
        assert num_blocks is not None and device is not None
        _check_no_shared_bytes(placed, num_blocks, kv_caches)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(tuple(pieces), int(num_blocks), offset, slot_bytes_for(offset), device)

    @functools.cached_property
    def is_cuda(self) -> bool:
        """True when the cache lives in GPU memory (asked once: an attribute from then on)."""
        return self.device.type == "cuda"

    def blocks_per_chunk(self, chunk_bytes: int) -> int:
        """Blocks in a copy chunk (or bounce half) of ``chunk_bytes``: whole slots, at least one."""
        return max(1, chunk_bytes // self.slot_bytes)

    def block_rows(self, kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Each piece viewed as ``uint8[num_blocks, piece_bytes]``, rows ``stride`` bytes apart (no copy)."""
        rows = []
        for p in self.pieces:
            t = kv_caches[p.name]
            part = t
            for i in p.index:
                part = part.select(1, i)
            start = part.storage_offset() * part.element_size()
            view = torch.empty(0, dtype=torch.uint8, device=t.device)
            view.set_(part.untyped_storage(), start, (self.num_blocks, p.nbytes), (p.stride, 1))
            rows.append(view)
        return rows

    def piece_table(self, rows: Sequence[torch.Tensor]) -> np.ndarray:
        """Where each piece's bytes are, in :attr:`pieces` order (``rows``: :meth:`block_rows`), for the
        copy loops of :mod:`.piece_copies`: ``uint64[pieces, 4]`` rows of (cache address of block 0,
        block stride, offset in a host slot, bytes): block ``b``'s piece is at ``address + b * stride``
        in its tensor and at ``offset`` in a slot, ``bytes`` long."""
        table = [(r.data_ptr(), p.stride, p.offset, p.nbytes) for r, p in zip(rows, self.pieces)]
        return np.array(table, dtype=np.uint64).reshape(len(table), 4)


@dataclass(frozen=True)
class _Piece:
    nbytes: int
    stride: int
    index: tuple[int, ...]
    start: int  # byte address of block 0's piece (for the overlap check)


def _pieces_of(name: str, t: torch.Tensor) -> list[_Piece]:
    """Split ``t``'s blocks into contiguous pieces along dims 1.. (see the module docstring)."""
    es = t.element_size()
    if t.dim() > 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"kv_caches[{name!r}]'s last dimension is not contiguous (strides {t.stride()}): "
            "pieces of one element would crawl; pass a tensor whose rows are contiguous"
        )
    out: list[_Piece] = []

    def split(part: torch.Tensor, index: tuple[int, ...]) -> None:
        if part[0].is_contiguous():
            stride = part.stride(0) * es if part.shape[0] > 1 else part[0].numel() * es
            out.append(_Piece(part[0].numel() * es, stride, index, part.data_ptr()))
        elif part.dim() > 2:
            for i in range(part.shape[1]):
                split(part[:, i], (*index, i))
                if len(out) > MAX_PIECES_PER_TENSOR:
                    break
        else:
            raise ValueError(f"kv_caches[{name!r}]: a block's bytes are not contiguous along its last dims (strides {t.stride()})")

    split(t, ())
    if len(out) > MAX_PIECES_PER_TENSOR:
        raise ValueError(
            f"kv_caches[{name!r}] (strides {t.stride()}) splits into more than {MAX_PIECES_PER_TENSOR} pieces per block: "
            "make the block dimension the outer one of a contiguous tensor"
        )
    if t.shape[0] > 1 and any(p.stride < p.nbytes for p in out):
        raise ValueError(f"kv_caches[{name!r}]: blocks overlap or run backwards (strides {t.stride()})")
    return out


def _blocks_first_hint(name: str, t: torch.Tensor, num_blocks: int) -> str:
    """For a tensor whose dim 0 is not ``num_blocks``: a view with the blocks first that would be
    accepted, or, when no such view is, the copy it takes; ``""`` when no dim has ``num_blocks``."""
    dims = [d for d in range(1, t.dim()) if t.shape[d] == num_blocks]
    for d in dims:
        for how in ("transpose", "movedim") if d > 1 else ("transpose",):  # movedim(1, 0) is transpose(0, 1)
            args = (0, d) if how == "transpose" else (d, 0)
            view = getattr(t, how)(*args)
            try:
                _check_no_shared_bytes([(name, p) for p in _pieces_of(name, view)], num_blocks, {name: view})
            except ValueError:
                continue
            return f"; its blocks look like dim {d}: pass t.{how}({args[0]}, {args[1]}) (no copy)"
    if not dims:
        return ""
    d = dims[0]
    return (
        f"; its blocks look like dim {d}, but no view of it with them along dim 0 can be used without a copy: "
        f"the cache needs its blocks outermost in memory, a copy such as t.movedim({d}, 0).contiguous() that the "
        "engine then uses as its cache"
    )


_ONE_ROW = 1 << 62
"""The stride given to every piece of a one-block cache: each piece is then one byte interval."""


def _check_no_shared_bytes(placed: Sequence[tuple[str, _Piece]], num_blocks: int, caches: Mapping[str, torch.Tensor]) -> None:
    """Refuse (``ValueError``) pieces of ``caches`` that share a byte, in one tensor or across two.

    Exact: views of one buffer that touch different bytes (K and V halves, interleaved layers,
    other strides in each other's gaps) pass. Pieces are grouped by overlapping extent (separate
    allocations are never compared), then compared per stride as rectangles, and across strides
    block by block.
    """
    n = num_blocks
    pieces = [p for _, p in placed]
    stride = [p.stride if n > 1 else _ONE_ROW for p in pieces]
    for group in _overlapping_extents(pieces, stride, n):
        if len(group) > 1 and (pair := _shared_in_group(group, pieces, stride, n)):
            a, b = (placed[i][0] for i in pair)
            if a == b:
                raise ValueError(f"kv_caches[{a!r}]: two blocks share bytes (strides {caches[a].stride()})")
            raise ValueError(
                f"kv_caches[{a!r}] and kv_caches[{b!r}] share bytes: a load into one would overwrite the other; "
                "pass tensors over separate memory (views of one buffer are fine when they touch different bytes)"
            )


def _overlapping_extents(pieces: list[_Piece], stride: list[int], n: int) -> list[list[int]]:
    """The pieces' indices in groups such that the extents (first to last byte) of pieces in
    different groups do not overlap: only pieces of one group can share bytes."""
    spans = sorted((p.start, p.start + (n - 1) * stride[i] + p.nbytes, i) for i, p in enumerate(pieces))
    groups: list[list[int]] = []
    end = 0
    for lo, hi, i in spans:
        if groups and lo < end:
            groups[-1].append(i)
            end = max(end, hi)
        else:
            groups.append([i])
            end = hi
    return groups


def _shared_in_group(group: list[int], pieces: list[_Piece], stride: list[int], n: int) -> tuple[int, int] | None:
    """Two pieces of ``group`` that share a byte, or ``None``."""
    by_stride: dict[int, list[int]] = {}
    for i in group:
        by_stride.setdefault(stride[i], []).append(i)
    for s, members in by_stride.items():
        if len(members) > 1 and (pair := _shared_at_one_stride(members, pieces, s, n)):
            return pair
    strides = list(by_stride)
    for x, s in enumerate(strides):
        for t in strides[x + 1 :]:
            for i in by_stride[s]:
                for j in by_stride[t]:
                    if _progressions_meet(pieces[i], pieces[j], n):
                        return i, j
    return None


def _shared_at_one_stride(members: list[int], pieces: list[_Piece], s: int, n: int) -> tuple[int, int] | None:
    """Two pieces, all ``s`` bytes from block to block, that share a byte, or ``None``.

    Byte ``x`` is cell ``(x // s, x % s)`` of a grid ``s`` wide: a piece covers the rectangle of rows
    ``start // s`` .. ``+ n`` and columns ``start % s`` .. ``+ nbytes``, and a second one, a row down,
    for the columns that wrap past ``s``. Pieces share bytes exactly when their rectangles meet.
    """
    rects = []
    for i in members:
        row, col = divmod(pieces[i].start, s)
        end = col + pieces[i].nbytes
        rects.append((col, min(end, s), row, row + n, i))
        if end > s:
            rects.append((0, end - s, row + 1, row + n + 1, i))
    rects.sort()
    active: list[tuple[int, int, int, int, int]] = []  # rectangles whose columns reach the current one's
    for rect in rects:
        col, _, row, row_end, i = rect
        active = [a for a in active if a[1] > col]
        for a in active:
            if a[4] != i and a[2] < row_end and row < a[3]:
                return a[4], i
        active.append(rect)
    return None


def _progressions_meet(p: _Piece, q: _Piece, n: int) -> bool:
    """True when some block's ``p`` shares a byte with some block's ``q`` (any strides >= their sizes)."""
    if p.start + (n - 1) * p.stride + p.nbytes <= q.start or q.start + (n - 1) * q.stride + q.nbytes <= p.start:
        return False
    blocks = np.arange(n, dtype=np.int64)
    p_starts = p.start + blocks * p.stride
    q_starts = q.start + blocks * q.stride
    last_before_end = np.searchsorted(q_starts, p_starts + p.nbytes, side="left") - 1  # q's blocks are sorted and disjoint
    return bool(((last_before_end >= 0) & (q_starts[np.maximum(last_before_end, 0)] + q.nbytes > p_starts)).any())


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


def check_block_mapping(blocks: object, num_blocks: int, *, unique_ids: bool, call: str) -> dict[Hashable, int]:
    """Validate a ``key -> block id`` mapping before anything is queued (``call``: the public call, for
    the messages).

    Returns a plain dict with the ids as ``int``. ``TypeError`` for a non-mapping, a key that is not
    native (:func:`~.keys.check_keys`: checked first, before any key is hashed) or a non-integer id;
    ``ValueError`` for an id outside ``[0, num_blocks)`` or, with ``unique_ids``, two keys naming the
    same block.
    """
    plain = block_mapping(blocks, num_blocks, unique_ids)  # the common case, at C speed: a dict that passes
    if plain is not None:
        return plain
    if not isinstance(blocks, Mapping):
        raise TypeError(f"blocks must be a mapping of key -> block id, got {type(blocks).__name__}")
    check_keys(call, blocks)
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
        _refuse_duplicate_ids(checked)
    return checked


def _refuse_duplicate_ids(checked: dict[Hashable, int]) -> None:
    """``ValueError`` naming the first two keys of ``checked`` with the same block id."""
    seen: dict[int, Hashable] = {}
    for key, bid in checked.items():
        if bid in seen:
            raise ValueError(f"keys {seen[bid]!r} and {key!r} both name destination block {bid}")
        seen[bid] = key


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
