"""Glue: a preempted run's end. ``RecoverCallback`` notes the preemption signals
(:class:`~areal_lightning.trigger.preempt.PreemptionWatch`), its save schedule turns them into one
agreed step, the session writes that step's recover checkpoint and waits until it is durable on
every rank; then :meth:`Preemption.stop` requeues a SLURM job if its requeue signal came, saves
the loggers and stops the run with the preemption exit code."""

from __future__ import annotations

import logging
from typing import Any

from areal_lightning.lightning._internals import cluster_environment
from areal_lightning.namespaces import classes
from areal_lightning.trigger.preempt import Preempted, PreemptionWatch, slurm_requeue

__all__ = ["Preemption"]

log = logging.getLogger(__name__)


class Preemption:
    """The preemption signals of one run and how it stops (see the module doc)."""

    def __init__(self, watch: PreemptionWatch, exit_code: int) -> None:
        self.watch = watch
        self.exit_code = exit_code
        self.requeue_signal: Any = None

    def install(self, trainer: Any) -> None:
        """Take over the preemption signals (at ``on_train_start``: Lightning registered its own
        handlers just before); under ``SLURMEnvironment(auto_requeue=True)`` its requeue signal too."""
        env = cluster_environment(trainer)
        slurm = isinstance(env, classes("plugins.environments.SLURMEnvironment"))
        if slurm and env.auto_requeue and env.requeue_signal is not None:
            self.requeue_signal = env.requeue_signal
            if self.watch.signals and env.requeue_signal not in self.watch.signals:
                self.watch.signals = (*self.watch.signals, env.requeue_signal)
        self.watch.install()

    def uninstall(self) -> None:
        """Give the signals back (idempotent)."""
        self.watch.uninstall()

    def stop(self, trainer: Any, where: Any) -> None:
        """After the preemption checkpoint is durable on every rank (``where``: its folder):
        requeue, save the loggers, raise :class:`Preempted`."""
        requeued = False
        if (self.requeue_signal is not None and int(self.requeue_signal) in self.watch.received
                and trainer.is_global_zero):
            requeued = slurm_requeue()
        for lg in trainer.loggers:
            lg.save()
        got = self.watch.signal_name or "a preemption signal on another rank"
        log.warning(
            "RecoverCallback: %s: the recover checkpoint of global step %d is durable in %s; stopping with exit "
            "code %d%s. Run the same command again to continue from there.", got, trainer.global_step,
            where, self.exit_code, " (SLURM job requeued)" if requeued else "")
        self.watch.uninstall()
        raise Preempted(self.exit_code)
