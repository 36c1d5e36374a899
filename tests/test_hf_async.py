"""Async HF export: bitwise equal to sync, failures surface, auto mode follows the CheckpointIO."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from areal_lightning import CheckpointWriteError, DCPCheckpointIO, HFSaverCallback
from areal_lightning._fault import ENV_VAR
from tests.conftest import LMModule, make_trainer, tiny_gpt2, tiny_llama, token_loader


def run(root: Path, mode: str, arch: str, tokenizer, **kwargs) -> HFSaverCallback:
    cb = HFSaverCallback(fileroot=root, experiment_name="e", trial_name="t", user="u", mode=mode,
                         freq_steps=3, freq_epochs=1, **kwargs)
    model = tiny_llama() if arch == "llama" else tiny_gpt2()
    make_trainer([cb], max_epochs=2).fit(LMModule(model, tokenizer=tokenizer), token_loader(n_batches=5))
    return cb


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("arch", ["llama", "gpt2_tied"])
def test_async_export_is_bitwise_equal_to_sync(tmp_path, tokenizer, arch) -> None:
    sync = run(tmp_path / "sync", "sync", arch, tokenizer, max_shard_size=30_000)
    asyn = run(tmp_path / "async", "async", arch, tokenizer, max_shard_size=30_000)
    assert sync.resolved_mode == "sync" and asyn.resolved_mode == "async"
    sync_tree, async_tree = tree_bytes(sync.model_dir), tree_bytes(asyn.model_dir)
    assert sorted({k.split("/")[0] for k in sync_tree}) == [  # steps 3, 5 (epoch end), 6, 9, 10 (epoch end)
        "epoch0epochstep2globalstep2", "epoch0epochstep4globalstep4", "epoch1epochstep0globalstep5",
        "epoch1epochstep3globalstep8", "epoch1epochstep4globalstep9"]
    assert any(k.endswith("model.safetensors.index.json") for k in sync_tree)
    assert sync_tree.keys() == async_tree.keys()
    for key in sync_tree:
        assert sync_tree[key] == async_tree[key], key


def test_async_write_runs_in_the_background_and_its_failure_surfaces_at_the_next_save(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, "hf.after_weights")
    cb = HFSaverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", mode="async", freq_steps=2)
    module = LMModule(tiny_llama())
    with pytest.raises(CheckpointWriteError, match="epoch0epochstep1globalstep1") as info:
        make_trainer([cb], max_epochs=1).fit(module, token_loader(n_batches=6))
    assert "InjectedFault" in str(info.value)
    assert len(module.losses) == 4  # steps 3 and 4 ran while the first export was being written
    assert list(cb.model_dir.iterdir()) == []  # no final folder, no temp folder


def test_async_failure_of_the_last_export_surfaces_at_fit_end(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_VAR, "hf.before_publish")
    cb = HFSaverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", mode="async", freq_epochs=1)
    module = LMModule(tiny_llama())
    with pytest.raises(CheckpointWriteError, match="epoch0epochstep2globalstep2"):
        make_trainer([cb], max_epochs=1).fit(module, token_loader(n_batches=3))
    assert len(module.losses) == 3
    assert list(cb.model_dir.iterdir()) == []


def test_training_crash_waits_for_the_export_in_flight(tmp_path) -> None:
    class Crash(Exception):
        pass

    class CrashAfter(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 3:
                raise Crash

    cb = HFSaverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", mode="async", freq_steps=2)
    with pytest.raises(Crash):
        make_trainer([cb, CrashAfter()], max_epochs=1).fit(LMModule(tiny_llama()), token_loader(n_batches=6))
    assert [p.name for p in cb.model_dir.iterdir()] == ["epoch0epochstep1globalstep1"]
    assert not [t for t in threading.enumerate() if t.name.startswith("areal-hf-")]


def test_auto_is_async_with_dcp_checkpoint_io_and_sync_without(tmp_path) -> None:
    kwargs = dict(experiment_name="e", trial_name="t", freq_epochs=1)
    plain = HFSaverCallback(fileroot=tmp_path / "a", **kwargs)
    make_trainer([plain], max_epochs=1).fit(LMModule(tiny_llama()), token_loader(n_batches=2))
    assert plain.resolved_mode == "sync"
    dcp = HFSaverCallback(fileroot=tmp_path / "b", **kwargs)
    make_trainer([dcp], max_epochs=1, plugins=[DCPCheckpointIO()]).fit(LMModule(tiny_llama()), token_loader(n_batches=2))
    assert dcp.resolved_mode == "async"
    assert [p.name for p in dcp.model_dir.iterdir()] == ["epoch0epochstep1globalstep1"]
