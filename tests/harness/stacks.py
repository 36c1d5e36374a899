"""What the processes of a hung job are doing: the native stacks of a process and its descendants
(gdb, where installed), for a test's failure message.

One cause is named when seen: a child stuck in ``PyOS_AfterFork_Child`` is a DataLoader worker
forked while another thread of its parent held the interpreter's thread-state lock. torch's gloo
threads take that lock whenever they drop the last reference to a tensor that has a Python object
(after a collective), so a worker forked right after collectives can inherit it locked. CPython
fixed this in 3.11.10 and 3.12 (python/cpython#112275); 3.11.7 has it. Reproduced here once in a
2-rank run with workers (rank 1's first worker deadlocked; gdb showed
``PyOS_AfterFork_Child -> _PyEval_ReInitThreads -> _PyThreadState_DeleteExcept``, and a trace of a
rank showed gloo threads deleting thread states right up to the DataLoader's fork).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

FORK_DEADLOCK = ("PyOS_AfterFork_Child: a process forked while another thread of its parent held the "
                 "interpreter's thread-state lock (CPython bug python/cpython#112275, fixed in 3.11.10 and "
                 "3.12; torch's gloo threads take that lock to release tensors after collectives)")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children.get(current, [])
    return out


def native_stacks(pid: int, frames: int = 14) -> str:
    """The native stacks of ``pid`` and its descendants, the known causes named first; a line
    saying why not where gdb is missing."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb: stacks not collected)"
    report, causes = [], []
    for proc in descendants(pid):
        try:
            command = Path(f"/proc/{proc}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:100]
            ran = subprocess.run([gdb, "-p", str(proc), "-batch", "-ex", f"thread apply all bt {frames}"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            report.append(f"pid {proc}: {exc}")
            continue
        names = [line.split(" in ", 1)[-1].split(" (", 1)[0] for line in ran.stdout.splitlines() if line.startswith("#")]
        if not names:  # e.g. "ptrace: Operation not permitted."
            report.append(f"pid {proc} ({command}): gdb: {(ran.stderr.strip().splitlines() or ['no stack'])[-1]}")
            continue
        if "PyOS_AfterFork_Child" in names:
            causes.append(f"pid {proc} ({command}): {FORK_DEADLOCK}")
        report.append(f"pid {proc} ({command}): {' <- '.join(names[:frames])}")
    return "\n".join(causes + report)

