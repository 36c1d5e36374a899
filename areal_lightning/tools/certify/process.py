"""Running the training command as a process group: a timeout, a kill of the whole group, the
fault-point trace it left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence



@dataclass
class RunResult:
    """How one run of the command ended."""

    rc: int | None
    killed: bool = False  # the injected kill fired (a kill line in the trace)
    killed_by: str = ""  # "point pid hit"
    timed_out: bool = False
    wall_s: float = 0.0
    log: str = ""  # stdout + stderr file

    def output(self) -> str:
        try:
            return Path(self.log).read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 1500) -> str:
        return self.output()[-n:]


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run (zombies, whose code ended, excluded),
    read from ``/proc``; ``[]`` where it cannot be read."""
    live = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) == pgid:
            live.append(int(entry.name))
    return live


def _wait_group_ended(pgid: int, timeout: float = 30.0) -> None:
    """Until every process of the SIGKILLed group ``pgid`` has ended: a member in a system call
    (a rename, a write to tmpfs) ends when it returns, which may be after the leader was reaped;
    what the run left on disk is read only once none can write any more."""
    deadline = time.monotonic() + timeout
    while _live_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.005)


def run_group(argv: Sequence[str], env: dict[str, str], log: Path, timeout: float,
              trace: Path | None = None, poll_s: float = 0.05) -> RunResult:
    """Run ``argv`` as a new session (its own process group) with output to ``log``.

    The whole group is SIGKILLed when a ``kill`` line appears in ``trace`` (one process hit
    the injected kill: the others, e.g. the other DDP ranks, die with it, as on a lost
    node), on timeout, and when the leader exits (stray children such as a surviving rank
    or dataloader workers). The leader is reaped only after the group is killed, so its
    process-group id cannot be reused meanwhile.
    """
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    result = RunResult(rc=None, log=str(log))
    offset, pending = 0, b""
    try:
        while True:
            if trace is not None and not result.killed and trace.exists():
                with open(trace, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    parts = line.decode(errors="replace").split("\t")
                    if len(parts) == 4 and parts[3] == "kill":
                        result.killed, result.killed_by = True, " ".join(parts[:3])
                if result.killed:
                    _killpg(proc.pid)
            exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if exited is not None:
                _killpg(proc.pid)  # stragglers; the leader is a zombie, its pgid still reserved
                break
            if time.monotonic() - start > timeout:
                result.timed_out = True
                _killpg(proc.pid)
                break
            time.sleep(poll_s)
    finally:
        if proc.poll() is None:
            _killpg(proc.pid)
        _wait_group_ended(proc.pid)  # (its members found by their group id in /proc)
        result.rc = proc.wait()
        result.wall_s = time.monotonic() - start
    if trace is not None and not result.killed and trace.exists():  # a kill line written just before the exit
        for line in trace.read_text(errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) == 4 and parts[3] == "kill":
                result.killed, result.killed_by = True, " ".join(parts[:3])
    return result


def _trace_counts(trace: Path) -> dict[str, int]:
    """Hits of each point in a trace: the largest count of any one process."""
    per: dict[tuple[str, str], int] = {}
    if trace.exists():
        for line in trace.read_text(errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) == 4 and parts[2].isdigit():
                key = (parts[0], parts[1])
                per[key] = max(per.get(key, 0), int(parts[2]))
    counts: dict[str, int] = {}
    for (point, _pid), hits in per.items():
        counts[point] = max(counts.get(point, 0), hits)
    return counts
