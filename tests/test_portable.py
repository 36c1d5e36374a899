"""Portable recover checkpoints (issue 25): checkpoints of earlier releases, ``convert`` to an HF
folder and to one Lightning file. (Resuming under another strategy family and world size:
``tests/test_distributed.py::test_a_recover_checkpoint_resumes_under_another_strategy_and_world_size``.)

``tests/fixtures/recover_trial_v0_1_0`` is a whole trial written by release 0.1.0 (commit 111c3fb):
``tests/scripts/train_recover.py --freq-steps 4 --epochs 2 --logger none --kill-at-step 5`` on one
process, killed after step 5 (its checkpoint: step 4; its optimizer state keyed by position), with
the losses the killed run logged (``losses.jsonl``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_recover_e2e import assert_exact, losses_by_step, train

FIXTURE = Path(__file__).parent / "fixtures" / "recover_trial_v0_1_0"
TRIAL = Path("checkpoints/u/exp/t")
ARGS = ("--freq-steps", "4", "--epochs", "2", "--logger", "none")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_recover_trial_of_release_0_1_0_resumes_exactly(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    proc = train(ref, ref / "losses.jsonl", *ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = losses_by_step(ref / "losses.jsonl")
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    before = losses_by_step(run / "losses.jsonl")
    assert {step: before[step] for step in range(1, 6)} == {step: want[step] for step in range(1, 6)}
    resumed = train(run, run / "losses.jsonl", *ARGS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "RecoverCallback: resumed from" in resumed.stderr
    assert_exact(losses_by_step(run / "losses.jsonl"), want)  # step 5 twice (the kill lost it), then the rest
    steps = [json.loads(line)["step"] for line in (run / "losses.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, *range(5, max(want) + 1)]  # resumed after step 4, the checkpoint's


@pytest.mark.slow
def test_a_checkpoint_keyed_by_position_is_refused_by_a_sharded_strategy_naming_both(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    before = _files(tmp_path / TRIAL)
    proc = train(tmp_path, tmp_path / "losses.jsonl", *ARGS, "--strategy", "fsdp2", "--devices", "1")
    assert proc.returncode != 0
    assert ("strategy='SingleDeviceStrategy', whose optimizer states are keyed by position (written before "
            "areal_lightning 0.2.0") in proc.stderr
    assert "this run has strategy='ModelParallelStrategy'" in proc.stderr and "Resume with a replicated" in proc.stderr
    after = _files(tmp_path / TRIAL)
    after.pop(".lock", None)
    assert after == before  # nothing on disk changed
