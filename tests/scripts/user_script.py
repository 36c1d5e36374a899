"""A training script as a Lightning user writes it, with ``RecoverCallback`` added.

Lightning's defaults (the TensorBoard logger under ``lightning_logs/``, the default
``ModelCheckpoint``), a DataModule with validation, dropout, an LR scheduler, and either

* ``python user_script.py plain ROOT [--checkpoints default|monitor] [--csv-version V]``: a
  ``Trainer`` built in the script, or
* ``python user_script.py fit --config cfg.yaml ...``: ``LightningCLI`` (the callbacks come
  from the YAML's ``trainer.callbacks``, by ``class_path``).

The namespace is ``$AREAL_NAMESPACE`` (``lightning.pytorch`` or ``pytorch_lightning``).
``$AREAL_LOSSES`` (a file) receives ``{"step": s, "loss": hex}`` lines as they happen;
``$AREAL_KILL_AT=N``: at the end of global step N the process waits until the last recover
checkpoint is durable and SIGKILLs itself. At the end, ``result.json`` (in the working
directory) holds each ``ModelCheckpoint``'s ``best_model_path`` and ``last_model_path``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, Dataset

pl = importlib.import_module(os.environ.get("AREAL_NAMESPACE", "lightning.pytorch"))
importlib.import_module(pl.__name__ + ".cli")
importlib.import_module(pl.__name__ + ".callbacks")
importlib.import_module(pl.__name__ + ".loggers")

from areal_lightning import RecoverCallback  # noqa: E402

FEATURES = 6


class Regression(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, FEATURES, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class DataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.train, self.val = Regression(48, 1), Regression(16, 2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size)


class Model(pl.LightningModule):
    def __init__(self, lr: float = 0.01, hidden: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        step = self.trainer.global_step
        path = os.environ.get("AREAL_LOSSES")
        if path and self.trainer.is_global_zero:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "loss": outputs["loss"].item().hex()}) + "\n")
        if step == int(os.environ.get("AREAL_KILL_AT", "-1")):
            for cb in self.trainer.callbacks:
                if isinstance(cb, RecoverCallback):
                    cb.wait()
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)}


def plain(root: str, checkpoints: str = "default", csv_version: str | None = None) -> None:
    pl.seed_everything(0)
    callbacks: list = [RecoverCallback(fileroot=os.path.join(root, "ckpt"), experiment_name="user",
                                       trial_name="t0", freq_steps=5)]
    if checkpoints == "monitor":
        ModelCheckpoint = pl.callbacks.ModelCheckpoint
        callbacks += [ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True),
                      ModelCheckpoint(every_n_train_steps=4, save_top_k=-1, filename="{step}")]
    logger: object = True  # Lightning's default: TensorBoard under default_root_dir/lightning_logs
    if csv_version is not None:
        logger = [pl.loggers.TensorBoardLogger(root), pl.loggers.CSVLogger(root, version=csv_version)]
    trainer = pl.Trainer(default_root_dir=root, max_epochs=3, log_every_n_steps=1, callbacks=callbacks,
                         logger=logger, accelerator="cpu", devices=1, enable_progress_bar=False)
    trainer.fit(Model(), datamodule=DataModule())
    write_result(trainer)


def write_result(trainer) -> None:
    """Each ModelCheckpoint's best and last file (relative to the working directory) in result.json."""
    found = [{"best": os.path.relpath(cb.best_model_path) if cb.best_model_path else None,
              "last": os.path.relpath(cb.last_model_path) if cb.last_model_path else None}
             for cb in trainer.checkpoint_callbacks]
    with open("result.json", "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    if sys.argv[1] == "plain":
        args = sys.argv[2:]
        opts = dict(zip(args[1::2], args[2::2]))
        plain(args[0], opts.get("--checkpoints", "default"), opts.get("--csv-version"))
    else:
        write_result(pl.cli.LightningCLI(Model, DataModule).trainer)
