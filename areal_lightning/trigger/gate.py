"""Trigger: the step gating both callbacks share.

Lightning calls ``on_train_batch_end`` once per batch; with gradient accumulation several
batches end at the same optimizer step, and only the first of them may fire. The seconds
trigger reads each rank's own clock, so in a multi-rank run rank 0's decision is taken by
every rank (one small broadcast, only when a seconds trigger is configured).
"""

from __future__ import annotations

from areal_lightning.collective import CheckpointGroup
from areal_lightning.trigger.freq import FreqController

__all__ = ["StepGate"]

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

    def due(self, global_step: int, ranks: CheckpointGroup | None = None, what: str = "seconds trigger") -> bool:
        """After a new optimizer step: fire? With ``ranks``, a seconds trigger's decision is
        rank 0's on every rank (one small broadcast; nothing on one process)."""
        decision = self.freq.check_step(global_step)
        if self.freq.uses_clock and ranks is not None:
            decision = bool(ranks.agree(None, what, decision)[0])
        return decision

    def at_epoch_end(self, epochs_done: int, global_step: int) -> bool:
        """At the end of an epoch (``epochs_done`` complete epochs): fire?"""
        return self.freq.check_epoch(epochs_done, global_step)
