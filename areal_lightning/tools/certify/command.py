"""``certify()``: parse the points and modes, run the references and cases, print the table."""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from areal_lightning._fault import POINTS
from areal_lightning.tools.certify.cases import Certifier
from areal_lightning.tools.certify.protocol import CertifyUsageError, ENV_ROOT
from areal_lightning.tools.certify.report import render


def _parse_points(text: str) -> list[tuple[str, int | None]]:
    if text.strip() == "all":
        return [(p, None) for p in POINTS]
    out: list[tuple[str, int | None]] = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        point, _, nth = entry.partition("@")
        if point not in POINTS:
            raise CertifyUsageError(f"--points: unknown fault point {point!r}; known: {', '.join(POINTS)}")
        if nth and (not nth.isdigit() or int(nth) < 1):
            raise CertifyUsageError(f"--points: {entry!r}: @N must be an integer >= 1")
        out.append((point, int(nth) if nth else None))
    if not out:
        raise CertifyUsageError("--points: no point given")
    return out


def _points_per_mode(points: str | Sequence[str], modes: list[str]) -> dict[str, list[tuple[str, int | None]]]:
    """``--points`` values: ``all`` or ``P1,P2[@N]`` for every mode, or ``MODE=...`` for one mode."""
    specs = [points] if isinstance(points, str) else list(points) or ["all"]
    common: list[tuple[str, int | None]] | None = None
    per: dict[str, list[tuple[str, int | None]]] = {}
    for spec in specs:
        mode, sep, rest = spec.partition("=")
        if sep:
            if mode.strip() not in modes:
                raise CertifyUsageError(f"--points {spec!r}: mode {mode.strip()!r} is not one of --modes {modes}")
            per[mode.strip()] = _parse_points(rest)
        else:
            common = _parse_points(spec)
    out = {}
    for mode in modes:
        if mode in per:
            out[mode] = per[mode]
        elif common is not None or not per:
            out[mode] = common if common is not None else _parse_points("all")
        else:
            out[mode] = []  # --points given for other modes only
    return out


def certify(command: Sequence[str], *, points: str | Sequence[str] = "all", modes: str = "sync,async",
            timeout: float = 600,
            jobs: int = 1, nth: int | None = None, workdir: str | None = None, keep: bool = False,
            json_path: str | None = None, strict: bool = False, chain: bool = False,
            echo: Callable[[str], None] | None = None, console: Any = None) -> int:
    """Run the certification (see the module doc); print the table; return the exit code."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CertifyUsageError("no training command given; usage: areal-lightning certify [options] -- <command ...>")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    if not mode_list or any(ch in m for m in mode_list for ch in "{}/ =") or len(set(mode_list)) != len(mode_list):
        raise CertifyUsageError(f"--modes: expected a comma-separated list such as sync,async, got {modes!r}")
    point_lists = _points_per_mode(points, mode_list)
    mode_list = [m for m in mode_list if point_lists[m]]
    if not mode_list:
        raise CertifyUsageError("--points: no point given")
    if timeout <= 0 or jobs < 1 or (nth is not None and nth < 1):
        raise CertifyUsageError("--timeout must be > 0, --jobs >= 1, --nth >= 1")
    echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not any("{root}" in arg for arg in command):
        echo(f"note: the command has no {{root}} placeholder; it must read ${ENV_ROOT} as RecoverCallback's fileroot")
    if workdir is None:
        work = Path(tempfile.mkdtemp(prefix="areal-certify-"))
    else:
        work = Path(workdir)
        if work.exists() and any(work.iterdir()):
            raise CertifyUsageError(f"--workdir {work} is not empty")
        work.mkdir(parents=True, exist_ok=True)
    n_cases = sum(len(point_lists[m]) for m in mode_list)
    echo(f"certify: {n_cases} case(s) ({', '.join(f'{m}: {len(point_lists[m])}' for m in mode_list)}) of: "
         f"{shlex.join(command)}  "
         f"(work folder {work}, {jobs} job(s){', chained' if chain else ''})")
    start = time.monotonic()
    cert = Certifier(command, point_lists, mode_list, timeout=timeout, jobs=jobs, workdir=work, keep=keep, nth=nth,
                     chain=chain, echo=echo)
    cert.run()
    wall = time.monotonic() - start
    render(cert.cases, console)
    counts = {s: sum(1 for c in cert.cases if c.status == s) for s in ("pass", "fail", "error", "not reached")}
    failed = counts["fail"] + counts["error"] + sum(1 for r in cert.references.values() if not r.ok)
    summary = (f"{counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, "
               f"{counts['not reached']} not reached, in {wall:.1f}s")
    echo(summary)
    if json_path:
        doc = {
            "command": command, "modes": mode_list, "wall_s": round(wall, 2), "summary": counts,
            "references": {m: {"ok": r.ok, "error": r.error, "steps": len(r.losses), "trials": r.trials,
                               "points_reached": r.counts, "wall_s": round(r.wall_s, 2)}
                           for m, r in cert.references.items()},
            "chain": chain, "phases": cert.phases, "sequences": cert.sequences,
            "cases": [{**{k: v for k, v in asdict(c).items() if k not in ("explicit_nth", "requeued")},
                       "wall_s": round(c.wall_s, 2)} for c in cert.cases],
        }
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
    if not keep and not failed:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if failed:
        return 1
    if strict and counts["not reached"]:
        return 1
    return 0
