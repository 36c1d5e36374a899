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


def _below_ephemeral() -> range:
    """Ports under the kernel's ephemeral range (``ip_local_port_range``: what a bind to port 0
    and an outgoing connection take), 12,000 of them at most, from 10,000."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(10_000, low - 12_000), low)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, drawn at random below the kernel's
    ephemeral range: between this call and the server's bind no other process is given it by
    the kernel (gloo's listeners and every outgoing connection take ports from that range; a
    port from it was once taken by one of them, and the test's server exited with EADDRINUSE
    while its client reached the other process)."""
    import random

    ports = _below_ephemeral()
    for _ in range(100):
        port = random.choice(ports) if len(ports) else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # that range is full: the kernel's choice
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
