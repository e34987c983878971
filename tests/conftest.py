"""Shared fixtures: random caches in several dtypes and piece sizes, and a factory of offloaders."""

from __future__ import annotations

import threading

import pytest
import torch

import kvoffload


def random_caches(num_blocks: int, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Several tensors with different dtypes and bytes per block, filled with random bits."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "k0": ((num_blocks, 4, 16), torch.float32),  # 256 B per block
        "v0": ((num_blocks, 3, 5), torch.int16),  # 30 B per block: odd sizes exercise slot padding
        "k1": ((num_blocks, 2, 8, 8), torch.bfloat16),  # 256 B
        "v1": ((num_blocks, 1000), torch.uint8),  # 1000 B
    }
    out = {}
    for name, (shape, dtype) in shapes.items():
        raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty(0, dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
        out[name] = raw.view(dtype).view(shape).to(device)
    return out


def block_bytes(caches: dict[str, torch.Tensor], block: int) -> bytes:
    """Every byte of one block, across tensors."""
    return b"".join(t[block].contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes() for t in caches.values())


@pytest.fixture
def caches() -> dict[str, torch.Tensor]:
    return random_caches(64)


@pytest.fixture
def make_offloader():
    """Create started offloaders; closes them and checks no worker thread is left."""
    made: list[kvoffload.Offloader] = []
    before = {t.ident for t in threading.enumerate()}

    def make(caches, **kw):
        off = kvoffload.Offloader(caches, **kw).start()
        made.append(off)
        return off

    yield make
    for off in made:
        off.close()
    leftover = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvoffload")]
    assert not leftover, f"threads left running: {leftover}"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality (random bits include NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- reliability figures -------------------------------------------------------------------
# The reliability tests (test_model, test_faults, test_storm, test_shutdown) record how much
# they did (operations, faults injected, transfers cancelled); pytest prints the lines at the end.

RELIABILITY_FIGURES: list[str] = []


def report_figure(line: str) -> None:
    """Record one summary line; it is printed in the terminal summary (and now, under ``-s``)."""
    RELIABILITY_FIGURES.append(line)
    print(line)


def pytest_terminal_summary(terminalreporter) -> None:
    if RELIABILITY_FIGURES:
        terminalreporter.section("kvoffload reliability figures")
        for line in RELIABILITY_FIGURES:
            terminalreporter.write_line(line)


def kvoffload_threads() -> list[str]:
    """Names of live threads the library started."""
    return [t.name for t in threading.enumerate() if t.name.startswith("kvoffload")]



async def check_every_visible_key(off, caches, orig, keys_to_blocks) -> list:
    """Load every visible key into blocks 0..n-1 and compare with the block it was stored from.

    ``orig`` is a copy of the cache taken before the stores; returns the visible keys.
    """
    visible = [k for k in keys_to_blocks if k in off]
    for t in caches.values():
        t.zero_()
    if visible:
        await off.load({k: i for i, k in enumerate(visible)})
    for i, k in enumerate(visible):
        for n in caches:
            assert same_bytes(caches[n][i], orig[n][keys_to_blocks[k]]), (k, n)
    return visible
