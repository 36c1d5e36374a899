"""State a resume could not load is refused at the first save, not days later at the resume.

Lightning's DQN example (``examples/pytorch/domain_templates/reinforce_learn_Qnet.py``) keeps its
replay buffer in a ``collections.deque``; saved through ``on_save_checkpoint``, every recover save
would succeed and the resume, under the default ``weights_only=True``, would refuse it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from areal_lightning import ConfigError, RecoverCallback


class ReplayNet(pl.LightningModule):
    """A module with a replay buffer filled from the RNG at each step, saved in the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
        self.buffer: deque = deque(maxlen=6)
        self.keep_deque = True

    def training_step(self, batch, batch_idx):
        self.buffer.append((float(torch.rand(())), int(torch.randint(0, 4, ()))))
        bonus = sum(r for r, _ in self.buffer) / len(self.buffer)
        return self.net(batch[0]).pow(2).mean() * bonus

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["replay_buffer"] = self.buffer if self.keep_deque else list(self.buffer)
        checkpoint["stats"] = Stats(len(self.buffer), max(r for r, _ in self.buffer))

    def on_load_checkpoint(self, checkpoint):
        self.buffer = deque(checkpoint["replay_buffer"], maxlen=6)


class Crash(Exception):
    pass


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Crash(f"crash at step {self.step}")


@dataclass
class Stats:
    """A user type torch can rebuild under weights_only once allowlisted."""

    episodes: int
    best: float


def fit(root: Path, weights_only: bool, crash_at: int | None = None,
        keep_deque: bool = True) -> tuple[pl.Trainer, ReplayNet, RecoverCallback]:
    pl.seed_everything(0, verbose=False)
    module = ReplayNet()
    module.keep_deque = keep_deque
    rc = RecoverCallback(fileroot=root, experiment_name="dqn", trial_name="t", user="u", freq_steps=2,
                         weights_only=weights_only)
    callbacks: list = [rc] + ([CrashAt(crash_at)] if crash_at else [])
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    data = DataLoader(TensorDataset(torch.randn(24, 4, generator=torch.Generator().manual_seed(1))), batch_size=4,
                      shuffle=True)
    trainer.fit(module, data)
    return trainer, module, rc


def test_a_deque_is_refused_at_the_first_save_under_weights_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        fit(tmp_path, weights_only=True)
    message = str(info.value)
    for part in ("weights_only", "collections.deque", "checkpoint['replay_buffer']", "list(d) of a deque",
                 "torch.serialization.add_safe_globals([collections.deque])", "RecoverCallback(weights_only=False)",
                 "nothing was written"):
        assert part in message, (part, message)
    rc = RecoverCallback(fileroot=tmp_path, experiment_name="dqn", trial_name="t", user="u")
    assert rc.last_checkpoint() is None  # the first save (step 2) wrote nothing


def test_a_user_type_is_named_and_passes_once_allowlisted(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"holds a test_loadable_state.Stats at checkpoint\['stats'\].*"
                                          r"add_safe_globals\(\[test_loadable_state.Stats\]\)"):
        fit(tmp_path / "refused", weights_only=True, keep_deque=False)
    with torch.serialization.safe_globals([Stats]):
        trainer, _, rc = fit(tmp_path / "allowed", weights_only=True, keep_deque=False)
    assert trainer.global_step == 12 and rc.last_checkpoint() is not None


def test_a_deque_resumes_exactly_with_weights_only_false(tmp_path: Path) -> None:
    _, ref, _ = fit(tmp_path / "ref", weights_only=False)
    with pytest.raises(Crash):
        fit(tmp_path / "run", weights_only=False, crash_at=7)
    trainer, resumed, rc = fit(tmp_path / "run", weights_only=False)
    assert rc.resumed_from is not None and rc.resumed_from.global_step + 1 == 6
    assert list(resumed.buffer) == list(ref.buffer) and resumed.buffer.maxlen == 6
    for (name, a), b in zip(ref.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
