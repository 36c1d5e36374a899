"""Shared by the benchmarks: the environment of a run and writing its JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any


def environment() -> dict[str, Any]:
    """Python, torch, machine and CPU count of this run."""
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "machine": platform.machine(),
            "cpus": os.cpu_count()}


def write_json(path: Path | None, doc: dict[str, Any]) -> None:
    """Write ``doc`` (with the environment) to ``path`` as indented JSON; nothing when ``path`` is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**doc, **environment()}, indent=2) + "\n")
