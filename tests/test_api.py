"""The public API on CPU caches: the public surface and options, lifecycle basics, store/load/lookup/discard
semantics, LRU eviction and capacity. (Malformed calls, caches and options: test_bad_input.py.)"""

from __future__ import annotations

import ast
import dataclasses
import gc
import inspect
import pathlib
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import kvoffload
from support.caches import block_bytes, random_caches


def test_public_names_importable():
    for name in ["Offloader", "Transfer", "TransferResult", "OffloadError", "TransferError", "CapacityError",
                 "MissingKeysError", "ClosedError", "OffloaderStats", "BlockLayout", "Lease"]:
        assert hasattr(kvoffload, name)
    assert issubclass(kvoffload.MissingKeysError, KeyError)
    for e in (kvoffload.TransferError, kvoffload.CapacityError, kvoffload.MissingKeysError, kvoffload.ClosedError):
        assert issubclass(e, kvoffload.OffloadError)


def test_public_surface_is_exactly_all():
    public = {name for name, value in vars(kvoffload).items() if not name.startswith("_") and not inspect.ismodule(value)}
    assert public == set(kvoffload.__all__), f"not in __all__: {public - set(kvoffload.__all__)}; missing: {set(kvoffload.__all__) - public}"
    for name in kvoffload.__all__:
        obj = getattr(kvoffload, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ == "kvoffload", f"kvoffload.{name}.__module__ is {obj.__module__!r}"


def test_options_after_kv_caches_are_keyword_only(caches):
    with pytest.raises(TypeError):
        kvoffload.Offloader(caches, 16)
    with pytest.raises(TypeError):
        kvoffload.Offloader(caches, 16, "kv", 8)


def test_options_are_frozen_and_hold_the_given_values(caches, tmp_path):
    path = str(tmp_path / "kv")
    off = kvoffload.Offloader(caches, host_blocks=16, disk_path=path, disk_blocks=8, chunk_bytes=3 * 4096,
                              use_batch_copy=False, io_threads=2, use_page_cache=True, copy_engine="dma")
    opts = off.options
    assert isinstance(opts, kvoffload.Options)
    assert (opts.host_blocks, opts.disk_path, opts.disk_blocks, opts.chunk_bytes) == (16, path, 8, 3 * 4096)
    assert (opts.use_batch_copy, opts.io_threads, opts.use_page_cache, opts.copy_engine) == (False, 2, True, "dma")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.host_blocks = 32
    assert off.options.host_blocks == 16
    defaults = kvoffload.Offloader(caches).options
    assert defaults == kvoffload.Options() and defaults.disk_path is None


def test_offloader_takes_every_option_with_its_options_default():
    """``Offloader(kv_caches, **options)`` takes every ``Options`` field as a keyword, and leaving one
    out means the default ``Options`` documents: the two never drift apart."""
    params = inspect.signature(kvoffload.Offloader).parameters
    keywords = {name: p.default for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "num_blocks"}
    fields = {f.name: f.default for f in dataclasses.fields(kvoffload.Options)}
    assert keywords == fields


def test_layout_geometry(caches):
    layout = kvoffload.BlockLayout.of(caches)
    assert layout.num_blocks == 64
    assert layout.block_bytes == 256 + 30 + 256 + 1000
    assert layout.slot_bytes == 4096 and layout.slot_bytes % 4096 == 0
    assert [p.offset for p in layout.pieces] == [0, 256, 286, 542]


def test_numpy_integer_ids_accepted(make_offloader, caches):
    off = make_offloader(caches, host_blocks=16)
    off.store({"a": np.int64(3)}).result(10)
    assert "a" in off


def test_use_before_start_and_after_close(caches):
    off = kvoffload.Offloader(caches, host_blocks=8)
    with pytest.raises(kvoffload.ClosedError, match="not started"):
        off.store({"a": 1})
    with off:
        off.store({"a": 1}).result(10)
    assert off.closed
    for call in (lambda: off.store({"b": 1}), lambda: off.load({"a": 1}), lambda: off.lookup(["a"]), off.start):
        with pytest.raises(kvoffload.ClosedError):
            call()
    off.close()  # idempotent


def test_store_skips_present_keys_and_reports_them(make_offloader, caches):
    off = make_offloader(caches, host_blocks=16)
    r1 = off.store({"a": 1, "b": 2}).result(10)
    r2 = off.store({"a": 3, "c": 4}).result(10)
    assert r1.keys == ("a", "b") and r1.skipped == ()
    assert r2.keys == ("c",) and r2.skipped == ("a",)
    assert r2.nbytes == kvoffload.BlockLayout.of(caches).block_bytes
    # the skipped key kept its original bytes (block 1, not 3)
    off.load({"a": 10}).result(10)
    assert block_bytes(caches, 10) == block_bytes(caches, 1)


def test_lookup_counts_leading_stored_keys(make_offloader, caches):
    off = make_offloader(caches, host_blocks=16)
    off.store({b"h0": 0, b"h1": 1, b"h3": 3}).result(10)
    assert off.lookup([b"h0", b"h1", b"h2", b"h3"]) == 2
    assert off.lookup([b"h2", b"h0"]) == 0
    assert off.lookup([]) == 0
    assert b"h3" in off and b"h2" not in off


def test_discard(make_offloader, caches):
    off = make_offloader(caches, host_blocks=4)
    off.store({i: i for i in range(4)}).result(10)
    assert off.discard([0, 1, 99]) == 2
    assert 0 not in off and 2 in off
    assert off.stats().host_free == 2
    with pytest.raises(kvoffload.MissingKeysError):
        off.load({0: 5})


def test_lru_eviction_keeps_recently_used(make_offloader, caches):
    off = make_offloader(caches, host_blocks=4)
    off.store({i: i for i in range(4)}).result(10)
    off.load({0: 20}).result(10)  # 0 becomes most recently used
    off.store({4: 4, 5: 5}).result(10)  # evicts the two least recently used: 1 and 2
    assert [k in off for k in range(6)] == [True, False, False, True, True, True]
    assert off.stats().evicted == 2
    assert off.keys() == [3, 0, 4, 5]  # least recently used first


def test_keys_lists_disk_entries_before_host_entries_and_nothing_in_flight(make_offloader, caches, faults, tmp_path):
    off = make_offloader(caches, host_blocks=2, disk_path=tmp_path / "kv", disk_blocks=8)
    off.store({"a": 0, "b": 1}).result(10)
    off.store({"c": 2, "d": 3}).result(10)  # a and b spill to disk
    gate = faults.gate(off, "to_host")
    t = off.store({"e": 4})
    gate.wait_entered(10)
    assert off.keys() == ["a", "b", "c", "d"]  # e is being stored: not loadable yet
    gate.open()
    t.result(10)
    assert off.keys()[-1] == "e" and sorted(off.keys()) == ["a", "b", "c", "d", "e"]
    off.discard(["c"])
    assert "c" not in off.keys()


def test_capacity_error_when_everything_is_in_use(make_offloader):
    caches = random_caches(64)
    off = make_offloader(caches, host_blocks=4)
    with pytest.raises(kvoffload.CapacityError):
        off.store({i: i for i in range(5)})
    assert off.stats().host_free == 4  # nothing reserved
    off.store({i: i for i in range(4)}).result(10)
    assert off.lookup(range(4)) == 4


def test_empty_mappings_finish_at_once(make_offloader, caches):
    off = make_offloader(caches, host_blocks=4)
    assert off.store({}).result(0).keys == ()
    assert off.load({}).result(0).keys == ()


def test_unclosed_offloader_is_cleaned_up_by_gc(caches):
    before = {t.ident for t in threading.enumerate()}
    off = kvoffload.Offloader(caches, host_blocks=8).start()
    off.store({"a": 1}).result(10)
    del off
    gc.collect()
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvoffload")]
    assert not left


def test_kvoffload_works_without_the_optional_redis_py():
    """redis-py is an extra (``kvoffload[redis]``): without it everything but ``remote=`` works,
    and ``remote=`` says what to install."""
    code = textwrap.dedent("""
        import sys
        sys.modules["redis"] = None  # as if redis-py were not installed: importing it raises ImportError
        import torch, kvoffload
        caches = {"k": torch.arange(64, dtype=torch.uint8).view(8, 8)}
        with kvoffload.Offloader(caches, host_blocks=4) as off:
            off.store({b"a": 1}).result(10)
            off.load({b"a": 2}).result(10)
        assert torch.equal(caches["k"][1], caches["k"][2])
        try:
            kvoffload.Offloader(caches, remote="redis://127.0.0.1:1/0")
        except ImportError as e:
            assert "kvoffload[redis]" in str(e), e
        else:
            raise AssertionError("remote= without redis-py was accepted")
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_stats_after_close_keep_every_counter_and_report_no_slot_in_use(make_offloader, caches, tmp_path):
    """``close()`` ends slot use (free, ready, pending, pinned, ... read 0) and keeps every counter as it was."""
    off = make_offloader(caches, host_blocks=2, disk_path=str(tmp_path / "kv"), disk_blocks=4)
    for key in range(8):  # the last two in host memory, four spilled to disk, two evicted
        off.store({key: key}).result(10)
    off.load({2: 40}).result(10)  # from disk
    live = off.stats()
    assert (live.ready, live.evicted, live.keys_loaded_from_disk) == (6, 2, 1)
    assert live.spilled and live.disk_bytes_written and live.disk_bytes_read
    off.close()
    closed = off.stats()
    in_use = {"host_free", "disk_free", "ready", "host_ready", "disk_ready", "pending", "host_pending", "disk_pending",
              "pinned", "spilling", "disk_clean", "in_flight", "gpu_staging_bytes"}
    for f in dataclasses.fields(closed):
        if f.name != "latency":
            assert getattr(closed, f.name) == (0 if f.name in in_use else getattr(live, f.name)), f.name


SRC = pathlib.Path(kvoffload.__file__).parent
CORE = SRC / "_core"


def _imported_modules(path: pathlib.Path) -> set[str]:
    """The absolute names of the modules a file imports, lazy imports included."""
    package = "kvoffload." + ".".join(path.relative_to(SRC).parent.parts) if path.parent != SRC else "kvoffload"
    package = package.rstrip(".")
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_only_the_package_and_testing_import_the_private_core():
    allowed = {SRC / "__init__.py", SRC / "_testing.py"}
    offenders = [
        str(path.relative_to(SRC)) for path in sorted(SRC.rglob("*.py"))
        if CORE not in path.parents and path not in allowed
        and any(name == "kvoffload._core" or name.startswith("kvoffload._core.") for name in _imported_modules(path))
    ]
    assert offenders == [], f"import kvoffload._core outside it (take public names from kvoffload): {offenders}"


def test_core_imports_go_one_way_between_its_layers():
    layers = ["", "tiers", "workers", "cuda", "base"]  # the facade (_core/ top) first, the primitives last

    def layer(module: str) -> int:
        parts = module.split(".")[2:]  # below kvoffload._core
        return layers.index(parts[0]) if parts and parts[0] in layers else 0

    upward = []
    for path in sorted(CORE.rglob("*.py")):
        module = "kvoffload." + ".".join(path.relative_to(SRC).with_suffix("").parts)
        for name in _imported_modules(path):
            if name.startswith("kvoffload._core.") and layer(name) < layer(module):
                upward.append(f"{module} -> {name}")
    assert upward == [], upward


def test_the_map_in_design_md_is_the_tree_of_core():
    design = (SRC.parents[1] / "docs" / "design.md").read_text()
    shape = design[design.index("## Shape"):design.index("\n## ", design.index("## Shape") + 1)]
    block = shape[shape.index("```\n_core/") + 4:]
    block = block[:block.index("```")]
    mapped: set[str] = set()
    folders: list[str] = []
    for line in block.splitlines():
        if not line.strip() or line.startswith(" " * 20):
            continue  # a description's second line
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        folders[depth:] = []
        if name.endswith("/"):
            folders.append(name)
            mapped.add("".join(folders))
        else:
            assert name.endswith((".py", ".c")), line  # .c: a compiled module's source
            mapped.add("".join(folders) + name)
    modules = list(CORE.rglob("*.py"))  # folders without one (__pycache__ left by a move) are no package
    tree = {str(path.parent.relative_to(SRC)) + "/" for path in modules if path.name == "__init__.py"}
    tree |= {str(path.relative_to(SRC)) for path in modules + list(CORE.rglob("*.c")) if path.name != "__init__.py"}
    assert mapped == tree, f"in the map only: {sorted(mapped - tree)}; in the tree only: {sorted(tree - mapped)}"
