"""Trigger: the step gating both callbacks share.

Lightning calls ``on_train_batch_end`` once per batch; with gradient accumulation several
batches end at the same optimizer step, and only the first of them may fire. The seconds
trigger reads each rank's own clock, so in a multi-rank run rank 0's decision is taken by
every rank (one small broadcast, only when a seconds trigger is configured).
"""

from __future__ import annotations

from typing import Callable

from areal_lightning.trigger.freq import FreqController

__all__ = ["StepGate"]

Agree = Callable[[bool], bool]
"""Returns rank 0's decision to every rank (a collective)."""


class StepGate:
    """Decides, at each batch end and epoch end, whether a :class:`FreqController` fires.

    Example:
        >>> gate = StepGate(FreqController(freq_steps=2))
        >>> gate.freq.start()
        >>> [gate.new_step(s) and gate.due(s) for s in (1, 2, 2, 3, 4)]  # step 2 ends two batches
        [False, True, False, False, True]
    """

    def __init__(self, freq: FreqController) -> None:
        self.freq = freq
        self._last_seen_step = -1

    def new_step(self, global_step: int) -> bool:
        """At a batch end: did this batch make an optimizer step? (``False`` for the
        accumulation batches before one, and for the batches after the same step.)"""
        if global_step == self._last_seen_step:
            return False
        self._last_seen_step = global_step
        return True

    def due(self, global_step: int, agree: Agree | None = None) -> bool:
        """After a new optimizer step: fire? ``agree`` (multi-rank runs) makes the seconds
        trigger's decision rank 0's on every rank."""
        decision = self.freq.check_step(global_step)
        if self.freq.uses_clock and agree is not None:
            decision = bool(agree(decision))
        return decision

    def at_epoch_end(self, epochs_done: int, global_step: int) -> bool:
        """At the end of an epoch (``epochs_done`` complete epochs): fire?"""
        return self.freq.check_epoch(epochs_done, global_step)
