"""The bench's report: rows printed as they come (the progress display), the summary table, a chart."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["Report", "plot"]


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
            baseline: float | None = None, note: str = "", floor: float | None = None) -> None:
        """Add (and print) a row: kvoffload's figure beside the ceiling and the seed-style baseline.
        ``floor``: the share of the ceiling this row must reach; a row below it is listed at the end."""
        r = {"scenario": scenario, "unit": unit, "kvoffload": kvoffload, "ceiling": ceiling, "baseline": baseline,
             "vs_ceiling": kvoffload / ceiling if ceiling else None, "vs_baseline": kvoffload / baseline if baseline else None,
             "note": note, "floor": floor}
        self.rows.append(r)
        print("    " + _fmt_row(r), flush=True)

    def below_floor(self) -> list[str]:
        """The rows whose share of the ceiling is below their floor, as lines to print."""
        return [f"{r['scenario']}: {r['vs_ceiling']:.2f} of the ceiling, floor {r['floor']:.2f}"
                for r in self.rows if r["floor"] is not None and r["vs_ceiling"] is not None and r["vs_ceiling"] < r["floor"]]

    def table(self) -> str:
        """The summary table of every row so far."""
        head = f"{'scenario':38s} {'unit':>10s} {'kvoffload':>10s} {'ceiling':>10s} {'baseline':>10s} {'/ceil':>7s} {'/base':>7s}"
        return "\n".join([head, "-" * len(head)] + [_fmt_row(r) for r in self.rows])


def _fmt_row(r: dict[str, Any]) -> str:
    def num(x: float | None, fmt: str = "10.2f") -> str:
        return format(x, fmt) if x is not None else " " * (int(fmt.split(".")[0]) - 1) + "-"

    low = r.get("floor") is not None and r["vs_ceiling"] is not None and r["vs_ceiling"] < r["floor"]
    return (f"{r['scenario']:38s} {r['unit']:>10s} {num(r['kvoffload'])} {num(r['ceiling'])} {num(r['baseline'])} "
            f"{num(r['vs_ceiling'], '7.2f')} {num(r['vs_baseline'], '7.2f')}" + ("  BELOW FLOOR" if low else ""))


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

