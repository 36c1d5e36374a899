"""``areal-lightning run``: re-run a failed training command, each rerun resuming.

The command runs as a child process. When it exits non-zero or is killed by a signal, it is
started again (the same command line, so ``RecoverCallback`` resumes it), up to ``retries``
more times. Ctrl-C (SIGINT) or SIGTERM to the supervisor is forwarded to the child and stops
retrying. The exit code is the last attempt's (``128 + signal`` for a killed child).
Each child sees ``AREAL_LIGHTNING_ATTEMPT`` (1-based) in its environment.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from typing import Callable, Sequence

from areal_lightning.errors import ConfigError

__all__ = ["run_with_retries", "ATTEMPT_ENV"]

ATTEMPT_ENV = "AREAL_LIGHTNING_ATTEMPT"


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def run_with_retries(
    command: Sequence[str],
    retries: int,
    echo: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
) -> int:
    """Run ``command``; re-run it up to ``retries`` times while it fails. Returns the exit code.

    Example:
        >>> run_with_retries([sys.executable, "-c", "pass"], retries=2, echo=lambda m: None)
        0
    """
    if not command:
        raise ConfigError("command", "run: no command given; usage: areal-lightning run [--retries N] -- <command ...>")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError("retries", f"expected an integer >= 0, got {retries!r}")
    total = retries + 1
    rc = 0
    stop: dict[str, int | None] = {"signal": None}
    running: dict[str, subprocess.Popen | None] = {"proc": None}

    def forward(signum: int, _frame: object) -> None:
        stop["signal"] = signum
        proc = running["proc"]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signum)

    # Installed before the first child starts: a signal at any moment (even while a child is
    # being started) stops the retries and reaches the child, never leaving it orphaned.
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for attempt in range(1, total + 1):
            if stop["signal"] is not None:
                break
            echo(f"[areal-lightning run] attempt {attempt}/{total}: {shlex.join(command)}")
            env = {**os.environ, ATTEMPT_ENV: str(attempt)}
            proc = running["proc"] = subprocess.Popen(list(command), env=env)
            if stop["signal"] is not None and proc.poll() is None:  # arrived while it was being started
                proc.send_signal(stop["signal"])
            rc = proc.wait()
            if stop["signal"] is not None:
                break
            if rc == 0:
                echo(f"[areal-lightning run] attempt {attempt}/{total} succeeded")
                return 0
            left = total - attempt
            echo(f"[areal-lightning run] attempt {attempt}/{total} failed ({_describe(rc)})"
                 + (f"; retrying, {left} {'retry' if left == 1 else 'retries'} left" if left else "; no retries left"))
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    if stop["signal"] is not None:
        echo(f"[areal-lightning run] stopped by {signal.Signals(stop['signal']).name}; not retrying")
        return _exit_code(rc) if rc else 128 + stop["signal"]
    return _exit_code(rc)
