"""Fast checks of the fault-injection machinery and of certify's building blocks (no training)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from areal_lightning import _fault
from areal_lightning._fault import (
    POINTS,
    InjectedFault,
    fault_point,
    reset_fault_counts,
)
from areal_lightning.tools.certify import (
    CertifyUsageError,
    certify,
    expected_resume,
    leftovers,
    read_losses,
    run_group,
)

PACKAGE = Path(_fault.__file__).resolve().parent


def test_every_fault_point_of_the_package_is_registered_and_vice_versa() -> None:
    used = set()
    for source in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "fault_point"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                used.add(node.args[0].value)
    assert used == set(POINTS)
    assert len(POINTS) >= 20


def test_unset_is_a_no_op_and_raise_counts_hits(monkeypatch) -> None:
    monkeypatch.delenv(_fault.ENV_VAR, raising=False)
    fault_point("engine.before_commit")  # nothing
    monkeypatch.setenv(_fault.ENV_VAR, "engine.before_commit@2")
    reset_fault_counts()
    fault_point("engine.before_commit")
    with pytest.raises(InjectedFault):
        fault_point("engine.before_commit")
    fault_point("engine.before_commit")  # the 3rd hit passes
    monkeypatch.setenv(_fault.ENV_VAR, "engine.before_commit:explode")
    with pytest.raises(ValueError, match="unknown action"):
        fault_point("engine.before_commit")
    reset_fault_counts()


def test_trace_records_every_point_and_the_action(monkeypatch, tmp_path) -> None:
    trace = tmp_path / "trace.tsv"
    monkeypatch.setenv(_fault.ENV_VAR, "*:trace,hf.prune:raise@2")
    monkeypatch.setenv(_fault.TRACE_ENV_VAR, str(trace))
    reset_fault_counts()
    fault_point("hf.prune")
    fault_point("engine.after_commit")
    with pytest.raises(InjectedFault):
        fault_point("hf.prune")
    reset_fault_counts()
    rows = [line.split("\t") for line in trace.read_text().splitlines()]
    pid = str(os.getpid())
    assert rows == [["hf.prune", pid, "1", "trace"], ["engine.after_commit", pid, "1", "trace"],
                    ["hf.prune", pid, "2", "trace"], ["hf.prune", pid, "2", "raise"]]


def test_kill_from_a_background_thread_kills_the_process(tmp_path) -> None:
    """An async save reaches its points in a background thread: ``kill`` must still SIGKILL
    the whole process, and the kill is traced before it happens."""
    code = textwrap.dedent("""
        import threading, time
        from areal_lightning._fault import fault_point
        t = threading.Thread(target=fault_point, args=("engine.after_shard_file",))
        t.start(); t.join()
        time.sleep(5)
        print("survived")
    """)
    trace = tmp_path / "trace.tsv"
    env = {**os.environ, _fault.ENV_VAR: "engine.after_shard_file:kill", _fault.TRACE_ENV_VAR: str(trace)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9 and "survived" not in proc.stdout
    assert trace.read_text().split("\t")[-1] == "kill\n"


def test_run_group_kills_every_process_of_the_group_when_one_hits_the_kill(tmp_path) -> None:
    """A 'rank' (child process) killed at a point leaves its parent waiting forever, as a DDP
    rank waits in a collective: run_group kills the whole group as soon as the kill is traced."""
    child = ("import time; from areal_lightning._fault import fault_point; time.sleep(0.5); "
             "fault_point('hf.prune'); time.sleep(60)")
    parent = (f"import subprocess, sys, time, os; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              f"open({str(tmp_path / 'child.pid')!r}, 'w').write(str(p.pid)); time.sleep(120)")
    trace = tmp_path / "trace.tsv"
    env = {**os.environ, _fault.ENV_VAR: "hf.prune:kill", _fault.TRACE_ENV_VAR: str(trace)}
    result = run_group([sys.executable, "-c", parent], env, tmp_path / "log", timeout=100, trace=trace)
    # killed when the kill was traced, not at the timeout (the parent would sleep 120 s)
    assert result.killed and result.killed_by.startswith("hf.prune ") and not result.timed_out
    assert result.rc == -9
    child_pid = int((tmp_path / "child.pid").read_text())
    # SIGKILLed with the group: gone or a zombie once the kernel has ended it (no fixed sleep: it
    # would sleep on for 60 s if it had not been killed, long past this bound)
    stat = Path(f"/proc/{child_pid}/stat")
    deadline = time.monotonic() + 30
    while stat.exists() and "Z" not in stat.read_text().split()[2] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stat.exists() or "Z" in stat.read_text().split()[2]


def test_run_group_timeout_kills_the_group(tmp_path) -> None:
    result = run_group([sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), tmp_path / "log",
                       timeout=1)
    assert result.timed_out and result.rc == -9 and not result.killed


def _info(path: Path, step: int) -> None:
    path.mkdir(parents=True)
    (path / "step_info.json").write_text(json.dumps({"global_step": step}))
    (path / "checkpoint_info.json").write_text("{}")


def test_expected_resume_follows_the_commit_protocol(tmp_path) -> None:
    trial = tmp_path / "t"
    (trial / "default" / "recover_checkpoint").mkdir(parents=True)
    assert expected_resume(trial) is None  # nothing committed
    _info(trial / "recover_info", 4)
    assert expected_resume(trial) == 4
    # new pair complete beside the old one, swap not begun: the old pair stays
    _info(trial / ".tmp-recover_info-12-abc", 11)
    (trial / "default" / ".tmp-recover_checkpoint-12-abc").mkdir()
    assert expected_resume(trial) == 4
    # the swap began (the old checkpoint moved aside): the next start rolls forward
    (trial / "default" / "recover_checkpoint").rename(trial / "default" / ".old-recover_checkpoint-12-abc")
    assert expected_resume(trial) == 11
    assert leftovers(trial) == [".tmp-recover_info-12-abc", "default/.old-recover_checkpoint-12-abc",
                                "default/.tmp-recover_checkpoint-12-abc"]


def test_read_losses_groups_replayed_steps_and_rejects_garbage(tmp_path) -> None:
    path = tmp_path / "l.jsonl"
    path.write_text('{"step": 1, "loss": "0x1.8p+0"}\n{"step": 1, "loss": "0x1.8p+0", "rank": 0}\n'
                    '{"step": 1, "loss": "0x1.0p+0", "rank": 1}\n')
    assert read_losses(path) == {(0, 1): {'"0x1.8p+0"'}, (1, 1): {'"0x1.0p+0"'}}
    path.write_text('{"loss": 1.0}\n')
    with pytest.raises(ValueError, match="not a loss record"):
        read_losses(path)


def test_usage_errors(tmp_path) -> None:
    with pytest.raises(CertifyUsageError, match="no training command"):
        certify(["--"], echo=lambda m: None)
    with pytest.raises(CertifyUsageError, match="unknown fault point 'nope'"):
        certify(["python", "x.py"], points="nope", echo=lambda m: None)
    with pytest.raises(CertifyUsageError, match="@N"):
        certify(["python", "x.py"], points="hf.prune@0", echo=lambda m: None)
    proc = subprocess.run([sys.executable, "-m", "areal_lightning", "certify", "--points", "nope", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown fault point" in proc.stderr


def test_a_command_that_records_no_losses_is_refused_clearly(tmp_path) -> None:
    """The reference must record losses and write a trial below {root}; otherwise certify
    explains the protocol and fails (exit 1) instead of passing anything."""
    report = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "areal_lightning", "certify", "--modes", "sync", "--points", "hf.prune",
         "--json", str(report), "--workdir", str(tmp_path / "w"), "--", sys.executable, "-c", "print('{root}')"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(report.read_text())
    assert doc["cases"][0]["status"] == "error"
    assert "recorded no losses" in doc["references"]["sync"]["error"]
