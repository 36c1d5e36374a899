"""Checkpoint telemetry: per-save metrics to the Trainer's loggers and one human log line.

Metrics (``kind`` is ``hf`` or ``recover``):

- ``checkpoint/{kind}/blocked_s``: how long the training loop was held by the save;
- ``checkpoint/{kind}/write_s``: from the save's start until it was durable;
- ``checkpoint/{kind}/bytes`` and ``checkpoint/{kind}/gbps`` (bytes / write_s);
- ``checkpoint/recover/age_s``: seconds since the last durable recover checkpoint (logged
  with the training metrics, at Lightning's ``log_every_n_steps``).

A save that finishes in the background is reported from the training thread at the next
step (loggers are not thread-safe), stamped with the step it was taken at.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SaveReport", "Telemetry", "folder_bytes"]

log = logging.getLogger(__name__)


def folder_bytes(path: Path) -> int:
    """Total size of the files below ``path``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


@dataclass(frozen=True)
class SaveReport:
    """One finished save."""

    kind: str
    step: int
    path: str
    blocked_s: float
    write_s: float
    nbytes: int

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (bytes / write_s)."""
        return self.nbytes / self.write_s / 1e9 if self.write_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """The logger metrics of this save."""
        p = f"checkpoint/{self.kind}/"
        return {p + "blocked_s": self.blocked_s, p + "write_s": self.write_s, p + "bytes": float(self.nbytes),
                p + "gbps": self.gbps}


class Telemetry:
    """Collects finished saves (from any thread) and hands them to the loggers (training thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[SaveReport] = []

    def record(self, report: SaveReport) -> None:
        """Note a finished save (thread-safe) and log its human line."""
        with self._lock:
            self._pending.append(report)
        log.info("%s checkpoint %s: %.1f MB durable in %.2fs (%.2f GB/s), training held %.3fs",
                 "HF" if report.kind == "hf" else "recover", report.path, report.nbytes / 1e6, report.write_s,
                 report.gbps, report.blocked_s)

    def flush(self, trainer: Any) -> None:
        """Send the recorded saves to ``trainer.loggers`` (call from the training thread)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending or not trainer.is_global_zero:
            return
        for report in pending:
            for logger in trainer.loggers:
                logger.log_metrics(report.metrics(), step=report.step)
