"""Multi-process RecoverCallback runs on 2 CPU ranks (gloo): DDP and FSDP2 (``fully_shard``
through Lightning's ``ModelParallelStrategy``), killed with SIGKILL and started again with
the same command; resharding 2 -> 1 and 1 -> 2 ranks; seconds triggers; torchrun restarts.
(The refusal of an unmappable resharding is unit-tested in tests/test_recover.py.)

Every case is a real training subprocess (tests/scripts/train_recover.py) with a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_recover_e2e import (
    REPO,
    SCRIPT,
    assert_exact,
    losses_by_step,
    reference_key,
    train,
)
from torch.distributed.checkpoint import FileSystemReader

from tests.harness.refcache import reference_run

pytestmark = pytest.mark.slow

CKPT = Path("checkpoints/u/exp/t/default/recover_checkpoint")
INFO = Path("checkpoints/u/exp/t/recover_info")


def rank_losses(path: Path, rank: int) -> dict[int, set[str]]:
    return losses_by_step(Path(f"{path}.rank{rank}"))


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_every_rank_wrote_its_shard(root: Path, sharded: bool) -> None:
    ckpt = root / CKPT
    files = sorted(p.name for p in ckpt.iterdir())
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files), files
    metadata = FileSystemReader(ckpt).read_metadata()
    writers = {item.relative_path.split("_")[2] for item in metadata.storage_data.values()}
    assert writers == {"0", "1"}, writers  # both ranks' files hold data the checkpoint uses
    chunks = metadata.state_dict_metadata["state_dict.net.0.weight"].chunks
    if sharded:  # FSDP2: each rank wrote its own half of the weight, nobody gathered it
        assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (16, 0)]
    else:  # DDP: replicated, stored once
        assert len(chunks) == 1


DIST_CASES = {
    # name: (args, kill at step); 48 samples, batch 4, 2 ranks -> 6 steps per epoch. With async
    # saves the last one may not be committed at the kill; the one before it surely is.
    # + a seconds trigger while rank 1 steps twice as slowly as rank 0 (0.4 s per step, so
    # 1 s passes within every 4 steps): rank 0 decides, both save
    "fsdp2-async-plain-loader-seconds-trigger": (
        ("--strategy", "fsdp2", "--io-mode", "async", "--freq-steps", "4", "--freq-secs", "1", "--step-sleep", "0.2",
         "--epochs", "2"), 9),
    "fsdp2-sync-stateful-loader-epoch-boundary": (
        ("--strategy", "fsdp2", "--loader", "stateful", "--workers", "1", "--freq-steps", "6", "--epochs", "2"), 8),
    # under `import pytorch_lightning as pl`, compared with lightning.pytorch's uninterrupted run
    "pytorch-lightning-ddp-async-stateful-loader-mid-epoch": (
        ("--namespace", "pytorch_lightning", "--strategy", "ddp", "--io-mode", "async", "--loader", "stateful",
         "--freq-steps", "2", "--epochs", "2"), 5),
    # 4 ranks: 3 steps per epoch and rank. With 2 ranks every all-reduce is a + b, whatever its
    # order; with 4 the resumed process must reduce in the uninterrupted one's order (DDP's
    # gradient buckets as rebuilt after its first iteration).
    # Compared also: the full model and optimizer state after every step (a gradient that differs
    # in its last bit is often absorbed by the weight's rounding, never by Adam's moments).
    # (Epoch-end positions are covered with 2 ranks; the reduction order does not depend on them.)
    **{f"{strategy}-4-ranks-mid-epoch": (("--devices", "4", "--strategy", strategy, "--freq-steps", "4", "--epochs",
                                          "3", "--dump-every", "1"), 6)
       for strategy in ("ddp", "fsdp2")},
    # the checkpoint of the first step: DDP has not rebuilt its buckets yet (it would at the next
    # forward); the save rebuilds them then, so that the resumed first step uses them too
    # (3 epochs: the uninterrupted run is ddp-4-ranks-mid-epoch's)
    "ddp-4-ranks-first-step": (("--devices", "4", "--strategy", "ddp", "--freq-steps", "1", "--epochs", "3",
                                "--dump-every", "1"), 2),
}


def dist_reference(tmp_path_factory, args: tuple[str, ...]) -> tuple[Path, subprocess.CompletedProcess]:
    """The uninterrupted multi-rank run of ``args`` (once per training configuration and suite
    run, shared by the workers: tests/harness/refcache.py); with ``--dump-every`` its full model
    and optimizer state after every step (``ref/state.stepN.pt``). The recover triggers and io
    mode do not change what a run trains (``reference_key``), except a seconds trigger, whose
    saves the test counts."""
    key = args if "--freq-secs" in args else reference_key(args)
    dump = ("--dump-state", "{root}/state") if "--dump-every" in args else ()
    ref, proc = reference_run(tmp_path_factory, [sys.executable, str(SCRIPT), "--root", "{root}", "--losses",
                                                 "{root}/losses.jsonl", *key, *dump])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ref, proc


@pytest.mark.parametrize("case", list(DIST_CASES))
def test_sigkill_of_all_ranks_then_same_command_resumes_bit_for_bit(tmp_path, tmp_path_factory, case) -> None:
    extra, kill_at = DIST_CASES[case]
    devices = int(extra[extra.index("--devices") + 1]) if "--devices" in extra else 2
    args = ("--devices", "2", "--rank-seed", "--logger", "none", *extra)  # a later --devices wins
    ref, ref_proc = dist_reference(tmp_path_factory, args)
    if "--freq-secs" in extra:  # 12 steps, every 4 steps -> 3 step-triggered saves; more were seconds-triggered
        assert ref_proc.stderr.count("recover checkpoint /") > 3, ref_proc.stderr[-3000:]
    losses = tmp_path / "losses.jsonl"
    dump = ("--dump-state", str(tmp_path / "state")) if "--dump-every" in extra else ()
    killed = train(tmp_path, losses, *args, *dump, "--kill-at-step", str(kill_at))
    assert killed.returncode == -9
    if devices == 2:
        assert_every_rank_wrote_its_shard(tmp_path, sharded="fsdp2" in extra)
    resumed = train(tmp_path, losses, *args, *dump)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("RecoverCallback: resumed from") == devices  # one line per rank
    for rank in range(devices):
        assert_exact(rank_losses(losses, rank), rank_losses(ref / "losses.jsonl", rank))
    if "--dump-every" in extra:
        steps = sorted(int(p.name.split("step")[1][:-3]) for p in tmp_path.glob("state.step*.pt"))
        assert steps and steps[-1] == max(rank_losses(ref / "losses.jsonl", 0))  # the last step
        for step in steps:
            _equal(torch.load(ref / f"state.step{step}.pt"), torch.load(tmp_path / f"state.step{step}.pt"),
                   f"after step {step}")
    assert rank_losses(ref / "losses.jsonl", 0)[1] != rank_losses(ref / "losses.jsonl", 1)[1]


def _equal(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path}: {int((a != b).sum())} of {a.numel()} values differ"
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for key in a:
            _equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}.{i}")
    else:
        assert a == b, (path, a, b)


RESUME_ELSEWHERE = {
    # name: (strategy, ranks) that wrote the checkpoint -> (strategy, ranks) that resumes it, the
    # step of the checkpoint. Mid-epoch (step 4) where both shard the data with a DistributedSampler;
    # from one process (a RandomSampler: another order) at an epoch's end (6 or 12 steps an epoch).
    "fsdp2x2-to-fsdp2x1": (("fsdp2", 2), ("fsdp2", 1), 4),
    "ddpx1-to-ddpx2": (("ddp", 1), ("ddp", 2), 4),
    # across strategy families: one canonical format (parameter names, whatever the wrapper)
    "fsdp1x2-to-single": (("fsdp1", 2), ("single", 1), 6),
    "fsdp2x2-to-ddpx2": (("fsdp2", 2), ("ddp", 2), 4),
    "ddpx2-to-fsdp1x2": (("ddp", 2), ("fsdp1", 2), 4),
    "single-to-fsdp2x2": (("single", 1), ("fsdp2", 2), 12),
}


@pytest.mark.parametrize("case", list(RESUME_ELSEWHERE))
def test_a_recover_checkpoint_resumes_under_another_strategy_and_world_size(tmp_path, case) -> None:
    """A recover checkpoint written by one strategy and world size resumes under another: the
    model and optimizer state after the resume equal the saved ones (gathered by parameter
    name, bitwise), and the epoch's samples are each trained exactly once across both runs."""
    (old_strategy, old), (new_strategy, new), saved = RESUME_ELSEWHERE[case]
    args = ("--freq-steps", str(saved), "--epochs", "2", "--logger", "none", "--dump-state", str(tmp_path / "state"))
    killed = train(tmp_path, tmp_path / "old.jsonl", *args, "--strategy", old_strategy, "--devices", str(old),
                   "--kill-at-step", str(saved + 1))
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = train(tmp_path, tmp_path / "new.jsonl", *args, "--strategy", new_strategy, "--devices", str(new))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    if old != new:
        assert f"resharding the recover checkpoint written by {old} rank(s)" in resumed.stderr
    if old_strategy != new_strategy:
        assert "model and optimizer states are loaded by parameter name" in resumed.stderr
    _equal(torch.load(tmp_path / f"state.step{saved}.pt"), torch.load(tmp_path / f"state.start{saved}.pt"))

    def samples(name: str, world: int, first: int, last: int) -> list[int]:
        files = [tmp_path / name] if world == 1 else [Path(f"{tmp_path / name}.rank{r}") for r in range(world)]
        return [s for f in files for row in rows(f) if first <= row["step"] <= last for s in row["samples"]]

    before = samples("old.jsonl", old, 1, saved)  # trained and saved by the old world (the next step was lost)
    epoch = 48 * (1 + len(before) // 48)  # samples up to the end of the epoch the new world continues
    left = (epoch - len(before)) // (4 * new)  # steps the new world needs to finish it
    after = samples("new.jsonl", new, saved + 1, saved + left)
    assert sorted(before + after) == sorted(list(range(48)) * (epoch // 48))  # every sample once an epoch
    if left == 0 or epoch == 48:
        assert samples("new.jsonl", new, saved + left + 1, saved + left + 1) != []  # and then the next epoch


def test_torchrun_max_restarts_resumes_each_restart_bit_for_bit(tmp_path, tmp_path_factory) -> None:
    """``torchrun --nproc_per_node 2 --max-restarts 1 train.py``: both ranks die with SIGKILL
    in the first attempt; torchelastic restarts them and the run resumes exactly."""
    case = DIST_CASES["pytorch-lightning-ddp-async-stateful-loader-mid-epoch"][0]
    args = ("--devices", "2", "--rank-seed", "--logger", "none", *case[case.index("--strategy"):])  # lightning.pytorch
    ref, _ = dist_reference(tmp_path_factory, args)  # launched by Lightning: torchrun must give the same losses
    want = {rank: rank_losses(ref / "losses.jsonl", rank) for rank in (0, 1)}
    losses = tmp_path / "losses.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--max-restarts", "1",
           str(SCRIPT), "--root", str(tmp_path), "--losses", str(losses), *args, "--kill-at-step", "9"]
    # torch 2.13's agent keeps one TCPStore for all restarts: restarted gloo workers may read
    # their dead peers' addresses and fail (connectFullMesh) or hang. The README tells users
    # to set this, and RecoverCallback warns under torchrun --max-restarts without it.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("RecoverCallback: resumed from") == 2
    for rank in (0, 1):
        assert_exact(rank_losses(losses, rank), want[rank])
        assert len({row["pid"] for row in rows(Path(f"{losses}.rank{rank}"))}) == 2  # killed once, restarted once


@pytest.mark.parametrize("strategy,io_mode", [("fsdp2", "async"), ("ddp", "sync"), ("fsdp1", "async")])
def test_trainer_save_checkpoint_with_dcp_io_writes_every_rank_and_resumes(tmp_path, strategy, io_mode) -> None:
    """Without RecoverCallback: ``plugins=[DCPCheckpointIO()], callbacks=[StagingWaitCallback()]``
    and ``trainer.save_checkpoint`` under 2 ranks; a new Trainer's ``fit(ckpt_path=...)``
    starts from exactly the saved model and optimizer state."""
    script = Path(__file__).parent / "scripts" / "save_checkpoint_dcp.py"
    proc = subprocess.run([sys.executable, str(script), "--root", str(tmp_path), "--strategy", strategy,
                           "--io-mode", io_mode], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):  # a path of an unsupported scheme: refused on every rank, no folder "hdfs:"
        assert "path: 'hdfs://namenode/ckpt'" in (tmp_path / f"refused.rank{rank}").read_text()
    assert not (tmp_path / "hdfs:").exists()
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert ".metadata" in files and any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)
    _equal(torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "loaded.pt"))
