"""``areal-lightning run``: retries around real subprocesses."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "areal_lightning", "run"]

CRASH_TWICE = (
    "import os, sys; a = int(os.environ['AREAL_LIGHTNING_ATTEMPT']);"
    "open(sys.argv[1], 'a').write(f'{a}\\n');"
    "os.kill(os.getpid(), 9) if a == 1 else sys.exit(0 if a >= 3 else 1)"
)


def run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, **kw)


def test_crashes_twice_then_finishes(tmp_path: Path) -> None:
    log = tmp_path / "attempts.txt"
    proc = run(["--retries", "2", "--", sys.executable, "-c", CRASH_TWICE, str(log)])
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().split() == ["1", "2", "3"]
    assert "attempt 1/3 failed (killed by SIGKILL)" in proc.stderr
    assert "attempt 2/3 failed (exit code 1)" in proc.stderr
    assert "attempt 3/3 succeeded" in proc.stderr


def test_always_crashing_gives_up_with_last_exit_code(tmp_path: Path) -> None:
    log = tmp_path / "attempts.txt"
    script = "import sys; open(sys.argv[1], 'a').write('x\\n'); sys.exit(7)"
    proc = run(["--retries", "2", "--", sys.executable, "-c", script, str(log)])
    assert proc.returncode == 7
    assert log.read_text().split() == ["x", "x", "x"]
    assert "attempt 3/3 failed (exit code 7); no retries left" in proc.stderr


def test_retries_default_from_config(tmp_path: Path) -> None:
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("fileroot: /tmp/x\nexperiment_name: e\ntrial_name: t\nrecover:\n  mode: on\n  retries: 1\n"
                   "model:\n  hidden: 8\n")
    log = tmp_path / "attempts.txt"
    script = "import sys; open(sys.argv[1], 'a').write('x\\n'); sys.exit(1)"
    proc = run(["--config", str(cfg), "--", sys.executable, "-c", script, str(log)])
    assert proc.returncode == 1 and log.read_text().split() == ["x", "x"]


def test_ctrl_c_stops_without_retrying(tmp_path: Path) -> None:
    log = tmp_path / "attempts.txt"
    script = "import sys, time; open(sys.argv[1], 'a').write('x\\n'); time.sleep(60)"
    sup = subprocess.Popen([*CLI, "--retries", "3", "--", sys.executable, "-c", script, str(log)],
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.send_signal(signal.SIGINT)
    _, err = sup.communicate(timeout=60)
    assert sup.returncode == 128 + signal.SIGINT
    assert "stopped by SIGINT; not retrying" in err
    assert log.read_text().split() == ["x"]


def test_no_command_or_bad_retries_is_an_error() -> None:
    assert run(["--"]).returncode == 2
    bad = run(["--retries", "-1", "--", sys.executable, "-c", "pass"])
    assert bad.returncode == 2 and "--retries" in bad.stderr


def test_a_signal_while_the_child_is_being_started_reaches_it_and_stops(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C can come at any instant, also between starting a child and waiting for it. (Here it
    is sent from inside the start, so the instant is exact; the real child is still started.)
    The supervisor must not die of it leaving the child orphaned: the child gets the signal,
    nothing is retried."""
    import os

    from areal_lightning.tools import supervisor

    real_popen, started = subprocess.Popen, []

    def popen_signalled_meanwhile(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # delivered to this (the supervisor's) process now
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(supervisor.subprocess, "Popen", popen_signalled_meanwhile)
    messages: list[str] = []
    script = "import sys, time; open(sys.argv[1], 'a').write('x\\n'); time.sleep(60)"
    rc = supervisor.run_with_retries([sys.executable, "-c", script, str(tmp_path / "log")], retries=3,
                                     echo=messages.append)
    assert rc == 128 + signal.SIGINT and len(started) == 1
    assert started[0].returncode == -signal.SIGINT  # the child was ended by the forwarded signal
    assert messages[-1] == "[areal-lightning run] stopped by SIGINT; not retrying"
