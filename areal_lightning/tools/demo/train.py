"""Training one run of the demo (in this process, or in a worker process): the loss log, the
pause used by the kill demonstration, the Trainer with both callbacks."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.utils.data import DataLoader

from areal_lightning.config import (
    load_config,
)
from areal_lightning.tools.losses import append_line, loss_value

if TYPE_CHECKING:
    import lightning.pytorch as pl
from areal_lightning.tools.demo.config import DemoConfig, PAUSE_ENV
from areal_lightning.tools.demo.model import AdditionDataset, _tiny_causal_lm_class, build_tokenizer


def _loss_file(path: Path) -> Any:
    """A Lightning callback writing the per-step losses to ``path`` (see ``_LossFile``)."""
    import lightning.pytorch as pl

    from areal_lightning.lightning import RecoverCallback

    class _LossFile(pl.Callback):
        """Appends one JSON line per optimizer step (``{"step", "loss": float.hex(), "epoch", "batch"}``)
        plus ``start`` / ``resumed`` / ``end`` events to ``path``, each line with one ``write`` (a
        SIGKILL never leaves half a line). It runs before ``RecoverCallback`` saves the step."""

        def __init__(self, path: Path) -> None:
            self.path = Path(path)
            self._first = True

        def _write(self, row: dict[str, Any]) -> None:
            append_line(self.path, row)  # the loss log of areal_lightning.tools.losses

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.is_global_zero:
                self._write({"event": "start", "pid": os.getpid(), "t": time.time()})

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if not trainer.is_global_zero:
                return
            if self._first:
                self._first = False
                recover = next((c for c in trainer.callbacks if isinstance(c, RecoverCallback)), None)
                step = recover.resumed_from if recover is not None else None
                if step is not None:  # 0-based indices of the last step in the checkpoint
                    self._write({"event": "resumed", "global_step": step.global_step, "epoch": step.epoch,
                                 "epoch_step": step.epoch_step})
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None:
                self._write({"step": trainer.global_step, "loss": loss_value(loss.detach().float()),
                             "epoch": trainer.current_epoch, "batch": batch_idx, "t": time.time()})

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.is_global_zero:
                self._write({"event": "end", "global_step": trainer.global_step, "t": time.time()})

    return _LossFile(path)


def _pause_at(step: int) -> Any:
    """A Lightning callback that stops this process (SIGSTOP) right after optimizer step ``step``
    (from 1), or the first step after it, at which a recover checkpoint is durable: the
    handshake with the demo, which then SIGKILLs the stopped worker."""
    import lightning.pytorch as pl

    from areal_lightning.lightning import RecoverCallback

    class _PauseAt(pl.Callback):
        def __init__(self) -> None:
            self.paused = False

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self.paused or trainer.global_step < step:
                return
            recover = next(c for c in trainer.callbacks if isinstance(c, RecoverCallback))
            recover.wait()  # an async save in flight becomes durable first
            if recover.store.exists():
                self.paused = True
                os.kill(os.getpid(), signal.SIGSTOP)  # stays stopped until the demo's SIGKILL

    return _PauseAt()


def _fit(cfg: DemoConfig, extra_callbacks: Sequence[pl.Callback] = ()) -> tuple[pl.Trainer, list[pl.Callback]]:
    """Train the demo model with the callbacks of ``cfg`` (a rerun resumes from its recover checkpoint)."""
    import lightning.pytorch as pl

    from areal_lightning.lightning import callbacks_from_config

    t = cfg.train
    pl.seed_everything(t.seed, workers=True, verbose=False)
    tokenizer = build_tokenizer()
    data = AdditionDataset(tokenizer, t.num_samples, t.max_operand, t.seed)
    loader = DataLoader(data, batch_size=t.batch_size, shuffle=True)
    module = _tiny_causal_lm_class()(tokenizer, t, seq_len=data.seq_len)
    callbacks = callbacks_from_config(cfg, strict=False)
    trainer = pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        callbacks=[*extra_callbacks, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(module, loader)
    return trainer, callbacks


def worker_threads() -> int:
    """Intra-op threads of each worker: the reference and the killed run train side by side
    with the same count (half the CPUs this process may use, 1 to 4: the model is tiny)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(1, min(4, cpus // 2))


def _worker_main(argv: Sequence[str]) -> int:
    """``python -m areal_lightning.tools.demo --worker CONFIG.json --losses FILE``: one training run."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m areal_lightning.tools.demo",
                                     description="A worker of `areal-lightning demo` (one training run).")
    parser.add_argument("--worker", required=True, metavar="CONFIG", help="the demo config (JSON or YAML)")
    parser.add_argument("--losses", required=True, metavar="FILE", help="append the per-step losses here")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.worker, schema=DemoConfig)
    callbacks = [_loss_file(Path(args.losses))]
    if os.environ.get(PAUSE_ENV):
        callbacks.append(_pause_at(int(os.environ[PAUSE_ENV])))  # after the step's losses line
    _fit(cfg, callbacks)
    return 0
