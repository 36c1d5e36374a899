"""Stage: the single-in-flight background worker with explicit staging / durable waits.

:class:`BackgroundWorker` runs at most one job at a time (an async DCP save, an HF export):
``stage_to_host`` (waits for the job in flight, then copies into the reused host buffers),
``submit(fn)``, ``track(label, done, staged)`` for a job started elsewhere (``dcp.async_save``:
its staging and upload futures), ``wait_for_staging()`` (the live tensors are free again),
``wait()`` (durable; raises a stored failure once), ``join()``, ``raise_if_failed()`` and
``close()``. A failure (``BaseException`` included) is stored and raised once, as
:class:`~areal_lightning.errors.CheckpointWriteError` naming the job's label.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from areal_lightning.errors import CheckpointWriteError
from areal_lightning.stage.host import HostStager, bind_thread_to, cuda_device

__all__ = ["BackgroundWorker"]

log = logging.getLogger(__name__)


@dataclass
class _Job:
    label: str
    done: Future
    staged: Future | None


class BackgroundWorker:
    """At most one background job in flight; its failure is stored and raised once.

    All methods are meant to be called from one (the training) thread."""

    def __init__(self, name: str = "areal-ckpt") -> None:
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._job: _Job | None = None
        self._failure: CheckpointWriteError | None = None
        self._stager = HostStager()

    @property
    def in_flight(self) -> str | None:
        """Label (usually the path) of the unfinished job, else ``None``."""
        if self._job is not None and not self._job.done.done():
            return self._job.label
        return None

    def stage_to_host(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Wait for the job in flight (it may still read the buffers), raising its failure,
        then copy ``state_dict`` into the reused host buffers and return the copy."""
        self.wait()
        return self._stager.stage_to_host(state_dict)

    def submit(self, fn: Callable[[], object], *, label: str) -> None:
        """Wait for the previous job (raising its failure), then run ``fn()`` in the
        background. ``label`` (e.g. the output path) names the job in error messages."""
        self.wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name,
                                                initializer=bind_thread_to, initargs=(cuda_device(),))
        self._job = _Job(label, self._executor.submit(fn), None)

    def wait_for_staging(self) -> None:
        """Return once the job in flight no longer reads the live tensors (its host copy is
        done, or it ended). Never raises: failures surface through :meth:`wait`."""
        job = self._job
        if job is not None and job.staged is not None:
            concurrent.futures.wait([job.staged, job.done], return_when=concurrent.futures.FIRST_COMPLETED)

    def join(self) -> None:
        """Wait for the job in flight; keep any failure for the next raising call."""
        job, self._job = self._job, None
        if job is None:
            return
        error = job.done.exception()  # blocks; a BaseException from the worker lands here too
        if error is not None and self._failure is None:
            self._failure = CheckpointWriteError(f"background checkpoint job for {job.label} failed: {error!r}")
            self._failure.__cause__ = error
            log.error("%s", self._failure)

    def raise_if_failed(self) -> None:
        """Raise (once) the stored failure of a finished job, without waiting."""
        if self._job is not None and self._job.done.done():
            self.join()
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def wait(self) -> None:
        """Wait for the job in flight; raise (once) its failure or an earlier stored one."""
        self.join()
        self.raise_if_failed()

    def close(self) -> None:
        """Wait, free the staging buffers and the thread, then raise any stored failure."""
        try:
            self.join()
        finally:
            self._stager.close()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
        self.raise_if_failed()

    @property
    def stager(self) -> HostStager:
        """The worker's host stager (the ``async_stager`` of its ``dcp.async_save`` jobs)."""
        return self._stager

    def track(self, label: str, done: Future, staged: Future | None) -> None:
        """Adopt a job started elsewhere (``dcp.async_save``: its upload and staging
        futures); the caller waited for the previous job first."""
        self._job = _Job(label, done, staged)


