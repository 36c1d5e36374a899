"""Reference runs computed once per suite run and shared by every test (and xdist worker) that
compares with them.

A reference is keyed by what produces it: the exact command (with ``{root}`` standing for its
output folder) and the environment it runs in (``os.environ`` less pytest's per-test and
per-worker variables, plus the extra variables given). The first test to ask produces it under
an exclusive file lock in a folder shared by the workers of this pytest run
(``/tmp/pytest-of-USER/pytest-N/refcache``); the others wait on the lock and read it. A new
pytest run has a new base folder, so nothing is shared across suite runs.

Tests must not change a reference's folder: copy what they need to change.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]

# Variables that differ between tests or workers of one run and do not change what a run computes.
_VOLATILE = ("PYTEST_", "COV_CORE_", "COVERAGE_", "AREAL_TEST_ZYGOTES")
WAITS = "waits.jsonl"  # one line per wait on another worker's reference (see conftest's summary)


def _base(tmp_path_factory: Any) -> Path:
    base = Path(tmp_path_factory.getbasetemp())
    if os.environ.get("PYTEST_XDIST_WORKER"):  # popen-gwN: the run's folder is its parent
        base = base.parent
    folder = base / "refcache"
    folder.mkdir(exist_ok=True)
    return folder


def environment_key(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a reference depends on (sorted, volatile variables left out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_VOLATILE)}
    env.update(extra or {})
    return dict(sorted(env.items()))


def shared(tmp_path_factory: Any, key: Any, produce: Callable[[Path], T]) -> tuple[Path, T]:
    """``(folder, value)``: ``produce(folder)`` run once per suite run for ``key`` (any
    JSON-serializable description of what is computed); its return value is pickled, so every
    worker gets the same value."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    base = _base(tmp_path_factory)
    folder, done = base / digest, base / f"{digest}.pkl"
    with open(base / f"{digest}.lock", "w") as lock:
        start = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited = time.monotonic() - start
        try:
            if waited > 1.0:  # another worker was producing it: time this worker stood idle
                with open(base / WAITS, "a") as log:
                    log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0],
                                          "waited": round(waited, 1)}) + "\n")
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a producer that raised left
                folder.mkdir()
                value = produce(folder)
                tmp = done.with_suffix(".tmp")
                tmp.write_bytes(pickle.dumps(value))
                tmp.replace(done)
                (base / f"{digest}.key.json").write_text(json.dumps(key, indent=1, default=str))
            return folder, pickle.loads(done.read_bytes())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def reference_run(tmp_path_factory: Any, command: list[str], *, env: dict[str, str] | None = None,
                  cwd: Path = REPO, timeout: float = 300, mkdirs: tuple[str, ...] = ()) -> tuple[Path, subprocess.CompletedProcess]:
    """Run ``command`` (``{root}`` in any argument: the reference's folder) once per suite run;
    ``(root, completed process)``. ``mkdirs``: sub-folders of root to create first. A failed
    run is cached as failed: the caller asserts on its return code."""
    full_env = environment_key(env)

    def produce(root: Path) -> subprocess.CompletedProcess:
        for sub in mkdirs:
            (root / sub).mkdir(parents=True, exist_ok=True)
        args = [a.replace("{root}", str(root)) for a in command]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env={**os.environ, **(env or {})})
        return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout, proc.stderr)

    return shared(tmp_path_factory, {"command": command, "env": full_env, "cwd": str(cwd), "python": sys.executable,
                                     "mkdirs": list(mkdirs)}, produce)
