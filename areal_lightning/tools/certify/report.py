"""The table ``certify`` prints (rich)."""

from __future__ import annotations

import os
from typing import Any

from areal_lightning.tools.certify.cases import Case


def _resumed_text(case: Case) -> str:
    if case.status in ("not reached", "error") or not case.killed:
        return "–"
    got = sorted(set(case.resumed_from))
    have = "fresh" if not got else ",".join(str(s) for s in got)
    if len(case.resumed_from) > 1:
        have += f" ×{len(case.resumed_from)}"
    want = "fresh" if case.expected_resume is None else str(case.expected_resume)
    return have if (got == [case.expected_resume] or (not got and case.expected_resume is None)) \
        else f"{have} (want {want})"


def render(cases: list[Case], console: Any = None) -> None:
    """Print the certification table (rich)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(width=None if os.isatty(1) else 200, highlight=False)
    table = Table(title="areal-lightning certify: SIGKILL at each fault point, then the same command again")
    chained = any(c.link > 1 for c in cases)
    for col in ("point", "mode", "kill at", *(("run",) if chained else ()), "killed?", "resumed after step",
                "exact?", "leftovers", "exports", "verdict"):
        table.add_column(col, overflow="fold")
    style = {"pass": "green", "fail": "bold red", "error": "bold red", "not reached": "yellow"}
    for c in cases:
        table.add_row(
            c.point, c.mode,
            f"{c.nth}/{c.hits}" if c.nth else "–",
            *(("alone" if c.sequence.endswith("-alone") else f"{c.sequence} #{c.link}" if c.link else "–",)
              if chained else ()),
            "yes" if c.killed else "no",
            _resumed_text(c),
            c.exact or "–",
            ("none" if not c.leftovers else f"{len(c.leftovers)}: {c.leftovers[0]}") if c.killed else "–",
            c.exports or "–",
            f"[{style.get(c.status, '')}]{c.status.upper()}[/]",
        )
    console.print(table)
    for c in cases:
        if c.status in ("fail", "error"):
            console.print(Text.assemble((f"{c.point} ({c.mode})", "bold red"), ": " + "\n  ".join(c.reasons)
                                        + (f"\n  kept: {c.dir}" if c.dir else "")))
