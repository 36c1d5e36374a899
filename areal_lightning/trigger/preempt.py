"""Trigger: preemption signals (SLURM, Kubernetes, spot instances, ``torchrun``).

SIGTERM -- or SIGUSR1, or any signal the user names -- does not stop the run where it is.
:class:`PreemptionWatch` only notes the signal; at the next optimizer step's end every rank
asks :meth:`PreemptionWatch.agreed` whether *any* rank received one (ranks receive the signal
at different steps), and then all of them write a recover checkpoint of that same step, wait
until it is durable and stop with :data:`PREEMPTED_EXIT_CODE`. Running the same command again
continues from that step with nothing redone.

The agreement is one all-reduce of one integer per optimizer step on the checkpoint's gloo
group, only in multi-rank runs with signals configured (``benchmarks/preempt_agreement.py``
measures it). On one process nothing is exchanged.

Python runs signal handlers on the main thread between bytecodes; the handler here only
appends to a list and writes one line to stderr with ``os.write`` (no logging locks).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from areal_lightning.collective import CheckpointGroup
from areal_lightning.config import DEFAULT_PREEMPT_SIGNALS, parse_signals  # re-exported

__all__ = ["PREEMPTED_EXIT_CODE", "DEFAULT_PREEMPT_SIGNALS", "parse_signals", "PreemptionWatch", "Preempted"]

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by a preemption signal after its recover checkpoint was made
durable: ``EX_TEMPFAIL`` of ``sysexits.h`` ("temporary failure, the user is invited to retry").
Supervisors re-run the same command on it: ``areal-lightning run``, ``torchrun --max-restarts``,
a Kubernetes ``podFailurePolicy`` (``onExitCodes: [75]``), SLURM's requeue."""


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is durable; exits the process with
    :data:`PREEMPTED_EXIT_CODE` (or the configured code) unless caught. A ``SystemExit``, so an
    ``except Exception`` in the training script does not swallow it."""


class PreemptionWatch:
    """Notes preemption signals; :meth:`agreed` turns them into one decision of all ranks.

    Example:
        >>> watch = PreemptionWatch(parse_signals(["SIGUSR2"]))
        >>> watch.install()
        >>> os.kill(os.getpid(), signal.SIGUSR2)
        >>> watch.agreed(CheckpointGroup()), watch.signal_name
        (True, 'SIGUSR2')
        >>> watch.uninstall()
    """

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received: list[int] = []
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def installed(self) -> bool:
        """Whether the handlers are in place (between :meth:`install` and :meth:`uninstall`)."""
        return bool(self._previous)

    def install(self) -> None:
        """Take over the configured signals (from the main thread; elsewhere it warns and does nothing).
        Replaces the handlers in place -- Lightning's own SIGTERM handler too, which would stop
        the run after the batch without a checkpoint and exit 0."""
        if not self.signals or self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("RecoverCallback: not on the main thread, preemption signals %s are not handled",
                        ", ".join(s.name for s in self.signals))
            return
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give the signals their previous handlers back (idempotent)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        if len(self.received) == 1:
            msg = (f"RecoverCallback: {name} received (pid {os.getpid()}): a recover checkpoint of the current "
                   "step will be written on every rank, then the run stops\n")
        else:
            msg = (f"RecoverCallback: {name} received again (pid {os.getpid()}): the preemption checkpoint "
                   "continues (a kill now leaves the previous or the new checkpoint, never a broken one)\n")
        try:
            os.write(2, msg.encode())
        except OSError:
            pass

    @property
    def signal_name(self) -> str | None:
        """The first signal received, by name."""
        return signal.Signals(self.received[0]).name if self.received else None

    def agreed(self, ranks: CheckpointGroup | None) -> bool:
        """At an optimizer step's end: did any rank receive a signal? (Collective in
        multi-rank runs: every rank calls it at every step while installed.)"""
        if not self.installed:
            return False
        mine = bool(self.received)
        if ranks is None:
            return mine
        return ranks.any(mine, "preemption agreement")


def slurm_requeue() -> bool:
    """``scontrol requeue`` this SLURM job (array jobs as ``JOBID_TASKID``), as Lightning's
    ``SLURMEnvironment(auto_requeue=True)`` does on its requeue signal; ``True`` on success."""
    import re
    import subprocess

    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job or not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        log.error("RecoverCallback: cannot requeue: no valid SLURM_JOB_ID in the environment (got %r)", job)
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.error("RecoverCallback: scontrol requeue %s failed: %s", job, exc)
        return False
    if result.returncode != 0:
        log.error("RecoverCallback: scontrol requeue %s failed (exit %d): %s", job, result.returncode,
                  result.stderr.strip())
        return False
    log.warning("RecoverCallback: requeued SLURM job %s", job)
    return True
