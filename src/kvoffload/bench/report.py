"""The bench's report: rows printed as they come (the progress display), the summary tables (rows
against the ceiling and the seed-style baseline; per-transfer costs against bare thread hops), a chart."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["COLUMNS", "Report", "plot"]


class Report:
    """Rows of the summary table, printed as they come (the progress display)."""

    def __init__(self, steps: int) -> None:
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.steps = steps
        self.step = 0
        self.t0 = time.perf_counter()

    def begin(self, what: str) -> None:
        """Start the next step: print its progress line."""
        self.step += 1
        print(f"[{self.step}/{self.steps} {time.perf_counter() - self.t0:6.1f}s] {what} ...", flush=True)

    def skip(self, what: str, reason: str) -> None:
        """Count the next step as done without rows: print ``what`` and why it did not run."""
        self.step += 1
        print(f"[{self.step}/{self.steps} {time.perf_counter() - self.t0:6.1f}s] {what}: skipped ({reason})", flush=True)

    def row(self, scenario: str, unit: str, kvoffload: float, ceiling: float | None = None,
            baseline: float | None = None, note: str = "", floor: float | None = None,
            bare_hop: float | None = None) -> None:
        """Add (and print) a row: kvoffload's figure beside what it is compared with, each in a column
        of its own (:data:`COLUMNS`).

        ``ceiling``: what the row is held to: the hardware, or the same work without what the row
        measures (the note says which: ``ceiling = ...``). ``baseline``: the seed-style baseline's
        figure for the same work, and nothing else. ``floor``: the share of the ceiling this row must
        reach; a row below it is listed at the end. ``bare_hop``: for a per-transfer cost (CPU,
        wake-ups, latency: lower is better), the same figure for bare cross-thread hops, the floor
        under any design that crosses threads; such a row goes to the table of its own
        (:meth:`hop_table`) and has no ceiling or baseline."""
        if bare_hop is not None and (ceiling is not None or baseline is not None or floor is not None):
            raise ValueError(f"row {scenario!r}: a row against a bare hop has no ceiling, baseline or floor")
        r = {"scenario": scenario, "unit": unit, "kvoffload": kvoffload, "ceiling": ceiling, "baseline": baseline,
             "vs_ceiling": kvoffload / ceiling if ceiling else None, "vs_baseline": kvoffload / baseline if baseline else None,
             "note": note, "floor": floor, "bare_hop": bare_hop,
             "over_hop": kvoffload - bare_hop if bare_hop is not None else None}
        self.rows.append(r)
        print("    " + (_fmt_hop_row(r, _HOP_WIDTH) if bare_hop is not None else _fmt_row(r, _WIDTH)), flush=True)

    def below_floor(self) -> list[str]:
        """The rows whose share of the ceiling is below their floor, as lines to print."""
        return [f"{r['scenario']}: {r['vs_ceiling']:.2f} of the ceiling, floor {r['floor']:.2f}"
                for r in self.rows if r["floor"] is not None and r["vs_ceiling"] is not None and r["vs_ceiling"] < r["floor"]]

    def table(self) -> str:
        """The summary table of every row so far but the per-transfer costs (:meth:`hop_table`)."""
        rows = [r for r in self.rows if r.get("bare_hop") is None]
        width = max([_WIDTH, *(len(r["scenario"]) for r in rows)])
        head = (f"{'scenario':{width}s} {'unit':>10s} {'kvoffload':>10s} {'ceiling':>10s} {'baseline':>10s} "
                f"{'/ceil':>7s} {'/base':>7s}")
        return "\n".join([head, "-" * len(head)] + [_fmt_row(r, width) for r in rows])

    def hop_table(self) -> str:
        """The per-transfer costs beside bare cross-thread hops (empty when there are none)."""
        rows = [r for r in self.rows if r.get("bare_hop") is not None]
        if not rows:
            return ""
        width = max([_WIDTH, *(len(r["scenario"]) for r in rows)])
        head = f"{'per-transfer cost':{width}s} {'unit':>10s} {'kvoffload':>10s} {'bare hop':>10s} {'above':>10s}"
        return "\n".join([head, "-" * len(head)] + [_fmt_hop_row(r, width) for r in rows])

    def summary(self) -> str:
        """Both tables and what each of their columns means."""
        parts = [self.table(), *COLUMNS["table"]]
        hops = self.hop_table()
        if hops:
            parts += ["", hops, *COLUMNS["hop_table"]]
        return "\n".join(parts)


COLUMNS = {
    "table": [
        "kvoffload: kvoffload's figure, in the row's unit.",
        "ceiling: what the row is held to: the hardware (one large pinned copy, raw O_DIRECT IO, redis-py's own GET/SET),",
        "  or the same work without what the row measures (its note says which: 'ceiling = ...').",
        "baseline: the seed-style baseline (kvoffload.bench.seed_baseline) doing the same work. /ceil, /base: kvoffload divided by them.",
    ],
    "hop_table": [
        "bare hop: the same figure for bare cross-thread hops into an event loop, as many in flight, nothing else done",
        "  (its note says one way or there and back): the floor under any design that crosses threads.",
        "above: kvoffload minus the bare hop, in the row's unit (lower is better).",
    ],
}
"""What each column of :meth:`Report.table` and :meth:`Report.hop_table` means, as printed under them."""

_WIDTH = 38
"""The scenario column's width in progress lines (tables widen it to their longest name)."""
_HOP_WIDTH = 52
"""The same for the rows against a bare hop (the names of per-transfer costs are longer)."""


def _num(x: float | None, fmt: str = "10.2f") -> str:
    return format(x, fmt) if x is not None else " " * (int(fmt.split(".")[0]) - 1) + "-"


def _fmt_row(r: dict[str, Any], width: int) -> str:
    low = r.get("floor") is not None and r["vs_ceiling"] is not None and r["vs_ceiling"] < r["floor"]
    return (f"{r['scenario']:{width}s} {r['unit']:>10s} {_num(r['kvoffload'])} {_num(r['ceiling'])} {_num(r['baseline'])} "
            f"{_num(r['vs_ceiling'], '7.2f')} {_num(r['vs_baseline'], '7.2f')}" + ("  BELOW FLOOR" if low else ""))


def _fmt_hop_row(r: dict[str, Any], width: int) -> str:
    return f"{r['scenario']:{width}s} {r['unit']:>10s} {_num(r['kvoffload'])} {_num(r['bare_hop'])} {_num(r['over_hop'], '+10.2f')}"


def plot(report: Report, path: str) -> None:
    """Bar chart of GB/s per scenario and system, and the latency distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gb = [r for r in report.rows if r["unit"] == "GB/s"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 6), gridspec_kw={"width_ratios": [3, 1]})
    ax = axes[0]
    width = 0.27
    xs = range(len(gb))
    for k, (col, label) in enumerate((("ceiling", "ceiling"), ("baseline", "seed baseline"), ("kvoffload", "kvoffload"))):
        ax.bar([x + (k - 1) * width for x in xs], [r[col] or 0 for r in gb], width, label=label)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["scenario"] for r in gb], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("GB/s")
    ax.legend()
    ax.set_title("throughput by scenario")
    ax = axes[1]
    lat = {k: v for k, v in report.extra.items() if isinstance(v, dict) and "p50_us" in v}
    ax.bar(range(len(lat)), [v["p50_us"] for v in lat.values()], label="p50")
    ax.scatter(range(len(lat)), [v["p99_us"] for v in lat.values()], color="k", marker="_", s=200, label="p99")
    ax.set_xticks(range(len(lat)))
    ax.set_xticklabels(list(lat), rotation=30, ha="right", fontsize=8)
    if lat:  # a run that skipped the latency scenarios has nothing to scale
        ax.set_yscale("log")
    ax.set_ylabel("microseconds")
    ax.legend()
    ax.set_title("latency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

