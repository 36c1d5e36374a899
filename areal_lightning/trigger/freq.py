"""One trigger for epochs / steps / seconds: it fires when ANY enabled condition holds.

- steps: after every optimizer step whose count (``trainer.global_step``) is a multiple of
  ``freq_steps``;
- epochs: at the end of every epoch whose count (``current_epoch + 1``) is a multiple of
  ``freq_epochs``;
- seconds: at a step end when ``freq_secs`` seconds (monotonic clock) have passed since the
  last fire (or since :meth:`FreqController.start`).

It never fires twice for the same step count. Steps and epochs are pure functions of
progress, so only the seconds clock and the last fired step are state; on
:meth:`~FreqController.load_state_dict` the *current* frequencies win and only that
progress is restored.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["FreqController", "EpochPosition"]


class FreqController:
    """Epoch / step / seconds trigger with resumable progress.

    Args:
        freq_epochs: fire at the end of every N-th epoch, or ``None``.
        freq_steps: fire after every N-th step, or ``None``.
        freq_secs: fire when N seconds passed since the last fire, or ``None``.
        clock: monotonic clock in seconds (injectable for tests).

    Example:
        >>> t = [0.0]
        >>> ctl = FreqController(freq_steps=2, freq_secs=10, clock=lambda: t[0])
        >>> ctl.start()
        >>> [ctl.check_step(s) for s in (1, 2, 3)]
        [False, True, False]
        >>> t[0] = 10.0; ctl.check_step(3)
        True
    """

    def __init__(
        self,
        freq_epochs: int | None = None,
        freq_steps: int | None = None,
        freq_secs: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.freq_epochs = freq_epochs
        self.freq_steps = freq_steps
        self.freq_secs = freq_secs
        self._clock = clock
        self._last_time: float = clock()
        self.last_fired_step: int | None = None

    @property
    def enabled(self) -> bool:
        """True when at least one trigger is set."""
        return any(f is not None for f in (self.freq_epochs, self.freq_steps, self.freq_secs))

    @property
    def uses_clock(self) -> bool:
        """True when the seconds trigger is set (ranks may then disagree and must agree)."""
        return self.freq_secs is not None

    def start(self) -> None:
        """Restart the seconds clock (call when training starts)."""
        self._last_time = self._clock()

    def seconds_since_fire(self) -> float:
        """Seconds on the clock since the last fire (or start)."""
        return self._clock() - self._last_time

    def check_step(self, steps_done: int) -> bool:
        """At a step end: does the step or the seconds trigger hold for ``steps_done`` steps?"""
        if steps_done <= 0 or steps_done == self.last_fired_step:
            return False
        if self.freq_steps is not None and steps_done % self.freq_steps == 0:
            return True
        return self.freq_secs is not None and self.seconds_since_fire() >= self.freq_secs

    def check_epoch(self, epochs_done: int, steps_done: int) -> bool:
        """At an epoch end: does the epoch trigger hold after ``epochs_done`` epochs?"""
        if steps_done <= 0 or steps_done == self.last_fired_step:
            return False
        return self.freq_epochs is not None and epochs_done > 0 and epochs_done % self.freq_epochs == 0

    def mark_fired(self, steps_done: int) -> None:
        """Record a save at ``steps_done`` steps and restart the seconds clock."""
        self.last_fired_step = steps_done
        self._last_time = self._clock()

    def state_dict(self) -> dict[str, Any]:
        """Progress (JSON-serialisable). Frequencies are included for information only."""
        return {
            "last_fired_step": self.last_fired_step,
            "secs_since_fire": self.seconds_since_fire(),
            "freq_epochs": self.freq_epochs,
            "freq_steps": self.freq_steps,
            "freq_secs": self.freq_secs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore progress; the frequencies given to ``__init__`` (the current config) win."""
        self.last_fired_step = state.get("last_fired_step")
        self._last_time = self._clock() - float(state.get("secs_since_fire", 0.0))


class EpochPosition:
    """The current epoch and its first global step, for export names and ``step_info``.

    Lightning does not call ``on_train_epoch_start`` for the epoch a run resumes into from
    a checkpoint taken at an epoch boundary; :meth:`train_started` (call it from
    ``on_train_start``) catches up then.

    Example:
        >>> pos = EpochPosition()
        >>> pos.start_step = 12
        >>> pos.epoch_step(15)  # the 0-based index in the epoch of the step that made global_step 15
        2
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.start_step = 0

    def epoch_started(self, trainer: Any) -> None:
        """Record the epoch Lightning starts now (``on_train_epoch_start``)."""
        self.epoch = trainer.current_epoch
        self.start_step = trainer.global_step

    def train_started(self, trainer: Any) -> None:
        """After a resume at an epoch boundary, the restored position is the previous epoch's."""
        if trainer.current_epoch != self.epoch:
            self.epoch_started(trainer)

    def epoch_step(self, global_step: int) -> int:
        """0-based index within the epoch of the step after which ``global_step`` steps are done."""
        return max(global_step - self.start_step - 1, 0)

    def state_dict(self) -> dict[str, int]:
        """JSON-friendly position."""
        return {"epoch_start_step": self.start_step, "epoch_index": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (missing keys count as 0)."""
        self.start_step = int(state.get("epoch_start_step", 0))
        self.epoch = int(state.get("epoch_index", 0))
