"""Async saves written by a checkpoint process (``async_executor="process"``).

Real child processes: the one the engine starts, failures injected in it through the fault
points (``raise`` and ``kill``, counted in the child), a save that needs a plan written by the
thread executor instead. Through a Trainer: tests/test_matrix.py (``async-process-executor``,
and a SIGKILL of the training process with the checkpoint process alive).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from areal_lightning import DCPCheckpointIO, RecoverCallback
from areal_lightning.errors import CheckpointWriteError, ConfigError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.write.dcp import DCPEngine
from areal_lightning.write.dcp_format import SKELETON_KEY


def _state(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"state_dict": {"big": torch.randn(700, 400, generator=gen), "w": torch.randn(9, 3, generator=gen),
                           "bf16": torch.randn(4, generator=gen).to(torch.bfloat16), "empty": torch.zeros(0)},
            "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}}, "step": step, "name": "run"}


def _equal(loaded: dict, expected: dict) -> None:
    for key, tensor in expected["state_dict"].items():
        got = loaded["state_dict"][key]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
    assert loaded["optimizer"]["state"][0]["step"].item() == expected["step"]
    assert loaded["step"] == expected["step"] and loaded["name"] == "run"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_the_checkpoint_process_writes_what_the_thread_writes_and_ends_with_the_engine(tmp_path: Path) -> None:
    by_process, by_thread = DCPEngine(async_executor="process"), DCPEngine()
    pids = set()
    for step in range(3):
        state = _state(step)
        for engine, name in ((by_process, "p"), (by_thread, "t")):
            engine.save(state, tmp_path / f"{name}{step}", asynchronous=True)
            engine.wait()
        pids.add(by_process._process.pid)
        _equal(by_process.load(tmp_path / f"p{step}"), state)
        ours, theirs = (FileSystemReader(tmp_path / f"{n}{step}").read_metadata() for n in "pt")
        assert ours.state_dict_metadata == theirs.state_dict_metadata
        assert by_process.last_written.items == len(ours.storage_data)
        assert set(by_process.last_written.files) == {COMMIT_MARKER, *{i.relative_path for i in ours.storage_data.values()}}
    (pid,) = pids  # one checkpoint process for every save
    assert pid != os.getpid() and _alive(pid)
    by_process.close()
    by_thread.close()
    assert not _alive(pid)


@pytest.mark.parametrize("action", ["raise", "kill"])
def test_a_failure_in_the_checkpoint_process_fails_that_save_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  action: str) -> None:
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", f"engine.before_commit:{action}@2")  # the child's 2nd save
    engine = DCPEngine(async_executor="process")
    engine.save(_state(0), tmp_path / "c0", asynchronous=True)
    engine.wait()
    first = engine._process.pid
    engine.save(_state(1), tmp_path / "c1", asynchronous=True)
    expected = "InjectedFault" if action == "raise" else "the checkpoint process died"
    with pytest.raises(CheckpointWriteError, match=str(tmp_path / "c1")) as info:
        engine.wait()
    assert expected in str(info.value)
    assert not (tmp_path / "c1" / COMMIT_MARKER).exists()
    engine.save(_state(2), tmp_path / "c2", asynchronous=True)  # a new child after a kill (its own count)
    engine.wait()
    assert (engine._process.pid == first) == (action == "raise")
    _equal(engine.load(tmp_path / "c2"), _state(2))
    engine.close()


def test_a_save_that_needs_a_plan_is_written_by_the_thread(tmp_path: Path) -> None:
    engine = DCPEngine(async_executor="process")
    state = {**_state(1), "p": torch.nn.Parameter(torch.randn(6))}  # a tensor subclass: DCP plans it
    engine.save(state, tmp_path / "c", asynchronous=True)
    engine.wait()
    assert engine._process is None or engine._process.pid is None  # no checkpoint process started
    loaded = engine.load(tmp_path / "c")
    _equal(loaded, state)
    assert torch.equal(loaded["p"], state["p"])
    assert SKELETON_KEY not in loaded
    engine.close()


def test_an_unknown_executor_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"async_executor.*'fork'.*thread, process"):
        DCPCheckpointIO("async", async_executor="fork")
    with pytest.raises(ConfigError, match=r"async_executor.*'processes'.*thread, process"):
        RecoverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", mode="on", freq_steps=1,
                        async_executor="processes")
    with pytest.raises(ConfigError, match=r"async_executor: unknown executor 'pool'; allowed: thread, process"):
        DCPEngine(async_executor="pool")
