"""RecoverCallback end to end: real training subprocesses killed with SIGKILL, then run again.

Each case trains the same small job (dropout, AdamW, per-step LR scheduler) once without
interruption, and once killed and restarted with the same command; the per-step losses of
the interrupted + resumed run must equal the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.losses import step_losses
from tests.harness.refcache import reference_run

SCRIPT = Path(__file__).parent / "scripts" / "train_recover.py"
REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def train(root: Path, losses: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--losses", str(losses), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=full_env)


def both_ranks(stderr: str) -> str:
    """The end of a 2-rank run's stderr, with rank 1's own lines first (its error is usually
    far from the end, behind rank 0's report of the lost connection)."""
    rank1 = [line for line in stderr.splitlines() if line.startswith("[rank1]")]
    return "rank 1:\n" + "\n".join(rank1)[-6000:] + "\n--- end of the run's stderr:\n" + stderr[-3000:]


losses_by_step = step_losses  # every loss of each step (tests/harness/losses.py)


def reference_key(args: tuple[str, ...]) -> tuple[str, ...]:
    """The arguments that change the uninterrupted run's training: not the io mode nor the
    checkpoint frequencies (saving reads the state, it never changes it), nor the Lightning
    namespace (a ``pytorch_lightning`` run must train as the ``lightning.pytorch`` one does)."""
    key, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--io-mode", "--freq-steps", "--freq-epochs", "--namespace"):
            skip = True
        else:
            key.append(a)
    return tuple(key)


def reference_root(tmp_path_factory, args: tuple[str, ...]) -> Path:
    """The folder of the uninterrupted run of ``args`` (once per training configuration and suite
    run, shared by the workers: tests/harness/refcache.py). Tests must not change it."""
    cmd = [sys.executable, str(SCRIPT), "--root", "{root}", "--losses", "{root}/losses.jsonl", *reference_key(args)]
    root, proc = reference_run(tmp_path_factory, cmd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def reference(tmp_path_factory, args: tuple[str, ...]) -> dict[int, set[str]]:
    """The uninterrupted run's losses (computed once per configuration)."""
    return losses_by_step(reference_root(tmp_path_factory, args) / "losses.jsonl")


def logged_losses(root: Path) -> dict[int, str]:
    """train_loss per step as the CSVLogger wrote it."""
    import csv

    rows = csv.DictReader(open(root / "logs" / "run" / "version_0" / "metrics.csv"))
    return {int(r["step"]): r["train_loss"] for r in rows if r.get("train_loss")}


def assert_exact(got: dict[int, set[str]], want: dict[int, set[str]]) -> None:
    assert sorted(got) == sorted(want), "the resumed run did not train exactly the same steps"
    for step in want:
        assert got[step] == want[step], f"step {step}: losses {got[step]} != uninterrupted {want[step]}"


CASES = {
    # name: (kill at step, extra args); 12 steps per epoch, 3 epochs, recover every 5 steps.
    # A representative set of real SIGKILLs (the loaders without workers, shuffled or not,
    # plain or stateful, and epoch-end checkpoints with each, are resumed in-process by
    # tests/test_recover.py and tests/test_matrix.py; a plain loader with 2 workers is
    # "second-epoch" and "pytorch-lightning-async-2-workers" with async saves).
    "plain-shuffle-mid-epoch": (7, ()),
    "stateful-loader-2-workers": (17, ("--loader", "stateful", "--workers", "2")),
    "right-after-epoch-end-checkpoint": (13, ("--freq-steps", "100", "--freq-epochs", "1")),
    "async-checkpoint": (12, ("--io-mode", "async")),  # the save of step 5 is surely committed by step 10's
    "second-epoch": (23, ("--io-mode", "async", "--workers", "2")),
    # `import pytorch_lightning as pl`: the same training, compared with lightning.pytorch's run
    # (killed at 12 as "async-checkpoint" is: the save of step 10 first waited for step 5's)
    "pytorch-lightning-async-2-workers": (12, ("--namespace", "pytorch_lightning", "--io-mode", "async",
                                               "--workers", "2")),
}


@pytest.mark.parametrize("case", [  # one case in fresh interpreters (the others: forks of the test fork server)
    pytest.param(c, marks=pytest.mark.fresh_interpreter) if c == "stateful-loader-2-workers" else c for c in CASES])
def test_sigkill_then_same_command_resumes_bit_for_bit(tmp_path, tmp_path_factory, case) -> None:
    kill_at, args = CASES[case]
    want = reference(tmp_path_factory, args)
    losses = tmp_path / "losses.jsonl"
    killed = train(tmp_path, losses, *args, "--kill-at-step", str(kill_at))
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert max(losses_by_step(losses)) == kill_at  # killed at the end of that step
    resumed = train(tmp_path, losses, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "RecoverCallback: resumed from" in resumed.stderr
    got = losses_by_step(losses)
    assert_exact(got, want)
    # Steps between the checkpoint and the kill ran twice, with identical losses.
    assert any(len(v) == 1 for v in got.values())
    ref = reference_root(tmp_path_factory, args)
    info = Path("checkpoints") / "u" / "exp" / "t" / "recover_info" / "step_info.json"
    # The final position (epoch, step in epoch, global step) equals the uninterrupted run's,
    # also after a resume at an epoch boundary (Lightning skips that epoch's start hook).
    assert json.loads((tmp_path / info).read_text()) == json.loads((ref / info).read_text())
    assert json.loads((tmp_path / info).read_text())["global_step"] == max(want) - 1
    # The logger continued its version instead of starting a new one, and the rows the
    # interrupted run had flushed are kept: the CSV equals the uninterrupted run's.
    assert [p.name for p in (tmp_path / "logs" / "run").iterdir()] == ["version_0"]
    assert logged_losses(tmp_path) == logged_losses(ref)


def test_rerunning_a_finished_run_does_nothing(tmp_path, tmp_path_factory) -> None:
    # a finished run (shared with the other tests): rerun a copy of it
    shutil.copytree(reference_root(tmp_path_factory, ()), tmp_path, dirs_exist_ok=True)
    losses = tmp_path / "losses.jsonl"
    n = len(losses.read_text().splitlines())
    again = train(tmp_path, losses)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(losses.read_text().splitlines()) == n
    assert "after global step 35" in again.stderr


def test_retries_supervisor_resumes_a_crashing_training_run(tmp_path, tmp_path_factory) -> None:
    """`areal-lightning run --retries 2` around a job killed twice (at steps 7 and 19)."""
    want = reference(tmp_path_factory, ())
    losses = tmp_path / "losses.jsonl"
    wrapper = tmp_path / "job.py"
    wrapper.write_text(
        "import os, sys, subprocess\n"
        "attempt = int(os.environ['AREAL_LIGHTNING_ATTEMPT'])\n"
        "kill = {1: ['--kill-at-step', '7'], 2: ['--kill-at-step', '19']}.get(attempt, [])\n"
        f"sys.exit(subprocess.call([sys.executable, {str(SCRIPT)!r}, '--root', {str(tmp_path)!r}, "
        f"'--losses', {str(losses)!r}, *kill]))\n")
    proc = subprocess.run([sys.executable, "-m", "areal_lightning", "run", "--retries", "2", "--",
                           sys.executable, str(wrapper)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attempt 3/3 succeeded" in proc.stderr
    assert_exact(losses_by_step(losses), want)


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_sigterm_on_one_rank_checkpoints_that_step_on_every_rank_and_the_rerun_redoes_nothing(
        tmp_path, tmp_path_factory, namespace) -> None:
    """DDP on 2 processes, checkpoints every 5 steps; only rank 1 gets SIGTERM, after step 8.
    Both ranks agree, checkpoint step 8, exit 75; the same command trains steps 9.. once.
    Under either Lightning namespace."""
    args = ("--devices", "2", "--namespace", namespace)
    ref = reference_root(tmp_path_factory, args)  # lightning.pytorch's: pytorch_lightning must train the same
    losses = tmp_path / "losses.jsonl"
    stopped = train(tmp_path, losses, *args, "--sigterm-at-step", "8", "--sigterm-rank", "1")
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "SIGTERM received" in stopped.stderr and "stopping with exit code 75" in stopped.stderr
    info = tmp_path / "checkpoints" / "u" / "exp" / "t" / "recover_info" / "step_info.json"
    assert json.loads(info.read_text())["global_step"] == 7
    resumed = train(tmp_path, losses, *args)
    assert resumed.returncode == 0, both_ranks(resumed.stderr)
    for rank in (0, 1):
        steps = [json.loads(line)["step"] for line in Path(f"{losses}.rank{rank}").read_text().splitlines()]
        assert steps == sorted(set(steps)), f"rank {rank} trained a step twice"
        assert_exact(losses_by_step(Path(f"{losses}.rank{rank}")), losses_by_step(ref / f"losses.jsonl.rank{rank}"))


def test_sigkill_during_the_preemption_save_leaves_the_old_or_the_new_checkpoint(tmp_path, tmp_path_factory) -> None:
    """SIGTERM after step 8, then SIGKILL in the middle of the swap of that save (the old
    checkpoint renamed aside, the new one not yet in place): the rerun resumes exactly."""
    import os

    want = reference(tmp_path_factory, ())
    losses = tmp_path / "losses.jsonl"
    env = {"AREAL_LIGHTNING_FAULT": "recover.swap.old_checkpoint_moved:kill"}  # reached first by step 8's save
    killed = train(tmp_path, losses, "--sigterm-at-step", "8", env={**os.environ, **env})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "SIGTERM received" in killed.stderr
    resumed = train(tmp_path, losses)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_exact(losses_by_step(losses), want)
