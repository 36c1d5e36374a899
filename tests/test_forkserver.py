"""The test fork server (tests/harness/forkserver.py) keeps what a fresh interpreter gives a
script: argv, working directory, environment, stdio, exit status, signals, a SIGKILL's -9,
and a hash seed of its own on odd and even ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.harness.forkserver import ENV

SCRIPT = r'''
import json, os, signal, sys, time
mode = sys.argv[1]
if mode == "report":
    import torch
    from lightning.pytorch.utilities import rank_zero_only
    print(json.dumps({"rank_zero": rank_zero_only.rank, "argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("PROBE"), "main": __name__,
                      "path0": sys.path[0], "hash": hash("areal"), "pgid_is_own": os.getpgid(0) == os.getpid(),
                      "threads": torch.get_num_threads(), "executable": sys.executable}))
    sys.stderr.write("to stderr\n")
    sys.exit(3)
if mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), sys.exit(7)))
    print("ready", os.getpid(), flush=True)
    time.sleep(60)
if mode == "raise":
    raise ValueError("boom")
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_a_script_gets_what_a_fresh_interpreter_gives_it(script, tmp_path) -> None:
    if not os.environ.get(ENV):
        pytest.skip("the fork server is off (AREAL_TEST_FORK_SERVER=0)")
    runs = {}
    for rank in ("0", "1"):
        proc = subprocess.run([sys.executable, str(script), "report", "x y"], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "PROBE": "p", "RANK": rank, "OMP_NUM_THREADS": "2"},
                              timeout=120)
        assert proc.returncode == 3 and proc.stderr.endswith("to stderr\n"), proc.stderr
        runs[rank] = json.loads(proc.stdout)
    report = runs["0"]
    assert report["argv"] == [str(script), "report", "x y"] and report["cwd"] == str(tmp_path)
    assert report["env"] == "p" and report["main"] == "__main__" and report["path0"] == str(tmp_path)
    assert report["pgid_is_own"] and report["threads"] == 2 and report["executable"] == sys.executable
    assert runs["0"]["hash"] != runs["1"]["hash"]  # even and odd ranks: different hash seeds
    assert (runs["0"]["rank_zero"], runs["1"]["rank_zero"]) == (0, 1)  # Lightning's import-time rank

    killed = subprocess.run([sys.executable, str(script), "kill"], capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    raised = subprocess.run([sys.executable, str(script), "raise"], capture_output=True, text=True, timeout=120)
    assert raised.returncode == 1 and "ValueError: boom" in raised.stderr

    term = subprocess.Popen([sys.executable, str(script), "term"], stdout=subprocess.PIPE, text=True)
    assert term.stdout.readline().startswith("ready ")
    term.send_signal(signal.SIGTERM)  # forwarded to the script's own handler
    assert term.wait(timeout=60) == 7 and term.stdout.read() == "terminated\n"

    victim = subprocess.Popen([sys.executable, str(script), "term"], stdout=subprocess.PIPE, text=True)
    pid = int(victim.stdout.readline().split()[1])
    victim.kill()  # the launcher SIGKILLed: the script dies with it
    assert victim.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False
