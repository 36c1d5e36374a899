"""Kill-anywhere suite: ``areal-lightning certify`` SIGKILLs real training runs at every fault point.

Each test runs the certify command line as a subprocess on ``train_fault.py`` (a tiny Llama,
2 epochs of 8 steps, ``RecoverCallback`` every 4 steps and ``HFSaverCallback`` every 3 steps
with ``max_keep=2``) and requires every case to pass: the rerun resumed from the last
committed checkpoint, the per-step losses are bit-for-bit those of the uninterrupted run,
the final ``step_info.json`` is the uninterrupted run's, no temporary folder is left, and
every HF export loads and equals the uninterrupted run's.

To fit the CI budget the cases run chained (``--chain``: each rerun is itself killed at the
next point, so one run per case) on 2 jobs, with one shared uninterrupted reference per
configuration: every point single-process sync (in an order where the re-export point
``commit.publish.old_removed``, never reached without a crash, follows a kill right after an
export), a subset single-process async, and a subset under DDP with 2 ranks, unchained (the
whole process group is killed when one rank hits the point). Run the full matrix
yourself: ``areal-lightning certify --modes sync,async -- python tests/fault/train_fault.py
--root {root} --mode {mode}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_lightning._fault import POINTS

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "train_fault.py"

# Every point, in the order the chains run them (two chains: --jobs 2 splits the list in halves).
SYNC_ORDER = [
    "engine.before_staging", "engine.after_staging", "engine.after_shard_file", "engine.before_commit",
    "engine.after_commit", "recover.info.after_file", "recover.info.before_checkpoint_info",
    "commit.json.before_replace", "recover.swap.begin", "recover.swap.old_checkpoint_moved",
    "recover.swap.new_checkpoint_in_place",
    "recover.swap.old_info_moved", "recover.swap.new_info_in_place", "hf.after_weights", "hf.before_publish",
    "commit.before_rename", "commit.after_rename", "commit.publish.old_removed", "hf.prune",
    "commit.remove_dir.begin", "commit.remove_renamed", "commit.remove_dir.done",
]
# The object-store points are reached only with an s3:// fileroot: tests/test_objectstore.py
# SIGKILLs a real run in the middle of an upload and stops the commit at each marker point.
OBJECT_STORE_POINTS = ["objectstore.mid_upload", "objectstore.before_marker", "objectstore.after_marker",
                       "objectstore.marker_deleted"]
# The memory tier's points are reached only with the tier on (--memory: a slot after every step).
MEMORY_POINTS = ["memory.mid_copy", "memory.before_metadata", "memory.before_seal", "memory.after_seal",
                 "memory.mid_persist"]
# Reached with peer copies only (2 nodes): tests/test_memory_tier.py SIGKILLs both nodes there.
PEER_POINTS = ["memory.mid_replica"]
# @1: killed while the very first checkpoint is written, so the restart is a fresh start.
ASYNC_SUBSET = ["engine.after_shard_file@1", "recover.swap.new_checkpoint_in_place", "hf.before_publish", "hf.prune"]
DDP_SUBSET = ["engine.after_shard_file", "recover.swap.old_info_moved", "hf.prune"]


def certify(tmp_path: Path, *options: str, script_args: tuple[str, ...] = (), timeout: int = 600) -> dict:
    """Run ``areal-lightning certify`` on train_fault.py; return its JSON report (asserting exit 0)."""
    report = tmp_path / "certify.json"
    cmd = [sys.executable, "-m", "areal_lightning", "certify", "--json", str(report), "--workdir",
           str(tmp_path / "work"), "--timeout", "240", *options, "--",
           sys.executable, str(SCRIPT), "--root", "{root}", "--mode", "{mode}", *script_args]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(proc.stdout[-20000:])  # the table (shown with -s or on failure)
    print(proc.stderr[-5000:], file=sys.stderr)
    print(f"certify {' '.join(options)} {' '.join(script_args)}: {time.monotonic() - start:.1f}s")
    assert report.is_file(), proc.stderr[-5000:]
    doc = json.loads(report.read_text())
    failed = {f"{c['mode']}:{c['point']}": c["reasons"] for c in doc["cases"] if c["status"] in ("fail", "error")}
    assert not failed, f"certify failed cases:\n{json.dumps(failed, indent=1)[:8000]}\n{proc.stdout[-8000:]}"
    assert proc.returncode == 0, proc.stderr[-5000:]
    return doc


def cases_by_point(doc: dict) -> dict[str, dict]:
    return {c["point"]: c for c in doc["cases"]}


def test_sync_order_lists_every_point() -> None:
    assert sorted(SYNC_ORDER + OBJECT_STORE_POINTS + MEMORY_POINTS + PEER_POINTS) == sorted(POINTS)


def test_every_fault_point_sync_and_a_subset_async_single_process(tmp_path) -> None:
    """Every point with sync saves, and async saves (points reached in background threads) at a
    subset; one certify run, so the two references and the chains share the 2 jobs."""
    doc = certify(tmp_path, "--chain", "--jobs", "2", "--modes", "sync,async", "--strict",
                  "--points", "sync=" + ",".join(SYNC_ORDER), "--points", "async=" + ",".join(ASYNC_SUBSET))
    sync = {c["point"]: c for c in doc["cases"] if c["mode"] == "sync"}
    assert set(sync) == set(POINTS) - set(OBJECT_STORE_POINTS) - set(MEMORY_POINTS) - set(PEER_POINTS)
    assert sorted(c["point"] for c in doc["cases"] if c["mode"] == "async") == sorted(
        p.partition("@")[0] for p in ASYNC_SUBSET)
    assert all(c["status"] == "pass" and c["killed"] for c in doc["cases"])
    # Kills before anything was committed (a fresh restart) and after (a resume) both happened.
    resumed = [c["expected_resume"] for c in doc["cases"]]
    assert None in resumed and any(r is not None for r in resumed)


def test_ddp_two_ranks_unchained_and_a_point_not_reached(tmp_path) -> None:
    """strategy="ddp" on 2 CPU ranks (12 steps), each case unchained (killed run + clean rerun):
    both ranks reach the shard-file point (the whole process group is killed as soon as one
    of them is), rank 0 alone swaps. Without an HF saver (--no-hf) the HF point is never
    reached and is reported so, never as a pass."""
    doc = certify(tmp_path, "--jobs", "2", "--modes", "sync", "--points", ",".join(DDP_SUBSET),
                  script_args=("--devices", "2", "--samples", "48", "--no-hf"))
    cases = cases_by_point(doc)
    assert cases["hf.prune"]["status"] == "not reached"
    for point in ("engine.after_shard_file", "recover.swap.old_info_moved"):
        case = cases[point]
        assert case["status"] == "pass" and case["link"] == 1
        assert len(case["resumed_from"]) == 2  # one "resumed from" line per rank
    assert not (tmp_path / "work").exists()  # everything passed: nothing kept


def _replayed(case: dict) -> int:
    """Steps trained twice in a case (on the rank with the most), from certify's "yes (N replayed)"."""
    return int(case["exact"].split("(")[1].split()[0])


@pytest.mark.parametrize("ranks", [1, 2])
def test_memory_tier_every_point(tmp_path, ranks) -> None:
    """The memory tier (a slot after every step, the shared tier every 4 steps, copied from the
    slots), on 1 rank and on 2 DDP ranks: a SIGKILL of every process at each of its points,
    chained: every rerun resumes from the newest step every rank sealed (certify's oracle reads
    the seals), the losses are bit for bit the uninterrupted run's, and at most one step is
    trained twice. (The peer copy's point: two nodes in ``tests/test_memory_tier.py``.)"""
    extra = ("--devices", "2", "--samples", "48") if ranks == 2 else ()
    doc = certify(tmp_path, "--chain", "--jobs", "2", "--modes", "sync", "--strict",
                  "--points", "sync=" + ",".join(MEMORY_POINTS), script_args=("--memory", "--no-hf", *extra))
    assert sorted(c["point"] for c in doc["cases"]) == sorted(MEMORY_POINTS)
    for case in doc["cases"]:
        assert case["status"] == "pass" and case["killed"], case
        assert case["expected_resume"] is not None and len(case["resumed_from"]) == ranks
        assert _replayed(case) <= 1, case  # at most one step trained twice
