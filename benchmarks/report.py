"""Figures, their targets, and the rich table that shows them side by side."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.targets import GOCRYPTFS, PLAIN, SEALFS

HIGHER, LOWER = "higher", "lower"


@dataclass
class Figure:
    """One measured quantity for up to three targets, and sealfs's target for it."""

    bench: str
    name: str
    unit: str
    values: dict[str, float | None] = field(default_factory=dict)
    better: str | None = None  # HIGHER or LOWER; None: no direction (a reference figure)
    target: str = ""  # human text, e.g. ">= gocryptfs"
    passed: bool | None = None  # None: no target or not measurable
    note: str = ""

    def judge(self, check: Callable[[dict[str, float | None]], bool | None], text: str) -> Figure:
        self.target = text
        try:
            self.passed = check(self.values)
        except (TypeError, KeyError):
            self.passed = None
        return self


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit in ("files", "bytes"):
        return f"{value:,.0f}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def ratio(fig: Figure, other: str) -> str:
    a, b = fig.values.get(SEALFS), fig.values.get(other)
    if a is None or b is None or b == 0 or fig.unit == "%":
        return "—"
    return f"{a / b:.2f}x"


def table(figures: list[Figure], title: str) -> Table:
    t = Table(title=title, show_lines=False, header_style="bold")
    t.add_column("benchmark")
    t.add_column("figure")
    t.add_column("unit")
    t.add_column("sealfs", justify="right")
    t.add_column("plain", justify="right")
    t.add_column("gocryptfs", justify="right")
    t.add_column("sealfs/plain", justify="right")
    t.add_column("sealfs/gocryptfs", justify="right")
    t.add_column("target (sealfs)")
    t.add_column("result")
    last = None
    for fig in figures:
        if last is not None and fig.bench != last:
            t.add_section()
        last = fig.bench
        arrow = {HIGHER: " ↑", LOWER: " ↓"}.get(fig.better or "", "")
        result = {True: "[green]PASS[/]", False: "[bold red]MISS[/]", None: ""}[fig.passed]
        if fig.passed is None and fig.target:
            result = "n/a"
        name = fig.name + arrow + (f" ({fig.note})" if fig.note else "")
        t.add_row(
            fig.bench, name, fig.unit,
            fmt(fig.values.get(SEALFS), fig.unit),
            fmt(fig.values.get(PLAIN), fig.unit),
            fmt(fig.values.get(GOCRYPTFS), fig.unit),
            ratio(fig, PLAIN), ratio(fig, GOCRYPTFS), fig.target, result,
        )  # fmt: skip
    return t


def console() -> Console:
    return Console(width=190, soft_wrap=False)


def save(figures: list[Figure], facts: dict[str, str], argv: list[str], path: Path) -> None:
    path.write_text(
        json.dumps(
            {"argv": argv, "facts": facts, "figures": [asdict(f) for f in figures]}, indent=2
        )
    )
