"""Trigger: when ``RecoverCallback`` saves.

There is one save point per optimizer step: after everything Lightning runs for the step
(every callback's and the module's batch-end hooks, the logger connector, the validation due
after it, the LR schedulers) and, at an epoch's last step, after the epoch's end as well (every
``on_train_epoch_end``, the epoch-interval schedulers, the epoch metrics). :class:`SaveSchedule`
decides at that point whether to save: a preemption signal (on any rank), the step, seconds or
epoch trigger.
"""

from __future__ import annotations

from enum import Enum

from areal_lightning.collective import CheckpointGroup
from areal_lightning.trigger.freq import FreqController
from areal_lightning.trigger.gate import StepGate
from areal_lightning.trigger.preempt import PreemptionWatch

__all__ = ["SaveSchedule", "Save", "SavePoint"]


class SavePoint(str, Enum):
    """Where a save is taken: after everything Lightning runs for a step that is not its epoch's
    last (``STEP_END``), or after the epoch's end as well (``EPOCH_END``). The value is what a
    recover checkpoint stores (``save_point``)."""

    STEP_END = "step_end"
    EPOCH_END = "epoch_end"


class Save(Enum):
    """What the save point does."""

    NONE = "none"
    TRIGGER = "trigger"  # a step, seconds or epoch trigger fired
    PREEMPT = "preempt"  # save, wait until durable, stop with the preemption exit code


class SaveSchedule:
    """The decision at each save point; collective in multi-rank runs (every rank calls it at
    the same points, with the same arguments).

    Example:
        >>> schedule = SaveSchedule(FreqController(freq_steps=2, freq_epochs=1), PreemptionWatch(()))
        >>> schedule.freq.start()
        >>> [schedule.after_step(s).value for s in (1, 2, 3)], schedule.after_epoch(4, 1).value
        (['none', 'trigger', 'none'], 'trigger')
    """

    def __init__(self, freq: FreqController, preempt: PreemptionWatch) -> None:
        self.freq = freq
        self.gate = StepGate(freq)
        self.preempt = preempt

    def after_step(self, global_step: int, ranks: CheckpointGroup | None = None) -> Save:
        """After a batch that is not the epoch loop's last: save? (Nothing for the batches
        that accumulate gradients without an optimizer step.)"""
        if not self.gate.new_step(global_step):
            return Save.NONE
        if self.preempt.agreed(ranks):
            return Save.PREEMPT
        return Save.TRIGGER if self.gate.due(global_step, ranks, "seconds trigger") else Save.NONE

    def after_epoch(self, global_step: int, epochs_done: int, ranks: CheckpointGroup | None = None) -> Save:
        """After an epoch's end (its last step's save point): save?"""
        new_step = self.gate.new_step(global_step)
        if self.preempt.agreed(ranks):
            return Save.PREEMPT
        if new_step and self.gate.due(global_step, ranks, "seconds trigger"):
            return Save.TRIGGER
        return Save.TRIGGER if self.gate.at_epoch_end(epochs_done, global_step) else Save.NONE
