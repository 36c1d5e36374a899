"""The hung-job diagnosis of tests/harness/stacks.py: the native stacks of a process tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from tests.harness.stacks import descendants, native_stacks


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_native_stacks_show_every_process_of_a_tree() -> None:
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nelse:\n    time.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while len(descendants(proc.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        parent, child = descendants(proc.pid)
        stacks = native_stacks(proc.pid)
        if "gdb: " in stacks:
            pytest.skip(f"gdb cannot read these processes here: {stacks}")
        assert f"pid {parent} (" in stacks and f"pid {child} (" in stacks, stacks
        assert "sleep" in stacks, stacks  # both are in time.sleep: clock_nanosleep / pysleep
        assert "PyOS_AfterFork_Child" not in stacks
    finally:
        for pid in descendants(proc.pid)[::-1]:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        proc.wait()
