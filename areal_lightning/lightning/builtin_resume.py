"""Lightning's ``StochasticWeightAveraging`` across a resume into the middle of an epoch.

SWA builds its ``SWALR`` scheduler (swapped in for the user's) and restores a saved scheduler
state in ``on_train_epoch_start``. Lightning does not run that hook again when it resumes in
the middle of an epoch, so the rest of the epoch would train with the user's scheduler and
without SWA's. The resume runs the hook of each SWA callback that had started before the
checkpoint, at train start; the hook is safe to run again: its parameter update is guarded by
``latest_update_epoch``, which the checkpoint restores (at an epoch boundary Lightning's own
call of the next epoch's hook does the same).
"""

from __future__ import annotations

from typing import Any

from areal_lightning.namespaces import classes

__all__ = ["started_swa", "resume_swa"]


def started_swa(trainer: Any, checkpoint: dict[str, Any]) -> list[Any]:
    """The Trainer's SWA callbacks whose saved state holds a scheduler (SWA had started)."""
    saved = checkpoint.get("callbacks", {})
    return [cb for cb in trainer.callbacks if isinstance(cb, classes("callbacks.StochasticWeightAveraging"))
            and (saved.get(cb.state_key) or {}).get("scheduler_state") is not None]


def resume_swa(trainer: Any, pl_module: Any, callbacks: list[Any]) -> None:
    """At train start of a mid-epoch resume: start each SWA callback of :func:`started_swa` again."""
    for cb in callbacks:
        cb.on_train_epoch_start(trainer, pl_module)
