"""Starting the test scripts' processes: a free port on 127.0.0.1, and a multi-rank job started
by hand (torchrun-style environment variables, one process per rank) with every rank's output
collected."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed after the timeout
    log: Path  # the rank's stdout and stderr


def launch_ranks(script: Path, args: list[str], world: int, logs: Path, *, cwd: Path, timeout: float,
                 env: dict[str, str] | None = None, unset: tuple[str, ...] = ()) -> list[RankResult]:
    """Start ``python script *args`` once per rank with ``LOCAL_RANK``/``NODE_RANK``/``WORLD_SIZE``/
    ``MASTER_ADDR``/``MASTER_PORT`` set (Lightning then launches nothing itself); wait for all of
    them (a rank still running after ``timeout`` seconds is killed); each rank's output is in
    ``logs/rank{r}.log``. ``unset``: variables of this process's environment the ranks do not get."""
    port = str(free_port())
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        rank_env = {**os.environ, **(env or {}), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
                    "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        for name in unset:
            rank_env.pop(name, None)
        with open(logs / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(script), *args], cwd=cwd, env=rank_env,
                                          stdout=log, stderr=subprocess.STDOUT))
    results = []
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    for rank, proc in enumerate(procs):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            results.append(RankResult(rank, None, logs / f"rank{rank}.log"))
        else:
            results.append(RankResult(rank, proc.returncode, logs / f"rank{rank}.log"))
    return results
