"""The callbacks the training scripts of the tests share: a SIGKILL or a SIGTERM at the end of a
step, and a dump of the full model and optimizer state.

They derive from the ``Callback`` of the script's Lightning namespace (``$AREAL_NAMESPACE``:
``lightning.pytorch`` or ``pytorch_lightning``; a script sets it before importing this module).
"""

from __future__ import annotations

import importlib
import os
import signal
from typing import Any

import torch

pl = importlib.import_module(os.environ.get("AREAL_NAMESPACE", "lightning.pytorch"))


class KillAt(pl.Callback):
    """SIGKILL of this process at the end of the batch where ``global_step == step`` (before that
    step's saves: put it first). Under ``torchrun --max-restarts`` only the first attempt is killed.
    With ``settle`` (a ``RecoverCallback``), every rank first waits until the saves already in
    flight are durable (then a barrier), so that which shared checkpoint the rerun finds does not
    depend on the speed of a background copy."""

    def __init__(self, step: int, settle: Any = None) -> None:
        self.step, self.settle = step, settle

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            if self.settle is not None:
                self.settle.wait()
                trainer.strategy.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAt(pl.Callback):
    """SIGTERM to this process at the end of step ``step`` (a preemption notice), on rank ``rank``
    only (every rank if None); with ``marker`` (a file path) only once per trial: the marker is
    created first, and a rerun that finds it sends nothing."""

    def __init__(self, step: int, rank: int | None = None, marker: str | None = None) -> None:
        self.step, self.rank, self.marker = step, rank, marker

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.step or (self.rank is not None and trainer.global_rank != self.rank):
            return
        if self.marker is not None:
            if os.path.exists(self.marker):
                return
            open(self.marker, "w").close()
        os.kill(os.getpid(), signal.SIGTERM)


class DumpState(pl.Callback):
    """Rank 0 writes the full (gathered) model and optimizer state, keyed by parameter name
    (torch's ``get_state_dict``), after every ``every``-th step (``PREFIX.stepN.pt``) and right
    after a resume (``PREFIX.startN.pt``): a resharded resume must start from the saved state."""

    def __init__(self, prefix: str, every: int) -> None:
        self.prefix, self.every = prefix, every

    def _dump(self, trainer: Any, tag: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # the strategy's root module (FSDP1 wraps the LightningModule); no cpu_offload (FSDP1 on CPU)
        model, optim = get_state_dict(trainer.strategy.model, trainer.optimizers,
                                      options=StateDictOptions(full_state_dict=True))
        if trainer.is_global_zero:
            torch.save({"model": model, "optim": optim}, f"{self.prefix}.{tag}{trainer.global_step}.pt")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step > 0:
            self._dump(trainer, "start")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.every == 0:
            self._dump(trainer, "step")
