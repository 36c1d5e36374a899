"""DCPCheckpointIO inside real Lightning runs (CPU, tiny model, a few steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from areal_lightning.errors import ConfigError, CheckpointCorruptError, CheckpointWriteError
from areal_lightning.layout import CHECKPOINT_INFO, COMMIT_MARKER
from areal_lightning.lightning.checkpoint_io import DCPCheckpointIO, StagingWaitCallback

STEPS_PER_EPOCH = 3


class TinyModule(LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(STEPS_PER_EPOCH * 4, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4, shuffle=False)


class CountingCallback(Callback):
    """A callback with state, to check callback state round-trips."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "by_step": {self.batches: "int key"}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


class OptimizerProbe(Callback):
    """Records the optimizer state right after Lightning restored it."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        opt = trainer.optimizers[0]
        self.moments = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(pl_module.parameters())}
        self.lr = opt.param_groups[0]["lr"]


def _trainer(io: DCPCheckpointIO, max_epochs: int, callbacks: list[Callback], root: Path) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        plugins=[io],
        callbacks=callbacks,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_round_trips_everything_and_continues_identically(tmp_path: Path, mode: str) -> None:
    # Run A: uninterrupted, 3 epochs, checkpointing each epoch through the plugin (async
    # saves overlap the next steps: the checkpoint must still hold the state of its step).
    seed_everything(0)
    model_a = TinyModule()
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    io_a = DCPCheckpointIO(mode=mode)
    counter_a = CountingCallback()
    _trainer(io_a, 3, [ckpt_cb, counter_a, StagingWaitCallback()], tmp_path).fit(model_a)
    assert io_a.resolved_mode == mode
    first = tmp_path / "ckpts" / "epoch=0.ckpt"
    assert (first / COMMIT_MARKER).is_file() and list(first.glob("__0_*.distcp"))

    ckpt = DCPCheckpointIO().load_checkpoint(first, weights_only=False)
    assert ckpt["global_step"] == STEPS_PER_EPOCH and ckpt["epoch"] == 0
    assert ckpt["hyper_parameters"]["lr"] == 0.05
    fit_loop = ckpt["loops"]["fit_loop"]
    assert fit_loop["epoch_progress"]["total"]["processed"] == 1
    assert fit_loop["epoch_loop.batch_progress"]["total"]["completed"] == STEPS_PER_EPOCH
    assert fit_loop["state_dict"] == {}  # empty containers survive (DCP's flattening drops them)
    state = ckpt["optimizer_states"][0]["state"]
    assert set(state) == {0, 1, 2, 3}
    assert all(state[i]["exp_avg"].abs().sum() > 0 and state[i]["exp_avg_sq"].abs().sum() > 0 for i in state)
    assert ckpt["lr_schedulers"][0]["last_epoch"] == STEPS_PER_EPOCH
    assert ckpt["callbacks"]["CountingCallback"] == {"batches": STEPS_PER_EPOCH, "by_step": {STEPS_PER_EPOCH: "int key"}}

    # Run B: fresh process state, resume from the epoch-0 checkpoint.
    seed_everything(123)
    model_b = TinyModule()
    counter_b, probe = CountingCallback(), OptimizerProbe()
    _trainer(DCPCheckpointIO(mode=mode), 3, [counter_b, probe, StagingWaitCallback()], tmp_path / "b").fit(
        model_b, ckpt_path=first
    )

    for i in range(4):
        assert torch.equal(probe.moments[i]["exp_avg"], state[i]["exp_avg"])
        assert torch.equal(probe.moments[i]["exp_avg_sq"], state[i]["exp_avg_sq"])
    assert probe.lr == pytest.approx(0.05 * 0.5)  # StepLR restored (3 steps, step_size 2)
    assert counter_b.batches == 3 * STEPS_PER_EPOCH
    assert len(model_b.losses) == 2 * STEPS_PER_EPOCH
    for resumed, uninterrupted in zip(model_b.losses, model_a.losses[STEPS_PER_EPOCH:]):
        assert torch.equal(resumed, uninterrupted)
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)


def test_save_checkpoint_and_load_after_fit(tmp_path: Path) -> None:
    seed_everything(0)
    model = TinyModule()
    io = DCPCheckpointIO(mode="async")
    trainer = _trainer(io, 1, [], tmp_path)
    trainer.fit(model)
    trainer.save_checkpoint(tmp_path / "manual.ckpt")  # no staging callback: waits for staging itself
    io.wait()
    loaded = io.load_checkpoint(tmp_path / "manual.ckpt", weights_only=False)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["state_dict"][key], value)
    trainer.strategy.remove_checkpoint(tmp_path / "manual.ckpt")
    assert not (tmp_path / "manual.ckpt").exists()
    io.teardown()


def test_background_failure_surfaces_inside_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "engine.before_commit")
    seed_everything(0)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = _trainer(DCPCheckpointIO(mode="async"), 2, [ckpt_cb, StagingWaitCallback()], tmp_path)
    with pytest.raises(CheckpointWriteError, match=r"epoch=0\.ckpt.*InjectedFault"):
        trainer.fit(TinyModule())


def test_background_failure_surfaces_at_teardown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "engine.before_commit")
    seed_everything(0)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path / "ckpts", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = _trainer(DCPCheckpointIO(mode="async"), 1, [ckpt_cb, StagingWaitCallback()], tmp_path)
    with pytest.raises(CheckpointWriteError, match=r"epoch=0\.ckpt.*InjectedFault"):
        trainer.fit(TinyModule())  # the only save fails in the background; teardown reports it


def test_resume_from_uncommitted_directory_is_refused(tmp_path: Path) -> None:
    seed_everything(0)
    io = DCPCheckpointIO(mode="sync")
    trainer = _trainer(io, 1, [], tmp_path)
    trainer.fit(TinyModule())
    trainer.save_checkpoint(tmp_path / "partial.ckpt")
    (tmp_path / "partial.ckpt" / COMMIT_MARKER).unlink()
    with pytest.raises(CheckpointCorruptError, match=r"partial\.ckpt has no \.metadata commit marker"):
        _trainer(DCPCheckpointIO(), 2, [], tmp_path).fit(TinyModule(), ckpt_path=tmp_path / "partial.ckpt")


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match=r"mode='fast'.*auto, sync, async"):
        DCPCheckpointIO(mode="fast")
    io = DCPCheckpointIO()
    assert io.mode == "auto" and io.resolved_mode == "async"
    with pytest.raises(ConfigError, match="storage_options: expected a mapping"):
        io.save_checkpoint({}, "unused", storage_options=["endpoint_url"])
    with pytest.raises(TypeError, match="map_location"):
        io.load_checkpoint("unused", map_location=lambda storage, loc: storage)



def _state(value: float) -> dict:
    return {"state_dict": {"w": torch.full((4,), value)}, "epoch": 0}


def test_a_folder_that_is_not_a_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    io = DCPCheckpointIO("sync")
    with pytest.raises(FileExistsError, match=r"results: it is a folder that is not a DCP checkpoint"):
        io.save_checkpoint(_state(1.0), folder)
    assert (folder / "notes.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    (tmp_path / "empty").mkdir()  # an empty folder holds nothing to lose
    io.save_checkpoint(_state(1.0), tmp_path / "empty")
    assert torch.equal(io.load_checkpoint(tmp_path / "empty")["state_dict"]["w"], torch.ones(4))


def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_nothing_behind(tmp_path: Path, monkeypatch) -> None:
    io = DCPCheckpointIO("sync")
    io.save_checkpoint(_state(1.0), tmp_path / "ckpt")
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "engine.before_commit")
    with pytest.raises(CheckpointWriteError, match="InjectedFault"):
        io.save_checkpoint(_state(2.0), tmp_path / "ckpt")
    monkeypatch.delenv("AREAL_LIGHTNING_FAULT")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert torch.equal(io.load_checkpoint(tmp_path / "ckpt")["state_dict"]["w"], torch.ones(4))


def test_leftovers_of_an_interrupted_save_go_with_the_next_save_to_that_path(tmp_path: Path) -> None:
    from areal_lightning.write.dcp import DCPEngine

    DCPEngine().save(_state(9.0), tmp_path / ".tmp-ckpt-0123456789ab")  # a save killed before its rename
    (tmp_path / ".tmp-ckpt-v1-0123456789ab").mkdir()  # another path's: kept
    DCPCheckpointIO("sync").save_checkpoint(_state(1.0), tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-ckpt-v1-0123456789ab", "ckpt"]


@pytest.mark.parametrize("new_written", [True, False])
def test_a_crash_between_the_two_renames_is_rolled_forward_at_load(tmp_path: Path, new_written: bool) -> None:
    """The old checkpoint was moved to .old-, the new one not yet renamed into place: the
    load finds the new one (or, when it is gone, the old one back)."""
    from areal_lightning.write.dcp import DCPEngine

    DCPEngine().save(_state(1.0), tmp_path / ".old-ckpt-0123456789ab")
    if new_written:
        DCPEngine().save(_state(2.0), tmp_path / ".tmp-ckpt-0123456789ab")
    loaded = DCPCheckpointIO("sync").load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(loaded["state_dict"]["w"], torch.full((4,), 2.0 if new_written else 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_missing_checkpoint_is_not_found_and_its_unrelated_siblings_are_left_alone(tmp_path: Path) -> None:
    """No checkpoint at the path and no interrupted commit of it, but other folders beside it (another
    checkpoint, its leftovers, a user's files): the load raises FileNotFoundError naming the path, and
    nothing beside it is renamed or removed."""
    from areal_lightning.write.dcp import DCPEngine

    DCPEngine().save(_state(1.0), tmp_path / "other")
    DCPEngine().save(_state(2.0), tmp_path / ".old-other-0123456789ab")  # another checkpoint's leftover
    (tmp_path / "notes.txt").write_text("mine")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(FileNotFoundError, match="ckpt"):
        DCPCheckpointIO("sync").load_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


class OptionsIO(TorchCheckpointIO):
    """A user's CheckpointIO that takes options (a stand-in for a cloud or a custom store's IO)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append((Path(path).name, storage_options))
        super().save_checkpoint(checkpoint, path)


def test_a_users_checkpoint_io_gets_its_storage_options_with_recover_enabled(tmp_path: Path) -> None:
    """RecoverCallback writes its own checkpoints through its private DCPCheckpointIO; the user's
    ``trainer.save_checkpoint(path, storage_options=...)`` reaches the user's CheckpointIO with
    those options, and writes the user's format (one file)."""
    from areal_lightning import RecoverCallback

    user_io = OptionsIO()
    recover = RecoverCallback(fileroot=tmp_path / "ckpt", experiment_name="e", trial_name="t", user="u",
                              freq_steps=2)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=4, plugins=[user_io], callbacks=[recover],
                      default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(TinyModule())
    trainer.save_checkpoint(tmp_path / "mine.ckpt", storage_options={"region": "here"})
    assert user_io.calls == [("mine.ckpt", {"region": "here"})]
    assert (tmp_path / "mine.ckpt").is_file() and torch.load(tmp_path / "mine.ckpt", weights_only=False)["global_step"] == 4
    assert recover.store.read_info()[CHECKPOINT_INFO]["global_step"] == 4
