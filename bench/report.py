"""The human tables (Report: on stdout, or on stderr when stdout carries the JSON) and the numbers in them:
medians, percentages, and NaN and infinities made JSON's null."""
from __future__ import annotations

import statistics

import numpy as np


def median(values):
    return statistics.median(values) if values else float("nan")


def percent(value, signed=False) -> str:
    if value is None or not np.isfinite(value):
        return "-"
    return f"{value:+.1%}" if signed else f"{value:.1%}"


def finite(obj):
    """NaN and infinities become null: the JSON output stays standard JSON."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


class Report:
    """Collects the human tables; they go to stdout, or to stderr when stdout carries the JSON."""

    def __init__(self, stream):
        self.stream = stream

    def line(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    @staticmethod
    def cell(value) -> str:
        if isinstance(value, float):
            if not np.isfinite(value):
                return "-"
            return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
        return str(value)

    def table(self, title: str, header: list[str], rows: list[list]) -> None:
        cells = [header] + [[self.cell(c) for c in row] for row in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        self.line(f"\n{title}")
        for n, row in enumerate(cells):
            self.line("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
            if n == 0:
                self.line("  " + "  ".join("-" * w for w in widths))
