"""Which caches the offloader takes.

Tensors torch cannot view as bytes (quantized, conjugate or negative views, sparse, nested) are
refused when the Offloader is constructed, with TypeError or ValueError naming the problem --
before anything reads their memory (a quantized cache used to crash the process at start()).
Everything torch can view as bytes is taken and round-trips byte for byte: every such dtype, 1-D
caches, tensors requiring grad, inference tensors, views at a storage offset. Caches that share
bytes are refused with a ValueError naming both (exactly: checked against the byte sets of random
strided views); views of one buffer that touch different bytes round-trip and leave the rest alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvoffload

N = 8  # blocks per cache; blocks 0..3 are stored, then loaded into 4..7


def random_bits(shape, dtype, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    es = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * es,), generator=g, dtype=torch.uint8).view(dtype).view(shape).requires_grad_(
        kw.get("requires_grad", False)
    )


def _viewable_dtypes():
    """Every dtype torch can view as bytes, once each (torch.float is torch.float32)."""
    seen = []
    for name in sorted(dir(torch)):
        d = getattr(torch, name)
        if not isinstance(d, torch.dtype) or d in seen:
            continue
        try:
            with warnings.catch_warnings():  # complex32 is experimental, quantized dtypes deprecated
                warnings.simplefilter("ignore")
                torch.empty(4, 4, dtype=d).view(-1).view(torch.uint8)
                torch.zeros(16, dtype=torch.uint8).view(d)
        except Exception:
            continue
        seen.append(d)
    return seen


VIEWABLE = _viewable_dtypes()


def test_the_common_dtypes_are_among_those_checked():
    want = {torch.bool, torch.complex64, torch.complex128, torch.bfloat16, torch.float16, torch.float32, torch.float64,
            torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
    want |= {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)}
    assert want <= set(VIEWABLE)


def raw(t):
    """``t`` as ``uint8[N, bytes per block]`` (no copy, outside autograd)."""
    return t.detach().reshape(-1).view(torch.uint8).view(t.shape[0], -1)


def round_trip(off, caches):
    """Store blocks 0..3, load them into 4..7; every byte arrives and nothing else changes."""
    before = {n: raw(t).clone() for n, t in caches.items()}
    inference = any(t.is_inference() for t in caches.values())
    with torch.inference_mode(inference):
        for t in caches.values():
            raw(t)[4:].zero_()
    off.store({("k", i): i for i in range(4)}).result(10)
    off.load({("k", i): 4 + i for i in range(4)}).result(10)
    for n, t in caches.items():
        assert torch.equal(raw(t)[4:], before[n][:4]), n
        assert torch.equal(raw(t)[:4], before[n][:4]), n


def _accepted():
    cases = {f"dtype-{str(d).removeprefix('torch.')}": lambda d=d: {"kv": random_bits((N, 3, 16), d)} for d in VIEWABLE}
    cases["1-d"] = lambda: {"a": random_bits((N,), torch.float32), "b": random_bits((N,), torch.bool, seed=1)}
    cases["requires-grad"] = lambda: {"kv": random_bits((N, 4, 8), torch.float32, requires_grad=True)}

    def inference():
        with torch.inference_mode():
            return {"kv": random_bits((N, 4, 8), torch.bfloat16).clone()}

    cases["inference-tensor"] = inference

    def offset_views():
        big = random_bits((3 + N + 5, 4, 8), torch.float16)
        kv = random_bits((2, N, 2, 8), torch.float32, seed=2)
        return {"mid": big[3 : 3 + N], "k": kv[0], "v": kv[1]}

    cases["storage-offset-views"] = offset_views
    return cases


ACCEPTED = _accepted()


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_accepted_caches_round_trip_byte_for_byte(make_offloader, case):
    caches = ACCEPTED[case]()
    off = make_offloader(caches, host_blocks=8)
    round_trip(off, caches)


def test_storage_offset_views_leave_the_rest_of_their_tensor_alone(make_offloader):
    big = random_bits((3 + N + 5, 4, 8), torch.float16)
    outside = torch.cat([raw(big)[:3], raw(big)[3 + N :]]).clone()
    off = make_offloader({"mid": big[3 : 3 + N]}, host_blocks=8)
    round_trip(off, {"mid": big[3 : 3 + N]})
    assert torch.equal(torch.cat([raw(big)[:3], raw(big)[3 + N :]]), outside)


def test_odd_caches_round_trip_through_a_disk_only_offloader(make_offloader, tmp_path):
    kv = random_bits((2, N, 3, 8), torch.complex64, seed=3)
    caches = {
        "bool": random_bits((N, 7), torch.bool, seed=4),
        "c128": random_bits((N, 2), torch.complex128, seed=5),
        "fp8": random_bits((N, 33), getattr(torch, "float8_e4m3fn", torch.uint8), seed=6),
        "1d": random_bits((N,), torch.int64, seed=7),
        "grad": random_bits((N, 5), torch.float32, seed=8, requires_grad=True),
        "k": kv[0],
        "v": kv[1],
    }
    off = make_offloader(caches, host_blocks=0, disk_path=tmp_path / "kv", disk_blocks=8)
    round_trip(off, caches)


def _refused():
    x = random_bits((N, 4), torch.complex64)
    return {
        "conj-view": (lambda: x.conj(), "conjugate"),
        "neg-view-imag-of-conj": (lambda: x.conj().imag, "negative"),
        "neg-view": (lambda: torch._neg_view(random_bits((N, 4), torch.float32)), "negative"),
        "sparse-coo": (lambda: torch.eye(N).to_sparse(), "sparse"),
        "sparse-csr": (lambda: torch.eye(N).to_sparse_csr(), "sparse"),
        "nested": (lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(3, 3)]), "nested"),
        "nested-jagged": (lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(3, 3)], layout=torch.jagged), "nested"),
    }


REFUSED = _refused()


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR and nested tensors are beta/prototype
@pytest.mark.parametrize("case", list(REFUSED))
def test_caches_torch_cannot_view_as_bytes_are_refused_at_construction(case):
    make, word = REFUSED[case]
    t = make()
    for caches in ({"bad": t}, {"good": torch.zeros(N, 4), "bad": t}):
        with pytest.raises((TypeError, ValueError), match=word) as ei:
            kvoffload.Offloader(caches, host_blocks=4)
        assert "'bad'" in str(ei.value)


@pytest.mark.parametrize("qdtype", ["quint8", "qint8", "qint32"])
@pytest.mark.slow
def test_quantized_caches_are_refused_at_construction(qdtype):
    # in a subprocess: viewing a quantized tensor's memory as bytes crashed the process
    code = textwrap.dedent(f"""
        import torch, kvoffload
        q = torch.quantize_per_tensor(torch.randn(8, 4), 0.1, 0, torch.{qdtype})
        try:
            off = kvoffload.Offloader({{"q": q}}, host_blocks=4)
        except (TypeError, ValueError) as e:
            print("refused:", type(e).__name__, e)
        else:
            print("accepted")
            with off:
                off.store({{"a": 0}}).result(10)
            print("started")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stdout} {proc.stderr[-2000:]}"
    assert "refused:" in proc.stdout and "quantized" in proc.stdout, proc.stdout + proc.stderr[-2000:]


# -- caches that share memory ------------------------------------------------------------------------


def _aliasing():
    """Caches two of which share bytes: a load into one would write the other."""
    buf = random_bits((N + 1, 16), torch.float32)
    raw_bytes = random_bits((128 * N,), torch.uint8)
    return {
        "shifted-window": lambda: {"a": buf[0:N], "b": buf[1 : N + 1]},
        "same-tensor-twice": lambda: {"a": buf[:N], "b": buf[:N]},
        "one-byte": lambda: {"a": raw_bytes[: 16 * N].view(N, 16), "b": raw_bytes[16 * N - 1 : 32 * N - 1].view(N, 16)},
        "other-stride": lambda: {"a": raw_bytes[: 64 * N].view(N, 64)[:, :16], "b": raw_bytes.view(N, 128)[:, 8:24]},
        "half-of-a-kv-view": lambda: {"kv": buf[:N].view(N, 2, 8), "v": buf[:N, 8:]},
        "one-block": lambda: {"a": buf[:1], "b": buf[:2].view(1, 32)},
        "third-of-three": lambda: {"x": random_bits((N, 4), torch.int32), "a": buf[:N], "b": buf.view(-1)[4 : 4 + 16 * N].view(N, 16)},
    }


ALIASING = _aliasing()


@pytest.mark.parametrize("case", list(ALIASING))
def test_caches_that_share_bytes_are_refused_naming_both(case):
    caches = ALIASING[case]()
    with pytest.raises(ValueError, match="share bytes") as ei:
        kvoffload.Offloader(caches, host_blocks=4)
    named = [n for n in caches if f"'{n}'" in str(ei.value)]
    assert len(named) == 2 and "x" not in named, str(ei.value)


def _disjoint_views():
    """Views of one buffer that touch disjoint bytes: ``(buffer, views of it)``."""
    return {
        "kv-halves": (lambda: random_bits((2, N, 4, 8), torch.float16), lambda b: {"k": b[0], "v": b[1]}),
        "adjacent-windows": (lambda: random_bits((2 * N, 4, 8), torch.float16), lambda b: {"a": b[:N], "b": b[N:]}),
        "interleaved-layers": (lambda: random_bits((N, 3, 16), torch.bfloat16), lambda b: {f"l{i}": b[:, i] for i in range(3)}),
        "kv-transposed-per-layer": (  # (2, N, layers, ...): each layer a K piece and a V piece per block
            lambda: random_bits((2, N, 3, 16), torch.float32),
            lambda b: {f"l{i}": b[:, :, i].transpose(0, 1) for i in range(3)},
        ),
        "kv-transposed-and-a-window": (
            lambda: random_bits((3, N, 16), torch.int16),
            lambda b: {"kv": b[:2].transpose(0, 1), "rest": b[2]},
        ),
        "other-strides-in-the-gaps": (  # bytes [64k, 64k+16) and [128j+32, 128j+48)
            lambda: random_bits((128 * N,), torch.uint8),
            lambda b: {"a": b[: 64 * N].view(N, 64)[:, :16], "b": b.view(N, 128)[:, 32:48]},
        ),
    }


DISJOINT = _disjoint_views()


@pytest.mark.parametrize("case", list(DISJOINT))
def test_views_of_one_buffer_touching_disjoint_bytes_round_trip_and_leave_the_rest_alone(make_offloader, case):
    make_buffer, views_of = DISJOINT[case]
    buf = make_buffer()
    expected = buf.clone()  # every view's blocks 0..3 copied into its blocks 4..7, nothing else touched
    for v in views_of(expected).values():
        v[4:] = v[:4].clone()
    caches = views_of(buf)
    off = make_offloader(caches, host_blocks=8)
    off.store({("k", i): i for i in range(4)}).result(10)
    off.load({("k", i): 4 + i for i in range(4)}).result(10)
    assert torch.equal(buf.view(-1).view(torch.uint8), expected.view(-1).view(torch.uint8))


strided_view = st.tuples(
    st.integers(1, 3),  # rows per block
    st.integers(1, 8),  # bytes per row
    st.integers(0, 8),  # gap after each row
    st.integers(0, 40),  # bytes from one block to the next, beyond its rows
    st.integers(0, 48),  # storage offset
)


@settings(max_examples=300, deadline=None, database=None)
@given(n=st.integers(1, 6), views=st.lists(strided_view, min_size=2, max_size=3))
def test_strided_views_of_one_buffer_are_refused_exactly_when_they_share_bytes(n, views):
    made = []  # (shape, strides, storage offset) of each view, in bytes
    for rows, cols, row_gap, block_gap, offset in views:
        block_extent = (rows - 1) * (cols + row_gap) + cols
        made.append(((n, rows, cols), (block_extent + block_gap, cols + row_gap, 1), offset))
    size = max(offset + (n - 1) * strides[0] + (rows - 1) * strides[1] + cols for (_, rows, cols), strides, offset in made)
    buf = torch.zeros(size, dtype=torch.uint8)
    addresses = torch.arange(size)
    caches = {f"v{i}": buf.as_strided(shape, strides, offset) for i, (shape, strides, offset) in enumerate(made)}
    bytes_of = {name: set(addresses.as_strided(shape, strides, offset).reshape(-1).tolist())
                for name, (shape, strides, offset) in zip(caches, made)}
    shared = [(a, b) for a in caches for b in caches if a < b and bytes_of[a] & bytes_of[b]]
    try:
        kvoffload.Offloader(caches, host_blocks=4)
    except ValueError as e:
        assert shared, f"refused views that share no bytes: {e}"
        assert "share bytes" in str(e) and any(f"'{a}'" in str(e) and f"'{b}'" in str(e) for a, b in shared), e
    else:
        assert not shared, f"accepted {shared[0]} sharing bytes"
