"""State that differs across DDP ranks comes back to each rank (tests/scripts/train_per_rank.py):
BatchNorm running statistics on 2 and 4 ranks, and an actor-critic under manual optimization
whose ranks keep their own experience buffers. Every rank is SIGKILLed mid-epoch, the same
command resumes, and every rank's losses, buffers, final weights and an eval-mode output after
the resume equal the uninterrupted run's, bit for bit."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_lightning.capture.compiled import plain_name
from areal_lightning import convert
from tests.harness.losses import rank_losses
from tests.harness.refcache import reference_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "train_per_rank.py"

CASES = {  # model, ranks, epochs, the step every rank is killed at (mid-epoch, two steps after a save), options
    "batchnorm-2-ranks": ("bn", 2, 2, 8, ()),  # 6 steps an epoch, saves every 3
    "batchnorm-4-ranks": ("bn", 4, 3, 8, ()),  # 3 steps an epoch
    # ZeRO-1: Lightning consolidates the optimizer state on rank 0 and gives the other ranks none
    "batchnorm-zero-redundancy-optimizer-2-ranks": ("bn", 2, 2, 8, ("--optimizer", "zero")),
    # 2 optimizer steps a batch; a torchmetrics metric with persistent per-rank states
    "per-rank-buffers-manual-optimization-2-ranks": ("rl", 2, 2, 16, ()),
    # the same with the critic (and its per-rank buffer) inside torch.compile: live names carry _orig_mod.
    "per-rank-buffer-in-a-compiled-submodule-2-ranks": ("rl", 2, 2, 16, ("--compile-critic",)),
}


def command(model: str, ranks: int, epochs: int, root: str, options: tuple[str, ...], *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--root", root, "--model", model, "--devices", str(ranks),
            "--epochs", str(epochs), *options, *extra]


def final(root: Path, rank: int) -> dict:
    return torch.load(root / f"final.rank{rank}.pt", weights_only=True)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_resumes_its_own_state_bit_for_bit(name, tmp_path, tmp_path_factory, caplog) -> None:
    model, ranks, epochs, kill_at, options = CASES[name]
    ref_root, ref = reference_run(tmp_path_factory, command(model, ranks, epochs, "{root}", options), timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = subprocess.run(command(model, ranks, epochs, str(tmp_path), options, "--kill-at-step", str(kill_at)),
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert killed.returncode != 0 and not (tmp_path / "final.rank0.pt").exists(), killed.stderr[-3000:]
    resumed = subprocess.run(command(model, ranks, epochs, str(tmp_path), options), capture_output=True, text=True, timeout=600,
                             cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr + resumed.stdout

    want, got = rank_losses(ref_root, ranks), rank_losses(tmp_path, ranks)
    assert got.keys() == want.keys()
    differ = sorted(key for key in want if got[key] != want[key])  # a step trained again gives the same loss
    assert not differ, f"(rank, step) whose losses differ from the uninterrupted run: {differ}"
    for rank in range(ranks):
        a, b = final(ref_root, rank), final(tmp_path, rank)
        bad = [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
        assert not bad, f"rank {rank}: tensors that differ from the uninterrupted run: {bad}"
        assert torch.equal(a["probe"], b["probe"]), f"rank {rank}: the eval-mode output differs"
    # the case is what it claims: the ranks' own state differs (else any rank's copy would do)
    states = [final(ref_root, r)["state"] for r in range(ranks)]
    own = [k for k in states[0] if any(not torch.equal(states[0][k], s[k]) for s in states[1:])]
    assert own, "no tensor differs across the ranks"
    # convert takes rank 0's copy, as Lightning's own checkpoint holds it, and says which tensors it resolved so
    with caplog.at_level("WARNING", logger="areal_lightning"):
        converted = torch.load(convert(tmp_path, "lightning", tmp_path / "converted.ckpt"), weights_only=True)
    assert "rank 0's copy" in caplog.text and any(plain_name(k) in caplog.text for k in own), caplog.text
    mine = final(tmp_path, 0)["state"]
    assert all(torch.equal(converted["state_dict"][plain_name(k)], mine[k]) for k in own), own


def test_the_memory_tier_and_the_shared_tier_copied_from_it_give_each_rank_its_own_state(
        tmp_path, tmp_path_factory, caplog) -> None:
    """The actor-critic on 2 ranks with the memory tier (a slot every step; the shared tier every 3
    steps, copied from the slots, rank 1's own tensors stored per rank). Killed mid-epoch: the
    rerun resumes from the memory tier; killed again and the memory tier deleted (its node lost,
    no replica): the third run resumes from the shared tier. Every rank's losses, state and
    eval-mode output equal the uninterrupted run's (without the tier), bit for bit."""
    model, ranks, epochs, _, options = CASES["per-rank-buffers-manual-optimization-2-ranks"]
    ref_root, ref = reference_run(tmp_path_factory, command(model, ranks, epochs, "{root}", options), timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    runs = []
    for kill in (16, 22, None):  # global steps (2 a batch): batch 8, then batch 11
        if kill is None:  # after the second kill
            assert list((tmp_path / "memory").rglob("SEALED.json"))
            shutil.rmtree(tmp_path / "memory")
        extra = ("--memory",) + (("--kill-at-step", str(kill)) if kill else ())
        runs.append(subprocess.run(command(model, ranks, epochs, str(tmp_path), options, *extra),
                                   capture_output=True, text=True, timeout=600, cwd=REPO))
        assert (runs[-1].returncode == 0) == (kill is None), runs[-1].stderr[-3000:]
    logs = [run.stderr + run.stdout for run in runs]
    assert "resuming from the memory tier" in logs[1] and "after global step 13 " in logs[1]  # global step 14
    # the shared tier's newest commit: global step 18 (written every 3 steps, from the slots; the
    # kill comes once the copies in flight are committed)
    assert re.search(r"resuming from the shared tier, \S+ after global step 17 ", logs[2]), logs[2][-3000:]
    want, got = rank_losses(ref_root, ranks), rank_losses(tmp_path, ranks)
    assert got == want
    for rank in range(ranks):
        a, b = final(ref_root, rank), final(tmp_path, rank)
        assert [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])] == []
        assert torch.equal(a["probe"], b["probe"])
