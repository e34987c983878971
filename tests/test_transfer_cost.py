"""The per-transfer cost scenarios report every kind and mode with sane values, and their GIL proxy
counts a thread's known wakes."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from kvoffload.bench.transfer_cost import calibrate_gil_proxy, transfer_cost_scenarios

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread counters come from Linux's /proc")


class StandInReport:
    def __init__(self) -> None:
        self.extra: dict[str, Any] = {}
        self.rows: list[dict[str, Any]] = []
        self.begun: list[str] = []

    def begin(self, what: str) -> None:
        self.begun.append(what)

    def row(self, scenario: str, unit: str, kvoffload: float, ceiling: float | None = None,
            baseline: float | None = None, note: str = "", bare_hop: float | None = None) -> None:
        self.rows.append({"scenario": scenario, "unit": unit, "kvoffload": kvoffload, "bare_hop": bare_hop})


def test_every_kind_and_mode_reports_positive_costs() -> None:
    rep = StandInReport()
    transfer_cost_scenarios(rep, torch.device("cpu"), scale=0.01, repeats=1, bulk_bytes=1 << 20)
    assert len(rep.begun) == 1
    kinds = rep.extra["transfer_cost"]["kinds"]
    assert list(kinds) == ["one-block store", "8-block load", "bulk store 1 MiB", "bulk load 1 MiB"]
    units = {"caller CPU": "us/xfer", "kvoffload CPU": "us/xfer", "GIL takes": "GIL/xfer", "wake-ups": "wakes/xfer"}
    by_name = {r["scenario"]: r for r in rep.rows}
    for kind, modes in kinds.items():
        assert len(modes) == 2  # awaited one by one, and many in flight
        for mode in modes:
            for what, unit in units.items():
                r = by_name[f"{kind}, {mode}: {what}"]
                assert r["unit"] == unit
                assert math.isfinite(r["kvoffload"]) and r["kvoffload"] > 0, r
                assert r["bare_hop"] is not None and math.isfinite(r["bare_hop"])
    # one at a time, every transfer wakes its worker at least once
    assert by_name["one-block store, awaited one by one: wake-ups"]["kvoffload"] >= 0.9
    assert by_name["one-block store, awaited one by one: GIL takes"]["kvoffload"] >= 0.9


def test_gil_proxy_counts_known_wakes() -> None:
    proxy = calibrate_gil_proxy(wakes=100)
    # A thread finding the GIL free at each of its wakes: one switch per GIL take.
    assert 0.95 <= proxy["timed_sleep"] <= 1.2, proxy
    # Woken by queue.get() from a Python thread: one take per wake, which may first wait for the GIL.
    assert 0.95 <= proxy["queue_get"] <= 3.5, proxy
