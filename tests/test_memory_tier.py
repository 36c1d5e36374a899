"""The memory tier of RecoverCallback, in process: configuration, resume from the newest sealed
step, damaged slots, stale slots, free space.

Crashes here are exceptions raised from a callback before the step's save point (the slots on
disk are what a SIGKILL leaves: the background seal of the previous step is finished by the
session's close). The SIGKILLs at the tier's fault points, on 1 and 2 ranks, are in
``tests/fault/test_kill_anywhere.py``.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from areal_lightning import ConfigError, RecoverCallback
from areal_lightning import DCPCheckpointIO, MemorySpaceError
from areal_lightning.commit import memory_tier
from areal_lightning.commit.memory_tier import tier_folder
from areal_lightning.layout import COMMIT_MARKER, MEMORY_SEAL
from areal_lightning.tools.inspect import inspect_path
from tests.conftest import Crash, CrashAt, make_trainer
from tests.harness.refcache import reference_run

WHERE = dict(experiment_name="e", trial_name="t", user="u")


class Net(pl.LightningModule):
    """Dropout (RNG), BatchNorm (buffers updated in the forward), an EMA updated in the module's own
    hook, AdamW with a per-step schedule."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        self.register_buffer("ema", torch.zeros(1))
        self.losses: dict[int, str] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses[self.trainer.global_step + 1] = loss.item().hex()
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.mul_(0.9).add_(0.1 * outputs["loss"].detach())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    return DataLoader(TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g)),
                      batch_size=4, shuffle=True)


class SignalAt(pl.Callback):
    """Sends a real signal to this process at the end of a step (before RecoverCallback's hook)."""

    def __init__(self, step: int, sig: int) -> None:
        self.step, self.sig = step, sig

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.sig)


def run(root: Path, crash: int | None = None, memory: Any = True, freq_steps: int | None = 4,
        fileroot: str | None = None, signal_at: tuple[int, int] | None = None, watch: tuple[Any, ...] = (),
        **options: Any) -> Net:
    """One fit of 2 epochs of 10 steps; the shared tier every ``freq_steps`` steps (in ``root``, or
    ``fileroot``), the memory tier in ``{root}/shm``; ``crash``: an exception at that step, before
    its save point; ``signal_at``: (step, signal) sent at that step's end (the run's exit code is
    then the module's ``exit_code``); ``watch``: more callbacks."""
    pl.seed_everything(0, verbose=False)
    net = Net()
    if memory is True:
        memory = {"root": str(root / "shm")}
    recover = RecoverCallback(fileroot=fileroot or str(root), **WHERE, freq_steps=freq_steps, memory=memory,
                              **options)
    trainer = make_trainer(([CrashAt(crash)] if crash else []) + ([SignalAt(*signal_at)] if signal_at else [])
                           + [*watch, recover])
    if crash:
        with pytest.raises(Crash):
            trainer.fit(net, loader())
    elif signal_at:
        with pytest.raises(SystemExit) as stopped:
            trainer.fit(net, loader())
        net.exit_code = stopped.value.code
    else:
        trainer.fit(net, loader())
    return net


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, str]:
    """The uninterrupted run's loss of every step (memory tier off)."""
    return run(tmp_path_factory.mktemp("reference"), memory=None).losses


def tier(root: Path) -> Path:
    return tier_folder(str(root / "shm"), "u", "e", "t", "default")


def seals(root: Path) -> dict[int, int]:
    """slot -> the global step its seal holds (rank 0)."""
    out = {}
    for seal in sorted((tier(root) / "rank0").glob(f"slot*/{MEMORY_SEAL}")):
        out[int(seal.parent.name[4:])] = json.loads(seal.read_text())["global_step"]
    return out


def slot_of(root: Path, step: int) -> Path:
    return next(tier(root) / "rank0" / f"slot{k}" for k, s in seals(root).items() if s == step)


def flip_a_byte(slot: Path) -> None:
    data = slot / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x40
    data.write_bytes(bytes(raw))


class LastRead(pl.Callback):
    """What the resume's load read (the engine's ``last_read`` at the start of training), and
    whether the loaded checkpoint a memory-tier choice handed to Lightning (``preloaded``) is
    still alive then: once restored, only the live model and optimizers may hold its state."""

    def __init__(self, monkeypatch) -> None:
        self.handed: list[weakref.ref] = []
        preloaded = DCPCheckpointIO.preloaded

        def spy(io, path, checkpoint):
            self.handed.append(weakref.ref(next(iter(checkpoint["state_dict"].values()))))
            return preloaded(io, path, checkpoint)

        monkeypatch.setattr(DCPCheckpointIO, "preloaded", spy)

    def on_train_start(self, trainer, pl_module) -> None:
        recover = next(c for c in trainer.callbacks if isinstance(c, RecoverCallback))
        self.read = recover.checkpoint_io.engine.last_read
        gc.collect()
        self.alive = [ref() is not None for ref in self.handed]


def test_a_crash_resumes_from_the_newest_sealed_step_bit_for_bit_and_the_tier_is_removed_at_the_end(
        tmp_path, reference, caplog, monkeypatch) -> None:
    from areal_lightning.write import dcp_format
    from areal_lightning.write.direct import Signatures

    answered = []  # per write: whether its layout signature came from the check of the last one's
    names = []  # per write: its flat dict's keys
    monkeypatch.setattr(dcp_format, "_BULK", 1)  # this model's 10 tensors taken whole, as a model's 16 or more are
    signature = Signatures.__call__
    monkeypatch.setattr(Signatures, "__call__",
                        lambda self, flat, *a, **k: (checks := self.checks, names.append(list(flat)),
                                                     signature(self, flat, *a, **k),
                                                     answered.append(self.checks > checks))[2])
    first = run(tmp_path, crash=7)  # shared tier: step 4; memory tier: steps 5 and 6
    assert answered == [False] + [True] * 5  # Lightning's state dicts: new tensors alike at every save
    # and new key strings at every save: the model's paths are the first save's (flatten's memo)
    model = [i for i, name in enumerate(names[0]) if name.startswith("state_dict.")]
    assert len(model) > 5 and all(len(later) == len(names[0]) and all(later[i] is names[0][i] for i in model)
                                  for later in names[1:])
    assert seals(tmp_path) == {0: 5, 1: 6} or seals(tmp_path) == {0: 6, 1: 5}
    [report] = inspect_path(tmp_path, verify=True, memory_root=str(tmp_path / "shm"))
    assert report["memory"][0]["ranks"] == {"rank0": [5, 6]} and report["memory"][0]["newest_complete_step"] == 6
    assert report["memory"][0]["checksum"] == "ok"
    load = LastRead(monkeypatch)
    passes = []  # a spy: the CRC32C passes over a slot before a load (the real function runs)
    check = memory_tier.verify_mapped
    monkeypatch.setattr(memory_tier, "verify_mapped", lambda *a, **k: passes.append(a) or check(*a, **k))
    with caplog.at_level(logging.INFO, logger="areal_lightning"):
        second = run(tmp_path, watch=(load,))
    assert "resuming from the memory tier" in caplog.text
    assert "after global step 5 " in caplog.text  # step_info numbering: the 6th step
    # a replicated strategy: the slot was read once, by the load choose() ran, every item hashed
    # as it was read; no CRC32C pass over it before, no second read after
    assert passes == []
    said = re.search(r"this rank read its slot once, [\d.]+ MB, every item's CRC32C checked as read \((\d+) items, "
                     r"[\d.]+s hashing\), before the step was chosen", caplog.text)
    assert said, caplog.text[-2000:]
    assert load.read.nbytes > 0 and load.read.verified == int(said.group(1)) > 10
    assert load.alive == [False]  # handed to Lightning once, not kept after the restore (a model's worth of RAM)
    assert min(second.losses) == 7  # at most one step (the 7th) trained twice
    assert {**first.losses, **second.losses} == reference
    assert not tier(tmp_path).exists()  # fit ended normally: the tier's folders are gone


@pytest.mark.parametrize("damaged", ["newest", "both"])
def test_a_flipped_byte_falls_back_to_the_older_slot_then_to_the_shared_tier(tmp_path, reference, caplog,
                                                                              damaged) -> None:
    first = run(tmp_path, crash=7)
    flip_a_byte(slot_of(tmp_path, 6))
    [report] = inspect_path(tmp_path, verify=True, memory_root=str(tmp_path / "shm"))
    assert "rank 0:" in report["memory"][0]["checksum"] and "CRC32C" in report["memory"][0]["checksum"]
    if damaged == "both":
        (slot_of(tmp_path, 5) / COMMIT_MARKER).write_bytes(b"not a pickle")
    with caplog.at_level(logging.INFO, logger="areal_lightning"):
        second = run(tmp_path)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage() and "memory tier" in r.getMessage()]
    assert len(skipped) == 1, caplog.text  # one line names every step skipped and why
    assert "step 6: rank 0:" in skipped[0] and "CRC32C" in skipped[0]
    if damaged == "newest":
        assert "resuming from its step 5" in skipped[0]
        assert "resuming from the memory tier" in caplog.text and min(second.losses) == 6
    else:
        assert "step 5: rank 0:" in skipped[0] and "using the shared tier" in skipped[0]
        assert "resuming from the shared tier" in caplog.text and min(second.losses) == 5
    assert {**first.losses, **second.losses} == reference


@pytest.mark.parametrize("signal_name, node_lost", [("SIGTERM", False), ("SIGUSR1", True)])
def test_a_preempted_run_persists_its_newest_slot_to_the_shared_tier_and_exits_75(
        tmp_path, reference, caplog, signal_name, node_lost) -> None:
    """A preemption signal at step 7 (the shared tier due every 4 steps, the memory tier every
    step): step 7's slot is copied into the shared tier before the run exits 75; the same command
    resumes at step 8, from the memory tier, or on another node (the tier gone) from the shared
    tier; bit for bit."""
    import signal

    options = dict(preempt_signals=["SIGTERM", "SIGUSR1"])
    with caplog.at_level(logging.INFO, logger="areal_lightning"):
        first = run(tmp_path, signal_at=(7, getattr(signal, signal_name)), **options)
    assert first.exit_code == 75
    assert f"{signal_name}: the recover checkpoint of global step 7 is durable" in caplog.text
    assert re.search(r"copied [0-9.]+ MB of its memory-tier slot \d", caplog.text), caplog.text
    info = tmp_path / "checkpoints" / "u" / "e" / "t" / "recover_info"
    assert json.loads((info / "step_info.json").read_text())["global_step"] == 6  # 0-based: step 7
    assert seals(tmp_path) and max(seals(tmp_path).values()) == 7
    if node_lost:
        shutil.rmtree(tmp_path / "shm")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="areal_lightning"):
        second = run(tmp_path, **options)
    assert f"resuming from the {'shared' if node_lost else 'memory'} tier" in caplog.text
    assert min(second.losses) == 8 and max(first.losses) == 7  # nothing trained twice
    assert {**first.losses, **second.losses} == reference


def test_a_fresh_start_after_deleting_recover_info_does_not_take_the_old_slots(tmp_path, reference, caplog) -> None:
    run(tmp_path, crash=7)
    shutil.rmtree(tmp_path / "checkpoints" / "u" / "e" / "t" / "recover_info")  # the documented fresh start
    with caplog.at_level(logging.INFO, logger="areal_lightning"):
        second = run(tmp_path)
    assert "whose recover_info is gone (deleted: a fresh start)" in caplog.text
    assert "the shared tier has no checkpoint either: starting from the beginning" in caplog.text
    assert second.losses == reference  # from step 1


def test_before_the_first_shared_save_the_memory_tier_alone_resumes(tmp_path, reference) -> None:
    first = run(tmp_path, crash=3, freq_steps=None)  # no shared tier at all
    second = run(tmp_path, freq_steps=None)
    assert min(second.losses) == 3 and {**first.losses, **second.losses} == reference


def test_with_a_bucket_as_fileroot_the_tier_resumes_and_without_it_the_bucket(tmp_path, s3_root, reference,
                                                                              caplog) -> None:
    """An ``s3://`` fileroot (moto): the shared tier's saves are uploaded from the slots (no second
    staging of the model), the memory tier on local tmpfs."""
    with caplog.at_level(logging.INFO, logger="areal_lightning"):
        first = run(tmp_path, crash=7, fileroot=s3_root)
    uploads = re.findall(r"copied [\d.]+ MB of its memory-tier slot \d+ into the shared tier's (\S+) in", caplog.text)
    assert len(uploads) == 1 and uploads[0].startswith(s3_root), caplog.text[-3000:]  # step 4's save
    caplog.clear()
    second = run(tmp_path, crash=9, fileroot=s3_root)  # resumes from the tier (step 6)
    shutil.rmtree(tmp_path / "shm")  # the node and its tier lost: the bucket's step 8
    with caplog.at_level(logging.INFO, logger="areal_lightning"):
        third = run(tmp_path, fileroot=s3_root)
    assert min(second.losses) == 7 and min(third.losses) == 9
    assert "resuming from the shared tier, s3://" in caplog.text
    assert {**first.losses, **second.losses, **third.losses} == reference


def test_too_little_space_is_refused_with_the_numbers_before_training(tmp_path) -> None:
    net = Net()
    recover = RecoverCallback(fileroot=str(tmp_path), **WHERE, memory={"root": str(tmp_path / "shm"),
                                                                      "slots": 10 ** 9})
    with pytest.raises(MemorySpaceError, match=r"needs .* GB: 1 rank\(s\) on this node x 1000000000 slots") as err:
        make_trainer([recover]).fit(net, loader())
    assert "recover.memory.slots" in str(err.value) and "df -h" in str(err.value)
    assert net.losses == {}  # refused before the first step
    assert not list((tmp_path / "shm").rglob(MEMORY_SEAL))


@pytest.mark.parametrize("memory, field", [
    ({"slots": 1}, "memory.slots"),
    ({"replicas": 2}, "memory.replicas"),
    ({"freq_steps": 0}, "memory.freq_steps"),
    ({"root": "s3://bucket/x"}, "memory.root"),
    ({"size": 3}, "memory.size"),
    ("yes", "memory"),
])
def test_bad_memory_settings_name_the_field_and_the_allowed_values(tmp_path, memory, field) -> None:
    with pytest.raises(ConfigError) as err:
        RecoverCallback(fileroot=str(tmp_path), **WHERE, memory=memory)
    assert err.value.field == field


def test_the_yaml_section_turns_the_tier_on_and_its_errors_name_the_yaml_path(tmp_path) -> None:
    cfg = {"fileroot": str(tmp_path), **{k: v for k, v in WHERE.items()},
           "recover": {"mode": "on", "memory": {"enabled": True, "slots": 3}}}
    recover = RecoverCallback.from_config(cfg)
    assert recover.config.memory.enabled and recover.config.memory.slots == 3
    assert recover.config.memory.freq_steps == 1 and recover.config.memory.replicas == 0
    assert not RecoverCallback.from_config({**cfg, "recover": {"mode": "on"}}).config.memory.enabled
    with pytest.raises(ConfigError) as err:
        RecoverCallback.from_config({**cfg, "recover": {"mode": "on", "memory": {"replicas": 3}}})
    assert err.value.field == "recover.memory.replicas"


SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_recover.py"


@pytest.mark.slow
def test_on_ddp_a_flipped_byte_in_one_ranks_slot_fails_its_load_and_every_rank_falls_back_together(
        tmp_path, tmp_path_factory) -> None:
    """DDP on 2 ranks, SIGKILL at step 7, one byte flipped in rank 1's slot of step 6. A replicated
    strategy loads each candidate step while choosing it, hashing every item as it reads it (no
    CRC32C pass before): rank 1's load fails, rank 0's succeeds, and both ranks take step 5 from
    their older slots, with one log line naming rank 1 and the check; losses bit for bit."""
    from tests.harness.losses import step_losses

    def command(root: str, *extra: str) -> list[str]:
        return [sys.executable, str(SCRIPT), "--root", root, "--losses", f"{root}/losses", "--devices", "2",
                "--strategy", "ddp", "--epochs", "2", *extra]

    ref_root, ref = reference_run(tmp_path_factory, command("{root}"), timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = subprocess.run(command(str(tmp_path), "--memory", "--kill-at-step", "7"), capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode != 0
    rank1 = tier_folder(str(tmp_path / "memory"), "u", "exp", "t", "default") / "rank1"
    [newest] = [seal.parent for seal in rank1.glob(f"slot*/{MEMORY_SEAL}")
                if json.loads(seal.read_text())["global_step"] == 6]
    flip_a_byte(newest)
    rerun = subprocess.run(command(str(tmp_path), "--memory"), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    skipped = [line for line in rerun.stderr.splitlines() if "memory tier" in line and "skipped" in line]
    assert len(skipped) == 1 and "step 6: rank 1:" in skipped[0] and "CRC32C" in skipped[0], rerun.stderr[-3000:]
    assert "rank 0:" not in skipped[0] and "resuming from its step 5" in skipped[0]
    assert rerun.stderr.count("resuming from the memory tier") == 2 and "after global step 4 " in rerun.stderr
    assert len(re.findall(r"read its slot once, [\d.]+ MB, every item's CRC32C checked", rerun.stderr)) == 2
    for rank in range(2):
        assert step_losses(tmp_path / f"losses.rank{rank}") == step_losses(f"{ref_root}/losses.rank{rank}")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, devices, memory_lost", [("fsdp2", 2, False), ("fsdp1", 2, True),
                                                            ("ddp", 4, False)])
def test_sharded_strategies_resume_from_the_tier_and_from_the_shared_tier_copied_from_it(
        tmp_path, tmp_path_factory, strategy, devices, memory_lost) -> None:
    """FSDP2 / FSDP1 on 2 ranks (each rank's slot holds its shards), DDP on 4, SIGKILL of every
    rank at step 7: the rerun resumes from the memory tier (step 6; rank 0's skeleton broadcast
    to the others), or, with the tier deleted (a node lost, no replica), from the shared tier's
    step 5, which was copied from the slots (the chunks of every rank merged); every rank's
    losses are the uninterrupted run's, bit for bit."""
    from tests.harness.losses import step_losses

    def command(root: str, *extra: str) -> list[str]:
        return [sys.executable, str(SCRIPT), "--root", root, "--losses", f"{root}/losses", "--devices", str(devices),
                "--strategy", strategy, "--epochs", str(12 // (48 // devices // 4)), *extra]  # 12 steps a rank

    ref_root, ref = reference_run(tmp_path_factory, command("{root}"), timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = subprocess.run(command(str(tmp_path), "--memory", "--kill-at-step", "7"), capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode != 0
    if memory_lost:
        shutil.rmtree(tmp_path / "memory")
    else:  # convert reads the tier's newest step, every rank's shards merged into full tensors
        from areal_lightning import convert

        tier_dir = tier_folder(str(tmp_path / "memory"), "u", "exp", "t", "default")
        merged = torch.load(convert(tier_dir, "lightning", tmp_path / "tier.ckpt"), weights_only=True)
        shared = torch.load(convert(tmp_path, "lightning", tmp_path / "shared.ckpt"), weights_only=True)
        assert merged["global_step"] == 6 and shared["global_step"] == 5
        assert {k: v.shape for k, v in merged["state_dict"].items()} == \
            {k: v.shape for k, v in shared["state_dict"].items()}
        assert not all(torch.equal(merged["state_dict"][k], v) for k, v in shared["state_dict"].items())
    rerun = subprocess.run(command(str(tmp_path), "--memory"), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    tier, step = ("shared", 4) if memory_lost else ("memory", 5)
    assert rerun.stderr.count(f"resuming from the {tier} tier") == devices, rerun.stderr[-3000:]
    assert f"after global step {step} " in rerun.stderr
    if tier == "memory" and strategy == "ddp":  # loaded into new tensors: each rank's view read once, all hashed
        once = re.findall(r"read its slot once, [\d.]+ MB, every item's CRC32C checked as read \([1-9]\d* items",
                          rerun.stderr)
        assert len(once) == devices, rerun.stderr[-3000:]
    elif tier == "memory":  # loaded into the live shards: its own slot checked before the choice; what rank 0
        # sent (its skeleton, at least) hashed as read
        received = re.findall(r"then read [\d.]+ MB, [1-9]\d* items received from rank 0 hashed as read", rerun.stderr)
        assert len(received) == devices - 1, rerun.stderr[-3000:]
    for rank in range(devices):
        want, got = step_losses(f"{ref_root}/losses.rank{rank}"), step_losses(tmp_path / f"losses.rank{rank}")
        assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_upload_the_shared_tier_from_their_slots_to_a_bucket(tmp_path, tmp_path_factory, s3_server,
                                                                      s3_root, strategy) -> None:
    """2 ranks (DDP; FSDP2: each rank's slot holds its shards), an ``s3://`` fileroot (moto), the
    shared tier every 3 steps uploaded by every rank from its slot: SIGKILL at step 7, the tier
    deleted (the node lost): the rerun resumes from the bucket's step 6, whose objects are every
    rank's slot bytes, and every rank's losses are the uninterrupted local run's, bit for bit."""
    from tests.harness.losses import step_losses

    def command(root: str, *extra: str) -> list[str]:
        return [sys.executable, str(SCRIPT), "--root", root, "--losses", f"{root}/losses", "--devices", "2",
                "--strategy", strategy, "--epochs", "2", "--freq-steps", "3", *extra]

    ref_root, ref = reference_run(tmp_path_factory, command("{root}"), timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    lease = ("--lock-lease-s", "2")  # the killed run's trial lease on the bucket: taken over 2 s after the kill
    killed = subprocess.run(command(str(tmp_path), "--memory", "--fileroot", s3_root, *lease, "--kill-at-step", "7"),
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode != 0
    uploads = re.findall(r"rank (\d) copied [\d.]+ MB of its memory-tier slot \d+ into the shared tier's (\S+) in",
                         killed.stderr)
    assert {rank for rank, _ in uploads} == {"0", "1"} and all(uri.startswith(s3_root) for _, uri in uploads), \
        killed.stderr[-3000:]
    shutil.rmtree(tmp_path / "memory")
    rerun = subprocess.run(command(str(tmp_path), "--memory", "--fileroot", s3_root, *lease), capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert rerun.stderr.count(f"resuming from the shared tier, {s3_root}") == 2, rerun.stderr[-3000:]
    assert "after global step 5 " in rerun.stderr
    for rank in range(2):
        assert step_losses(tmp_path / f"losses.rank{rank}") == step_losses(f"{ref_root}/losses.rank{rank}")


def two_nodes(root: Path, *args: str, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Two ``torchrun`` agents of 2 processes each (static rendezvous on 127.0.0.1: node ranks 0
    and 1), global ranks 0-3 training into ``root``; node n's memory tier in ``{root}/memory/node{n}``."""
    from tests.harness.launch import free_port

    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--max-restarts", "0", str(SCRIPT), "--root", str(root), "--losses", str(root / "losses"),
               "--devices", "2", "--num-nodes", "2", "--epochs", "3", "--freq-steps", "3", *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=Path(__file__).resolve().parents[1], env={**os.environ, **(env or {})}))
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 0])
def test_a_lost_node_gets_its_ranks_state_back_from_the_peer_copies(tmp_path, tmp_path_factory, replicas) -> None:
    """2 nodes x 2 ranks (two torchrun agents on this machine, each node its own tier folder), the
    memory tier every step, the shared tier every 3 steps. With ``replicas=1`` every process is
    SIGKILLed in the middle of the peer copy of step 4 and node 1's tier folder deleted (its tmpfs
    gone with the node): the rerun gives ranks 2 and 3 their slots of step 3 (the newest every
    peer held) back from ranks 0 and 1 and every rank resumes from the memory tier. With
    ``replicas=0``, killed after step 5: it falls back to the shared tier's step 3 and says why.
    Every rank's losses equal an uninterrupted 4-rank run's."""
    from tests.harness.losses import step_losses

    ref_root, ref = reference_run(tmp_path_factory, [sys.executable, str(SCRIPT), "--root", "{root}", "--losses",
                                                     "{root}/losses", "--devices", "4", "--epochs", "3",
                                                     "--freq-steps", "3"], timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    memory = ("--memory", "--replicas", str(replicas))
    if replicas:  # SIGKILL of every process in the middle of the peer copy of step 4
        killed = two_nodes(tmp_path, *memory, env={"AREAL_LIGHTNING_FAULT": "memory.mid_replica:kill@4"})
    else:  # SIGKILL of every process after step 5
        killed = two_nodes(tmp_path, *memory, "--kill-at-step", "5")
    assert all(p.returncode != 0 for p in killed)
    if replicas:
        assert list((tmp_path / "memory" / "node0").rglob("replica_of_rank2/slot*/SEALED.json"))
    shutil.rmtree(tmp_path / "memory" / "node1")
    reruns = two_nodes(tmp_path, *memory)
    assert all(p.returncode == 0 for p in reruns), reruns[1].stderr[-4000:]
    logs = reruns[0].stderr + reruns[1].stderr
    if replicas:  # step 3: the newest step every rank's peer held (the copy of 4 was cut off)
        steps = re.findall(r"resuming from the memory tier, \S+ after global step (\d+) ", logs)
        assert steps == ["2"] * 4, logs[-4000:]
        assert logs.count("restored from the peer copy held by rank") == 2, logs[-4000:]
    else:
        assert "step 4: not sealed by rank(s) 2, 3 (nor a peer copy)" in logs and "using the shared tier" in logs
        steps = re.findall(r"resuming from the shared tier, \S+ after global step (\d+) ", logs)
        assert steps == ["2"] * 4, logs[-4000:]
    for rank in range(4):
        assert step_losses(tmp_path / f"losses.rank{rank}") == step_losses(f"{ref_root}/losses.rank{rank}")


@pytest.mark.parametrize("closure", [False, True])
def test_an_optimizer_step_waits_for_the_slot_sealed_in_the_background(tmp_path, closure) -> None:
    """With a seal still pending in the background (held here until released), a plain torch
    optimizer step (as a manual-optimisation step that bypasses Lightning's hooks) waits for it
    through the step pre-hook the session registers, then steps. Given a closure (what
    Lightning's automatic optimisation passes: the forward and backward run in it), the closure
    runs first, with the seal still pending, and the wait comes after it, before the update."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from areal_lightning.commit.memory_tier import MemoryTier
    from areal_lightning.config import MemoryConfig
    from areal_lightning.lightning.recover_session import RecoverSession

    tier = MemoryTier(MemoryConfig(enabled=True).validate(), tmp_path / "tier", 0)
    released = threading.Event()
    notes: list[dict] = []
    with ThreadPoolExecutor(1) as pool:
        tier._sealing = pool.submit(released.wait, 30)  # what write() leaves while the slot is sealed
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session = object.__new__(RecoverSession)  # only the glue under test: the optimizers and the hooks
        session.trainer, session._step_hooks = SimpleNamespace(optimizers=[optimizer], global_step=1), {}
        session.memory, session.telemetry = tier, SimpleNamespace(note=lambda step, metrics: notes.append(metrics))
        session._wait_before_optimizer_steps(tier)
        session._wait_before_optimizer_steps(tier)  # once per optimizer
        assert len(optimizer._optimizer_step_pre_hooks) == 1
        before = model.weight.detach().clone()
        threading.Timer(0.3, released.set).start()
        if closure:
            pending_in_closure = []

            def forward_backward() -> torch.Tensor:
                pending_in_closure.append(tier._sealing is not None)
                optimizer.zero_grad()
                loss = model(torch.ones(1, 2)).sum()
                loss.backward()
                return loss

            optimizer.step(forward_backward)
            assert pending_in_closure == [True]  # the forward and backward overlapped the seal
        else:
            model(torch.ones(1, 2)).sum().backward()
            optimizer.step()
    assert tier._sealing is None and tier.last_wait_s >= 0.1  # it waited for the seal, then stepped
    assert not torch.equal(model.weight, before)
    assert [n["checkpoint/memory/optimizer_wait_s"] for n in notes] == [tier.last_wait_s]


def test_a_seal_failing_in_the_background_on_one_rank_stops_every_rank_at_the_next_save(tmp_path, tmp_path_factory,
                                                                                       monkeypatch) -> None:
    """2 DDP ranks, both callbacks, the memory tier every step: rank 1's background seal of its
    3rd slot fails (a raise between ``.metadata`` and the seal). The next save raises it on both
    ranks (rank 0 naming rank 1), promptly, and nothing of that step is used: the shared save of
    step 3 copied from the slots is not committed, and the rerun resumes from the newest step
    both ranks sealed (2), from the memory tier, bit for bit."""
    from test_objectstore import _train_lm
    from test_objectstores import LM_SCRIPT, _reference

    from tests.harness.losses import rank_losses

    args = ("--strategy", "ddp", "--epochs", "1")
    reference = _reference(tmp_path_factory, LM_SCRIPT, *args)
    run = tmp_path / "run"
    monkeypatch.setenv("TEST_FAULT", "memory.before_seal@3")
    failed = _train_lm(run, *args, "--memory", "--fault-rank", "1", "--timeout", "60")
    monkeypatch.delenv("TEST_FAULT")
    assert failed.returncode != 0
    errors = {rank: (run / f"error.rank{rank}.txt").read_text() for rank in range(2)}
    assert "memory tier" in errors[1] and "InjectedFault" in errors[1], errors[1][:2000]
    assert "failed on rank 1" in errors[0].splitlines()[0] and "InjectedFault" in errors[0], errors[0][:2000]
    assert not (run / "checkpoints/u/exp/t/default/recover_info").exists()  # step 3's shared save: not committed
    for path in run.glob("error.rank*.txt"):
        path.unlink()
    resumed = _train_lm(run, *args, "--memory")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert resumed.stderr.count("resuming from the memory tier") == 2, resumed.stderr[-4000:]
    assert "skipped step 3: not sealed by rank(s) 1" in resumed.stderr, resumed.stderr[-4000:]
    assert len(re.findall(r"memory tier, \S+ after global step 1 ", resumed.stderr)) == 2  # 2 steps trained
    assert rank_losses(run, 2) == rank_losses(reference, 2)


@pytest.mark.parametrize("fused", [True, False], ids=["one-pass", "copy-then-checksum"])
def test_a_slot_holds_every_kind_of_tensor_bit_for_bit_and_changes_between_saves(tmp_path, monkeypatch,
                                                                                 fused) -> None:
    """The slot copy of :mod:`areal_lightning.write.slot`, in all its paths, read back by the
    loader a resume uses: small tensors in groups copied by one call (typed views of the slot),
    an item of a group its dtype cannot view at its offset (copied on its own), non-contiguous
    and grad-requiring sources, a 0-dim step, an empty tensor, a tensor of several chunks; then
    a second save of changed values into the same layout (what every step after the first does).
    Both ways of copying: the compiled one-pass copy and checksum, and the fallback."""
    from areal_lightning.commit.memory_tier import MemoryTier, verify_slot
    from areal_lightning.write import slot

    assert slot.FUSED or not fused, "the compiled _crc32c_copy is not built (see test_slot_copy.py)"
    monkeypatch.setattr(slot, "FUSED", fused)
    from areal_lightning.config import MemoryConfig
    from areal_lightning.write.dcp import DCPEngine

    gen = torch.Generator().manual_seed(3)

    def state(shift: int) -> dict[str, Any]:
        weights = {f"w{i}": torch.randn(3, 5, generator=gen) + shift for i in range(40)}  # groups, aligned
        return {"state_dict": {
            "flag": torch.tensor([True, False, shift % 2 == 0]),  # 3 bytes: what follows is misaligned
            "half": torch.randn(7, generator=gen).to(torch.bfloat16),
            "after": torch.arange(5, dtype=torch.float32) + shift,  # in that group: one by one
            **weights,
            "param": torch.randn(4, 4, generator=gen).requires_grad_(),
            "transposed": (torch.arange(12, dtype=torch.int64).reshape(3, 4) * (shift + 1)).t(),
            "step": torch.tensor(float(shift)),
            "empty": torch.empty(0, 3),
            "big": torch.randn(700_000, generator=gen),  # 2.8 MB: its own unit, three chunks
            "complex": torch.randn(6, dtype=torch.complex64, generator=gen),
        }, "step": shift}

    tier = MemoryTier(MemoryConfig(enabled=True, root=str(tmp_path / "shm")).validate(), tmp_path / "tier", 0)
    engine = DCPEngine()
    try:
        for shift in (1, 2):
            saved = state(shift)
            tier.write(saved, global_step=shift, world_size=1, lineage=None, info={})
            tier.wait()
            [seal] = [s for s in tier.held() if s.global_step == shift]
            assert verify_slot(seal)[0] is None
            template = {"state_dict": {k: torch.zeros_like(v.detach(), memory_format=torch.contiguous_format)
                                       for k, v in saved["state_dict"].items()}}
            loaded = engine.load(seal.path, template=template)
            for key, value in saved["state_dict"].items():
                got = loaded["state_dict"][key]
                assert got.dtype == value.dtype and torch.equal(got, value.detach()), key
            assert loaded["step"] == shift
        shares = [share for file in tier._files.values() for share in file._split([], 2)[0]]
        if fused:
            assert all(isinstance(part, slot._Pass) for share in shares for part in share)
        else:
            units = [unit for share in shares for unit in share]
            assert any(len(unit.typed) > 1 for unit in units)  # a group copied in one call
            assert any(unit.loose and unit.typed for unit in units)  # an item of a group its dtype cannot view
    finally:
        engine.close()
        tier.close()


def _with(change: str, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``values`` with the tensor ``w5`` changed in one property, its key kept."""
    out = dict(values)
    w = out["w5"]
    out["w5"] = {"same": lambda: w.clone(), "shape": lambda: w.reshape(5, 3), "dtype": lambda: w.view(torch.int32),
                 "requires_grad": lambda: w.clone().requires_grad_(), "strides": lambda: w.t().contiguous().t(),
                 "negated view": lambda: torch._neg_view(w), "conjugated view": lambda: w.to(torch.complex64).conj(),
                 "parameter": lambda: torch.nn.Parameter(w.clone()),
                 "added": lambda: w.clone()}[change]()
    if change == "added":
        out["w41"] = torch.ones(2)
    return out


@pytest.mark.parametrize("change", ["same", "shape", "dtype", "requires_grad", "strides", "negated view",
                                    "conjugated view", "parameter", "added"])
def test_a_save_whose_tensors_change_a_property_under_the_same_keys_is_written_as_they_are_now(
        tmp_path, change) -> None:
    """Each save's layout signature is taken from the last save's while its keys are the same
    and one check in C++ finds each tensor alike (:class:`~areal_lightning.write.direct.Signatures`);
    a tensor that changed any property the layout records or that decides how it is written
    (shape, dtype, ``requires_grad``, strides, a lazy negation or conjugation, its type)
    gets the layout its save needs: every slot reads back as what was saved, with the
    shapes, dtypes and ``requires_grad`` of ``.metadata`` those of the tensors, and a save with
    nothing changed took its signature from the check (the copy took each address without a
    look at each tensor)."""
    from torch.distributed.checkpoint import FileSystemReader

    from areal_lightning.commit.memory_tier import MemoryTier, verify_slot
    from areal_lightning.config import MemoryConfig
    from areal_lightning.write import slot
    from areal_lightning.write.dcp import DCPEngine

    gen = torch.Generator().manual_seed(5)
    base = {f"w{i}": torch.randn(3, 5, generator=gen) for i in range(40)}
    states = [base, _with(change, base), base, _with(change, base)]
    plain_copies: list[bool] = []
    copy = slot._Pass.copy

    def spy(self: Any, flat: Any, values: Any = None) -> None:
        if flat is not None:
            plain_copies.append(values is not None)
        copy(self, flat, values)

    tier = MemoryTier(MemoryConfig(enabled=True, root=str(tmp_path / "shm"), slots=3).validate(),
                      tmp_path / "tier", 0)
    engine = DCPEngine()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(slot._Pass, "copy", spy)
            for step, values in enumerate(states, 1):
                checks = tier._signatures.checks
                plain_copies.clear()
                tier.write({"state_dict": values, "step": step}, global_step=step, world_size=1, lineage=None, info={})
                tier.wait()
                [seal] = [s for s in tier.held() if s.global_step == step]
                assert verify_slot(seal)[0] is None
                recorded = FileSystemReader(str(seal.path)).read_metadata().state_dict_metadata
                template = {"state_dict": {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in values.items()}}
                loaded = engine.load(seal.path, template=template)
                for key, value in values.items():
                    meta = recorded[f"state_dict.{key}"]
                    assert (tuple(meta.size), meta.properties.dtype) == (tuple(value.shape), value.dtype), (step, key)
                    assert meta.properties.requires_grad == value.requires_grad, (step, key)
                    got = loaded["state_dict"][key]
                    assert got.dtype == value.dtype and torch.equal(got.resolve_conj().resolve_neg(),
                                                                    value.detach().resolve_conj().resolve_neg()), key
                changed = step % 2 == 0 and change != "same"
                taken_from_check = tier._signatures.checks > checks
                # the first save computes it; after that, a save alike the last one takes it from the check
                assert taken_from_check == (step > 1 and not changed and not (step == 3 and change != "same")), step
                if step > 1 and change == "same":
                    assert plain_copies and all(plain_copies), step
    finally:
        engine.close()
        tier.close()


@pytest.mark.parametrize("when", ["after", "first"], ids=["a-save-like-the-last", "the-first-save"])
@pytest.mark.parametrize("size", [16, 40_000], ids=["small", "large"])
@pytest.mark.parametrize("fused", [True, False], ids=["one-pass", "copy-then-checksum"])
def test_a_tensor_whose_storage_was_freed_is_refused_naming_it_not_saved_as_stale_bytes(tmp_path, monkeypatch, fused,
                                                                                          size, when) -> None:
    """A tensor whose data was freed (``untyped_storage().resize_(0)``, how FSDP frees a
    parameter) keeps its shape and strides, so it passes the check a save like the last one
    takes its layout from; its address is 0. Its save is refused with an error that names it,
    never sealed with what the slot held before (or with the slot's zeros), and never a crash
    (a copy from no storage crashes the process: the test's worker would die); the next save
    of a whole state is sealed. Small tensors (grouped) and large ones (each its own unit)."""
    from areal_lightning.commit.memory_tier import MemoryTier, verify_slot
    from areal_lightning.config import MemoryConfig
    from areal_lightning.errors import CheckpointWriteError
    from areal_lightning.write import slot

    assert slot.FUSED or not fused, "the compiled _crc32c_copy is not built (see test_slot_copy.py)"
    monkeypatch.setattr(slot, "FUSED", fused)

    def state(freed: bool) -> dict[str, Any]:
        weights = {f"w{i}": torch.full((size,), float(i)) for i in range(20)}
        if freed:
            weights["w7"].untyped_storage().resize_(0)  # its data freed (as FSDP frees a parameter's)
        return {"state_dict": weights, "step": 1}

    tier = MemoryTier(MemoryConfig(enabled=True, root=str(tmp_path / "shm"), slots=2).validate(), tmp_path / "tier", 0)
    saves = ((1, False), (2, True), (3, False), (4, True)) if when == "after" else ((1, True), (2, False))
    try:
        for step, freed in saves:
            if freed:
                with pytest.raises(CheckpointWriteError, match=r"'state_dict\.w7' has no storage"):
                    tier.write(state(freed), global_step=step, world_size=1, lineage=None, info={})
                tier.wait()
                continue
            tier.write(state(freed), global_step=step, world_size=1, lineage=None, info={})
            tier.wait()
            [seal] = [s for s in tier.held() if s.global_step == step]
            assert verify_slot(seal)[0] is None
        held = sorted(s.global_step for s in tier.held())
        assert held[-1] == saves[-1][0] - (1 if when == "after" else 0) and not set(held) & {s for s, f in saves if f}
    finally:
        tier.close()


@pytest.mark.parametrize("first", [True, False], ids=["the-first-save", "after-saves-outside"])
@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_save_inside_a_function_transform_is_an_error_not_an_abort(tmp_path, transform, first) -> None:
    """Inside ``torch.func.vmap`` or ``grad`` a tensor is a wrapper with no storage, yet of type
    ``torch.Tensor``, on the CPU and contiguous. Its save raises torch's error (no data pointer);
    the process goes on, and the next save outside the transform is sealed. (A tensor without
    storage given to torch's exported data_ptr function throws a C++ exception through the
    one-pass extension: the process aborts, and with it this test's worker.)"""
    from areal_lightning.commit.memory_tier import MemoryTier, verify_slot
    from areal_lightning.config import MemoryConfig

    tier = MemoryTier(MemoryConfig(enabled=True, root=str(tmp_path / "shm"), slots=2).validate(), tmp_path / "tier", 0)
    step = 0

    def save(x: torch.Tensor) -> torch.Tensor:
        nonlocal step
        step += 1
        weights = {f"w{i}": x * i for i in range(20)}
        tier.write({"state_dict": weights, "step": step}, global_step=step, world_size=1, lineage=None, info={})
        tier.wait()
        return x.sum()

    try:
        if not first:
            for _ in range(2):
                save(torch.ones(4))
        with pytest.raises(RuntimeError, match="storage"):
            if transform == "vmap":
                torch.func.vmap(save)(torch.ones(3, 4))
            else:
                torch.func.grad(save)(torch.ones(4))
        save(torch.ones(4))
        [seal] = [s for s in tier.held() if s.global_step == step]
        assert verify_slot(seal)[0] is None
    finally:
        tier.close()


@pytest.mark.parametrize("fused", [True, False], ids=["one-pass", "copy-then-checksum"])
def test_with_device_tensors_the_host_ones_are_copied_and_the_device_ones_checksummed_once_landed(
        tmp_path, monkeypatch, fused) -> None:
    """The CUDA path's split of a slot's items, on CPU: the host tensors' units are copied at the
    save point, the device tensors' (here copied by hand, as the DMA would) only checksummed by
    :class:`PendingCopy` -- small ones in groups, spread over the threads; every item's bytes
    and CRC32C then verify, and the split is made once per set of device tensors."""
    from concurrent.futures import ThreadPoolExecutor

    from areal_lightning.commit.manifest import verify_mapped
    from areal_lightning.write.checksum import Written, crc32c, item_checksum
    from areal_lightning.write.dcp_format import SKELETON_KEY, flatten
    from areal_lightning.write.direct import ByteLayout, signature, skeleton_bytes
    from areal_lightning.write import slot
    from areal_lightning.write.slot import PendingCopy, SlotFile, _copy_share, _fused_copy, _run_shares

    assert slot.FUSED or not fused, "the compiled _crc32c_copy is not built (see test_slot_copy.py)"
    monkeypatch.setattr(slot, "FUSED", fused)
    gen = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(100 + i, generator=gen) for i in range(60)}
    state["big"] = torch.randn(300_000, generator=gen)
    flat = flatten({"state_dict": state})
    skeleton = skeleton_bytes(flat.pop(SKELETON_KEY))
    file = SlotFile(tmp_path / "slot", ByteLayout(signature(flat, pinned=False), 1))
    items = file._items
    device = [entry for i, entry in enumerate(items) if i % 2 == 0 or entry[0].nbytes > 1 << 20]
    with ThreadPoolExecutor(1) as pool:
        host_shares, device_shares = file._split(device, 2)
        assert file._split(list(device), 2)[1] is device_shares  # made once
        if fused:
            copied = {key for share in host_shares for part in share for key in part.keys}
            landed = {key for share in device_shares for part in share for key in part.keys}
        else:
            copied = {e[0].key for share in host_shares for u in share for e in u.entries}
            landed = {e[0].key for share in device_shares for u in share for e in u.entries}
            assert any(len(u.entries) > 1 for share in device_shares for u in share)  # grouped
        assert copied.isdisjoint(landed) and copied | landed == {e[0].key for e in items}
        assert len(device_shares) == 2  # spread over the threads
        _run_shares(_fused_copy if fused else _copy_share, host_shares, pool, flat, False)
        for item, view, _address, _mapped in device:  # the "DMA"
            view.copy_(flat[item.key].reshape(-1).view(torch.uint8))
        PendingCopy(None, device_shares, True, True, host_shares if fused else None).wait(pool)
    file.finish(skeleton, Written())
    assert verify_mapped(tmp_path / "slot", "damaged") > 0
    raw = (tmp_path / "slot" / "__0_0.distcp").read_bytes()
    for item, _view, _address, _mapped in items:
        data = raw[item.offset:item.offset + item.nbytes]
        assert data == flat[item.key].numpy().tobytes(), item.key
        assert item_checksum(item.info) == crc32c(data), item.key  # the CRC32C .metadata records
    file.close()
