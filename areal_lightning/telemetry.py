"""Checkpoint telemetry: per-save metrics to the Trainer's loggers and one human log line.

Metrics (``kind`` is ``hf`` or ``recover``):

- ``checkpoint/{kind}/blocked_s``: how long the training loop was held by the save (for a
  sync save, its whole duration);
- ``checkpoint/{kind}/write_s``: from the save's start until it was durable;
- ``checkpoint/{kind}/bytes`` and ``checkpoint/{kind}/gbps`` (bytes / write_s);
- recover saves also: ``checkpoint/recover/rank_bytes`` (what global rank 0 wrote itself) and
  ``checkpoint/recover/hash_s`` (seconds its writer threads spent on checksums);
- on an object store also ``checkpoint/{kind}/retries``: the requests the reporting process
  had to retry so far (transient errors: throttling, 5xx, connection resets; each store's
  count: :func:`areal_lightning.objectstore.retries`);
- ``checkpoint/recover/age_s``: seconds since the last durable recover checkpoint (logged
  with the training metrics, at Lightning's ``log_every_n_steps``).

A save that finishes in the background is reported from the training thread at the next
step (loggers are not thread-safe), stamped with the step it was taken at.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SaveReport", "SaveTimer", "Telemetry", "folder_bytes"]

log = logging.getLogger(__name__)


def folder_bytes(path: Path) -> int:
    """Total bytes of the regular files below ``path`` (``path``'s own for a file; 0 when it does
    not exist). A file removed or renamed meanwhile (another rank's or thread's temporary file)
    is skipped."""
    try:
        if os.path.isfile(path):
            return os.lstat(path).st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class SaveReport:
    """One finished save."""

    kind: str
    step: int
    path: str
    blocked_s: float
    write_s: float
    nbytes: int
    rank_bytes: int | None = None
    """Bytes the reporting rank wrote itself (recover saves)."""
    hash_s: float | None = None
    """Seconds the reporting rank's writer threads spent hashing (recover saves)."""
    retries: int | None = None
    """Object-store requests the reporting process retried so far (throttling, 5xx, resets)."""

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (bytes / write_s)."""
        return self.nbytes / self.write_s / 1e9 if self.write_s > 0 else 0.0

    def metrics(self) -> dict[str, float]:
        """The logger metrics of this save."""
        p = f"checkpoint/{self.kind}/"
        metrics = {p + "blocked_s": self.blocked_s, p + "write_s": self.write_s, p + "bytes": float(self.nbytes),
                   p + "gbps": self.gbps}
        if self.rank_bytes is not None:
            metrics[p + "rank_bytes"] = float(self.rank_bytes)
        if self.hash_s is not None:
            metrics[p + "hash_s"] = self.hash_s
        if self.retries is not None:
            metrics[p + "retries"] = float(self.retries)
        return metrics


class Telemetry:
    """Collects finished saves (from any thread) and hands them to the loggers (training thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[SaveReport] = []
        self._metrics: list[tuple[int, dict[str, float]]] = []

    def record(self, report: SaveReport) -> None:
        """Note a finished save (thread-safe) and log its human line."""
        with self._lock:
            self._pending.append(report)
        extra = ""
        if report.rank_bytes is not None and report.hash_s is not None:
            extra = f"; this rank wrote {report.rank_bytes / 1e6:.1f} MB, {report.hash_s:.3f}s of it hashing"
        log.info("%s checkpoint %s: %.1f MB durable in %.2fs (%.2f GB/s), training held %.3fs%s",
                 "HF" if report.kind == "hf" else "recover", report.path, report.nbytes / 1e6, report.write_s,
                 report.gbps, report.blocked_s, extra)

    def note(self, step: int, metrics: dict[str, float]) -> None:
        """Queue plain metrics of ``step`` for the loggers (e.g. the memory tier's, every step; no log line)."""
        with self._lock:
            self._metrics.append((step, metrics))

    def flush(self, trainer: Any) -> None:
        """Send the recorded saves to ``trainer.loggers`` (call from the training thread)."""
        with self._lock:
            pending, self._pending = self._pending, []
            metrics, self._metrics = self._metrics, []
        if not trainer.is_global_zero:
            return
        for step, values in [(r.step, r.metrics()) for r in pending] + metrics:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)


class SaveTimer:
    """The timing of one recover save, reported once both ends are known: the training loop's
    part (the call, plus later waits for its host copy) and the durable commit (on rank 0, in
    the background for an async save, before or after the call returned)."""

    def __init__(self, telemetry: Telemetry, step: int, path: str, retries: Any = None) -> None:
        self.telemetry = telemetry
        self.step = step
        self.path = path
        self.retries = retries  # a callable giving the object-store retries so far, or None
        self.start = time.perf_counter()
        self._lock = threading.Lock()
        self._held: float | None = None
        self._waited = 0.0
        self._written: Any = None
        self._durable_s = 0.0
        self._reported = False

    def waited(self, seconds: float) -> None:
        """The training loop waited ``seconds`` more for this save's host copy."""
        self._waited += seconds

    def returned(self) -> None:
        """The save call returned to the training loop."""
        with self._lock:
            self._held = time.perf_counter() - self.start
            self._report()

    def committed(self, written: Any) -> None:
        """Rank 0 committed the save (``written``: the write stage's
        :class:`~areal_lightning.write.checksum.Written`)."""
        with self._lock:
            self._written, self._durable_s = written, time.perf_counter() - self.start
            self._report()

    def _report(self) -> None:
        if self._held is None or self._written is None or self._reported:
            return
        self._reported = True
        w = self._written
        self.telemetry.record(SaveReport(
            "recover", self.step, self.path, self._held + self._waited, self._durable_s,
            sum(f["size"] for f in w.files.values()), w.nbytes, w.hash_s,
            self.retries() if self.retries is not None else None))
