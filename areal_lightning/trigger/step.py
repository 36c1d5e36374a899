"""Trigger: where a checkpoint is taken, as 0-based indices of the last completed step."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """Where a checkpoint was taken: 0-based indices of the last completed optimizer step.

    Example:
        >>> StepInfo(epoch=0, epoch_step=99, global_step=99, steps_per_epoch=100).next()
        StepInfo(epoch=1, epoch_step=0, global_step=100, steps_per_epoch=100)
    """

    epoch: int
    epoch_step: int
    global_step: int
    steps_per_epoch: int | None

    def next(self) -> "StepInfo":
        """The step that training continues with."""
        end_of_epoch = self.steps_per_epoch is not None and self.epoch_step + 1 >= self.steps_per_epoch
        return StepInfo(
            epoch=self.epoch + 1 if end_of_epoch else self.epoch,
            epoch_step=0 if end_of_epoch else self.epoch_step + 1,
            global_step=self.global_step + 1,
            steps_per_epoch=self.steps_per_epoch,
        )

    @property
    def weight_version(self) -> int:
        """Version of the restored weights for an inference engine (``global_step + 1``)."""
        return self.global_step + 1
