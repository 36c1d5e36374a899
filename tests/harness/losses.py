"""The loss log of the test scripts: one JSON line per optimizer step, ``{"step", "loss"}``
(``loss`` as ``float.hex()``, bitwise comparable; other keys such as ``"pid"`` or ``"rank"`` may
follow), appended with one write per line, so a SIGKILL never leaves half a line. It is the
format of :mod:`areal_lightning.tools.losses` (``certify`` and the demo write it too), and
these readers are built on its ``read_losses``."""

from __future__ import annotations

import json
from pathlib import Path

from areal_lightning.tools.losses import read_losses


def step_losses(path: str | Path) -> dict[int, set[str]]:
    """Every loss recorded for each step of one rank's file: a step trained again after a resume
    adds its loss to the step's set (an exact resume leaves one value per step)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no loss log at {path}")
    return {step: {json.loads(value) for value in values} for (_, step), values in read_losses(path).items()}


def last_losses(path: str | Path) -> dict[int, str]:
    """The last loss written for each step (a resumed run writes the steps after the checkpoint again)."""
    rows = (json.loads(line) for line in Path(path).read_text().splitlines() if line.strip())
    return {row["step"]: row["loss"] for row in rows}


def rank_losses(root: str | Path, ranks: int, name: str = "losses") -> dict[tuple[int, int], set[str]]:
    """``{(rank, step): losses}`` of the per-rank files ``{root}/{name}.rank{r}``."""
    return {(r, step): values for r in range(ranks)
            for step, values in step_losses(Path(root) / f"{name}.rank{r}").items()}
