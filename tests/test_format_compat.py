"""Checkpoints written by earlier releases still load: ``tests/fixtures/dcp_v0_1_0`` was written
by ``DCPEngine`` of commit 9e06027 (0.1.0, before the package moved into stage folders), whose
skeleton pickles its tensor slots as ``areal_lightning.engine._TensorSlot``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from areal_lightning import DCPCheckpointIO
from areal_lightning.write.dcp import DCPEngine

FIXTURE = Path(__file__).parent / "fixtures" / "dcp_v0_1_0"


def _check(state: dict) -> None:
    g = torch.Generator().manual_seed(0)
    assert torch.equal(state["state_dict"]["layer.weight"], torch.randn(3, 4, generator=g))
    assert torch.equal(state["state_dict"]["layer.bias"], torch.arange(3.0))
    opt = state["optimizer_states"][0]
    assert set(opt["state"]) == {0, 1} and opt["state"][1] == {}  # integer keys, empty containers
    assert torch.equal(opt["state"][0]["exp_avg"], torch.ones(3, 4)) and opt["state"][0]["step"].item() == 5.0
    assert opt["param_groups"] == [{"lr": 0.01, "params": [0, 1]}]
    assert state["loops"]["fit_loop"]["counts"] == (1, 2, 3) and state["empty"] == {}
    assert (state["epoch"], state["global_step"]) == (1, 8)


@pytest.mark.parametrize("weights_only", [None, True, False])
def test_a_checkpoint_of_release_0_1_0_loads(tmp_path: Path, weights_only) -> None:
    path = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, path)
    _check(DCPEngine().load(path, weights_only=weights_only))
    _check(DCPCheckpointIO("sync").load_checkpoint(path, weights_only=weights_only))
