"""A write that fails mid-save (file size limit = a full disk, EFBIG): the error surfaces
with the path, the previous committed recover checkpoint stays loadable, and resuming from
it is exact."""

from __future__ import annotations

import json

import pytest

from tests.test_recover_e2e import assert_exact, losses_by_step, reference, train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_disk_full_during_a_save(tmp_path, tmp_path_factory, mode) -> None:
    args = ("--io-mode", mode, "--logger", "none")
    want = reference(tmp_path_factory, args)
    losses = tmp_path / "losses.jsonl"
    # Saves after steps 5 and 10 succeed; from step 12 on no file may exceed 4 KiB, so the
    # save after step 15 fails while writing its shard files.
    failed = train(tmp_path, losses, *args, "--disk-full-at-step", "12")
    assert failed.returncode != 0
    assert "CheckpointWriteError" in failed.stderr and ".tmp-recover_checkpoint-15-" in failed.stderr
    assert "File too large" in failed.stderr or "EFBIG" in failed.stderr or "errno 27" in failed.stderr.lower()
    # sync: the error stops training at the failing save; async: at the next save (step 20)
    assert max(losses_by_step(losses)) == (15 if mode == "sync" else 20)
    info = tmp_path / "checkpoints" / "u" / "exp" / "t" / "recover_info"
    assert json.loads((info / "step_info.json").read_text())["global_step"] == 9  # after step 10
    resumed = train(tmp_path, losses, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and "after global step 9" in resumed.stderr
    assert_exact(losses_by_step(losses), want)
