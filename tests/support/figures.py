"""How much the reliability tests did (operations, faults injected, transfers cancelled):
test_model, test_faults, test_stress and test_shutdown record one line each, which conftest's
``pytest_terminal_summary`` prints at the end."""

from __future__ import annotations


RELIABILITY_FIGURES: list[str] = []


def report_figure(line: str) -> None:
    """Record one summary line; it is printed in the terminal summary (and now, under ``-s``)."""
    RELIABILITY_FIGURES.append(line)
    print(line)
