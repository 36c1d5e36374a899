"""Rank agreement pieces that need no second process: timeouts validated before training,
single-process behaviour of the agreement, the trial lock on a file system without flock.
(The multi-rank behaviour -- a failure on one rank raised on all, a dead rank ending the
others within the timeout, an unshared fileroot -- is proven on 2 real ranks in
tests/test_fsdp1.py.)"""

from __future__ import annotations

import errno
import fcntl
import logging

import pytest

from areal_lightning import HFSaverCallback, RecoverCallback
from areal_lightning.collective import CheckpointGroup, check_shared_storage
from areal_lightning.commit.recover_store import TrialLock
from areal_lightning.config import ConfigError


@pytest.mark.parametrize("bad", [0, -1, "60", True, None])
@pytest.mark.parametrize("cls", [RecoverCallback, HFSaverCallback])
def test_a_bad_collective_timeout_is_refused_naming_the_field(tmp_path, cls, bad) -> None:
    with pytest.raises(ConfigError, match=r"^collective_timeout: expected a positive number of seconds"):
        cls(fileroot=tmp_path, experiment_name="e", trial_name="t", collective_timeout=bad)
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_the_agreement_without_a_process_group_returns_or_raises_locally(tmp_path) -> None:
    ranks = CheckpointGroup(5)
    assert ranks.agree(None, "x", payload=7) == [7]
    with pytest.raises(KeyError, match="mine"):
        ranks.agree(KeyError("mine"), "x")
    assert ranks.share(None, "x", payload={"a": b"1"}) == {"a": b"1"}
    with pytest.raises(KeyError, match="mine"):
        ranks.share(KeyError("mine"), "x", payload=1)
    check_shared_storage(ranks, tmp_path / "trial", lead=True)  # one process: nothing to compare
    assert not (tmp_path / "trial").exists()


def test_configure_validates_the_timeout() -> None:
    ranks = CheckpointGroup(5)
    ranks.configure(30)
    assert ranks.timeout == 30
    with pytest.raises(ValueError, match="collective_timeout"):
        ranks.configure(0)


def test_a_file_system_without_flock_gets_a_warning_not_a_crash(tmp_path, monkeypatch, caplog) -> None:
    """Simulated: some NFS/FUSE mounts answer flock with ENOLCK (not reproducible on this
    machine's file systems, so flock itself is replaced for this one test)."""
    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING):
        TrialLock(tmp_path).acquire()
    assert "does not support flock" in caplog.text

    def other_error(fd: int, op: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fcntl, "flock", other_error)
    with pytest.raises(OSError, match="I/O error"):
        TrialLock(tmp_path).acquire()


def _threads() -> int:
    """Native threads of this process (a gloo group has worker and socket-loop threads of its own)."""
    import os

    return len(os.listdir("/proc/self/task"))


def test_close_ends_the_groups_threads_also_after_the_world_was_destroyed(tmp_path) -> None:
    """A gloo group's threads end only when the group object goes: one still held at interpreter
    exit is freed during finalization, where a worker that needs the GIL aborts the process.
    close() unregisters the groups and drops them (their threads are joined before it returns),
    also when the script destroyed the default group first (as torch recommends), and
    end_checkpoint_groups() (the exit hook) closes every group still held."""
    import torch.distributed as dist

    from areal_lightning.collective import end_checkpoint_groups

    before = _threads()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        base = _threads()  # with the default group's
        ranks = CheckpointGroup(30)
        ranks.agree(None, "x")  # one rank: no collective, no group
        assert not ranks.holds_groups and _threads() == base
        ranks.group, ranks.background_group, ranks.local_group
        assert ranks.holds_groups and _threads() > base
        ranks.close()
        assert not ranks.holds_groups and _threads() == base
        ranks.close()  # idempotent

        ranks.group  # made again on a later use
        others = CheckpointGroup(30)
        others.local_group
    finally:
        dist.destroy_process_group()  # the user's script ends the world; our groups are still held
    assert _threads() > before and ranks.holds_groups and others.holds_groups
    assert end_checkpoint_groups() == 2  # what the exit hook does
    assert _threads() == before and not ranks.holds_groups and not others.holds_groups
    assert end_checkpoint_groups() == 0
