"""Lightning ``CheckpointIO`` writing and reading DCP directories, sync or async.

Public API::

    DCPCheckpointIO(mode="auto", *, thread_count=2)   # Trainer(plugins=[...])
        .save_checkpoint(checkpoint, path, storage_options=None)   # options: object-store options
        .write(checkpoint, target)  # into a commit target (RecoverCallback's pair commit)
        .load_checkpoint(path, map_location=None, weights_only=None) -> dict
        .remove_checkpoint(path)
        .wait_for_staging()      # before the next optimizer step (see below)
        .wait()                  # until the last save is durable; raises its failure
        .teardown()              # wait + surface failures + free staging buffers
        .mode / .resolved_mode / .engine
    StagingWaitCallback(before_forward=False)         # Trainer(callbacks=[...])

``trainer.save_checkpoint(path)`` writes ``path/`` as a DCP directory (``.metadata`` plus
``__0_*.distcp``), ``trainer.fit(ckpt_path=path)`` resumes from it. The whole Lightning
checkpoint dict round-trips -- including integer optimizer-state keys, empty containers
and non-tensor leaves -- through :class:`areal_lightning.write.dcp.DCPEngine`.

Where the training loop waits for staging
    An async save returns once the host copy has *started*; the live weights must not
    change until it finishes. :class:`StagingWaitCallback` calls
    :meth:`DCPCheckpointIO.wait_for_staging` in ``on_before_optimizer_step`` (Lightning calls
    it for automatic and manual optimization), so the copy overlaps the next batch's
    forward/backward. Forward passes that mutate module buffers (BatchNorm running
    statistics in train mode) would race the copy: use ``StagingWaitCallback(
    before_forward=True)`` for such models (waits in ``on_train_batch_start``). Without the
    callback attached, ``save_checkpoint`` itself waits for staging before returning, so
    a checkpoint is never torn -- it just blocks for the host copy.

Distributed: Lightning's base ``Strategy`` calls ``save_checkpoint``/``remove_checkpoint``
on global rank 0 only (FSDP and ModelParallel bypass the ``CheckpointIO`` altogether).
:class:`StagingWaitCallback` and ``RecoverCallback`` install the strategy bridge
(:mod:`areal_lightning.lightning.bridge`) in ``setup``: then every rank calls ``save_checkpoint``
with its own (replicated or sharded) state and writes its own ``__{rank}_*.distcp`` files
in one collective DCP save, and loads reshard into the live model. Without the bridge
(no such callback) saves stay rank-0-only and rank-local.
"""

from __future__ import annotations

import contextlib

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.optim import Optimizer

from areal_lightning.commit.atomic import AtomicDir, CommitTarget, clean_leftovers
from areal_lightning.layout import new_token
from areal_lightning.config import IO_MODES, check_async_executor
from areal_lightning.errors import ConfigError, ConfigTypeError, PathOccupiedError, UsageError
from areal_lightning.commit.generations import GenerationCommit, Generations, resolve
from areal_lightning.layout import COMMIT_MARKER, OLD_PREFIX, TMP_PREFIX, leftover_of
from areal_lightning.lightning._internals import unwrap_checkpoint_io
from areal_lightning.lightning.bridge import install_bridge
from areal_lightning.namespaces import bases
from areal_lightning.objectstore import check_path, is_remote, validate_options
from areal_lightning.write.checksum import Written
from areal_lightning.write.dcp import DCPEngine

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]



def _async_supported() -> tuple[bool, str]:
    """Whether ``dcp.async_save`` can run here, and why not."""
    if dist.is_available() and dist.is_initialized() and not dist.is_gloo_available():
        return False, "a process group is initialized but this torch build has no gloo backend for background collectives"
    return True, ""


class DCPCheckpointIO(*bases("plugins.io.CheckpointIO")):  # type: ignore[misc]
    """Lightning ``CheckpointIO`` storing checkpoints as DCP directories.

    Args:
        mode: ``"sync"`` (``dcp.save``; returns when durable), ``"async"``
            (``dcp.async_save`` with one long-lived stager; one save in flight), or
            ``"auto"`` (async where supported, else sync with one warning).
        thread_count: writer threads; each writes its own ``__0_{i}.distcp`` file.
        async_executor: where async saves are written: ``"thread"`` (a background thread of
            this process) or ``"process"`` (a checkpoint process started on the first save:
            training does not share the GIL with the writer; see
            :mod:`areal_lightning.write.process` for what it costs and what it covers).
        storage_options: options of the object-store file system for ``s3://`` / ``gs://`` /
            ``az://`` paths (credentials and endpoint otherwise come from the standard
            provider chains, e.g. ``AWS_*`` environment variables). On an object store each
            save is a new generation ``{path}/{token}/`` committed by a marker object written
            last (:mod:`areal_lightning.commit.generations`); a load reads the newest one.

    Example:
        >>> trainer = Trainer(plugins=[DCPCheckpointIO("async")], callbacks=[StagingWaitCallback()])  # doctest: +SKIP
        >>> trainer.save_checkpoint("ckpt/step100")  # a DCP directory  # doctest: +SKIP
    """

    def __init__(self, mode: str = "auto", *, thread_count: int = 2,
                 storage_options: Optional[dict[str, Any]] = None, async_executor: str = "thread") -> None:
        if mode not in IO_MODES:
            raise ConfigError("mode", f"DCPCheckpointIO: mode={mode!r} is not allowed; choose one of {', '.join(IO_MODES)}")
        check_async_executor(async_executor)
        self._mode = mode
        self._resolved: str | None = None
        self._engine = DCPEngine(thread_count=thread_count, async_executor=async_executor)
        self._engine.storage_options = validate_options(storage_options)
        self._staging_waiters = 0
        self.own_paths = False
        """While set (:meth:`rank_local_paths`), a bridged load reads the path each rank was given
        (a memory-tier view of its own) instead of rank 0's."""
        self._preloaded: tuple[str, dict[str, Any]] | None = None  # see preloaded()

    @property
    def mode(self) -> str:
        """The configured mode (``auto``, ``sync`` or ``async``)."""
        return self._mode

    @property
    def resolved_mode(self) -> str:
        """``sync`` or ``async``: what saves actually do in this process."""
        if self._resolved is None:
            supported, reason = _async_supported()
            if self._mode == "sync":
                self._resolved = "sync"
            elif supported:
                self._resolved = "async"
            elif self._mode == "async":
                raise UsageError(f"DCPCheckpointIO(mode='async') is not possible: {reason}; "
                                 "allowed here: mode='sync' or 'auto'")
            else:
                rank_zero_warn(f"DCPCheckpointIO(mode='auto'): saving synchronously because {reason}")
                self._resolved = "sync"
        return self._resolved

    @property
    def engine(self) -> DCPEngine:
        """The underlying :class:`DCPEngine`."""
        return self._engine

    def enable_collective(self) -> None:
        """Every rank calls :meth:`save_checkpoint` together (the strategy bridge does):
        one collective DCP save, each rank writing its own files."""
        self._engine.collective = True

    @contextlib.contextmanager
    def rank_local_paths(self) -> Iterator[None]:
        """Within: a bridged load reads each rank's own path (see :attr:`own_paths`)."""
        self.own_paths = True
        try:
            yield
        finally:
            self.own_paths = False

    @contextlib.contextmanager
    def preloaded(self, path: PathLike, checkpoint: dict[str, Any]) -> Iterator[None]:
        """Within: the first :meth:`load_checkpoint` of ``path`` returns ``checkpoint`` (read and
        verified from ``path`` already: a memory-tier step loaded while it was chosen) instead
        of reading it again."""
        self._preloaded = (os.fspath(path), checkpoint)
        try:
            yield
        finally:
            self._preloaded = None

    def add_staging_waiter(self) -> None:
        """Something (a callback) waits for staging before the next optimizer step, so an
        async :meth:`save_checkpoint` may return before its host copy is done."""
        self._staging_waiters += 1

    def remove_staging_waiter(self) -> None:
        """Undo :meth:`add_staging_waiter`."""
        self._staging_waiters = max(0, self._staging_waiters - 1)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[Any] = None, *,
                        token: str | None = None) -> None:
        """Write ``checkpoint`` as the DCP directory ``path`` (first surfacing a failure of
        the previous async save). See the module doc for when an async save returns.

        The directory is written aside and renamed into place once DCP's save returned (an
        :class:`~areal_lightning.commit.atomic.AtomicDir`; in the background for async
        saves), so ``path`` always holds a complete checkpoint, the old one until the new
        one replaces it. ``storage_options``: options of the object-store file system for
        this save (``trainer.save_checkpoint(path, storage_options={...})``), over the IO's own;
        ``None`` for the IO's own. ``token``: the commit token every rank of a collective save
        uses (rank 0's; the strategy bridge passes it)."""
        check_path(os.fspath(path), "path")
        options = self.options(storage_options)
        self.write(checkpoint, self.target(path, token, options), storage_options=options)

    def write(self, checkpoint: dict[str, Any], target: CommitTarget, *, storage_options: Optional[dict[str, Any]] = None,
              check: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
        """Write ``checkpoint`` into ``target.tmp`` and commit it (``target.finalize``, on rank 0
        of a collective save) once DCP's save returned: in this call for a sync save, in the
        background for an async one. ``check(checkpoint)``: run first on rank 0 (a refusal is
        raised on every rank, and nothing is written). ``storage_options``: the object-store
        options of this save (``None``: the IO's own)."""
        asynchronous = self.resolved_mode == "async"
        start = time.perf_counter()
        lead = not self._engine.is_collective() or dist.get_rank() == 0

        def prepare() -> None:
            if check is not None and lead:
                check(checkpoint)
            target.create()

        try:
            self._engine.save(checkpoint, target.tmp, asynchronous=asynchronous, label=target.final,
                              prepare=prepare, then=target.finalize if lead else None,
                              storage_options=storage_options)
        except BaseException:
            if lead:
                target.discard()  # a failed sync save (or one that failed to start) leaves nothing behind
            raise
        if asynchronous and self._staging_waiters == 0:
            self._engine.wait_for_staging()
        log.debug("save of %s (%s) held the caller %.3f s", target.final, self.resolved_mode, time.perf_counter() - start)

    def options(self, storage_options: Optional[Any]) -> dict[str, Any]:
        """The object-store options of one save: the IO's own, updated with ``storage_options``
        (a dict of file-system options, validated; ``None``: none)."""
        return {**self._engine.storage_options, **validate_options(storage_options)}

    def target(self, path: PathLike, token: str | None = None,
               storage_options: Optional[dict[str, Any]] = None) -> CommitTarget:
        """The commit of a plain save to ``path`` (every rank of a collective save passes
        rank 0's ``token``): an atomic folder, or a new generation on an object store."""
        if is_remote(path):
            options = self._engine.storage_options if storage_options is None else storage_options
            return GenerationCommit(str(path), token or new_token(), options)
        return CheckpointDir(Path(path), token)

    def repair(self, path: PathLike) -> bool:
        """Finish a save to ``path`` a crash interrupted between its two renames
        (:meth:`AtomicDir.roll_forward`); returns whether anything was done (never anything
        on an object store: a generation without its marker does not exist)."""
        return False if is_remote(path) else AtomicDir.roll_forward(Path(path))

    def load_checkpoint(
        self,
        path: PathLike,
        map_location: Optional[Any] = None,
        weights_only: Optional[bool] = None,
        template: Optional[dict[str, Any]] = None,
    ) -> dict[str, Any]:
        """Read the DCP directory ``path`` (waits for an in-flight save first).

        ``map_location``: ``None`` (CPU), a device or a device string. ``weights_only``
        restricts the non-tensor state as ``torch.load`` does (``None`` = torch's default).
        ``template``: nested dict whose tensors (e.g. a sharded model's DTensors, by the
        checkpoint's dotted paths) are loaded in place, resharded by DCP."""
        check_path(os.fspath(path), "path")
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise ConfigTypeError("map_location", f"DCPCheckpointIO.load_checkpoint: expected None, a torch.device or "
                                  f"a device string, got {type(map_location).__name__}")
        if self._preloaded is not None and self._preloaded[0] == os.fspath(path) and template is None:
            checkpoint, self._preloaded = self._preloaded[1], None
        else:
            if is_remote(path):
                path = resolve(str(path), self._engine.storage_options)
            elif not self._engine.is_collective():  # collective loads: the bridge repairs on rank 0 first
                self.repair(path)
            checkpoint = self._engine.load(path, template=template, weights_only=weights_only)
        if map_location is not None and torch.device(map_location).type != "cpu":
            checkpoint = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.to(map_location))
        return checkpoint

    def remove_checkpoint(self, path: PathLike) -> None:
        """Delete the checkpoint at ``path``, waiting first if it is being written."""
        check_path(os.fspath(path), "path")
        if is_remote(path):  # every generation, marker first
            self._engine.wait_quietly(path)
            generations = Generations(str(path), self._engine.storage_options)
            for gen in generations.names():
                generations.delete(gen)
            return
        self._engine.remove(path)

    def wait_for_staging(self) -> None:
        """Return once an async save no longer reads the live tensors."""
        self._engine.wait_for_staging()

    def wait(self) -> None:
        """Return once the last save is durable; raise its failure if it failed."""
        self._engine.wait()

    def teardown(self) -> None:
        """Wait for the save in flight, free staging buffers, raise a stored failure."""
        self._engine.close()


class CheckpointDir(AtomicDir):
    """The :class:`~areal_lightning.commit.atomic.AtomicDir` of a ``DCPCheckpointIO`` save:
    DCP makes the files durable itself (no extra fsync pass); a folder at the path that is
    not a DCP checkpoint is never replaced; a successful commit removes what interrupted
    saves to the same path left behind."""

    def __init__(self, final: Path, token: str | None = None) -> None:
        super().__init__(final, token, fsync=False)

    def create(self) -> Path:
        """Refuse a non-empty folder without a commit marker at the path, then create the temporary folder."""
        if self.final.is_dir() and not (self.final / COMMIT_MARKER).is_file() and any(self.final.iterdir()):
            raise PathOccupiedError(
                f"cannot save a checkpoint to {self.final}: it is a folder that is not a DCP checkpoint (no "
                f"{COMMIT_MARKER}), and saving would replace it; remove it or choose another path")
        return super().create()

    def finalize(self, written: Written | None = None, *, remove_old: bool = True) -> None:
        """Rename into place, then remove the leftovers of earlier interrupted saves to this path."""
        super().finalize(written, remove_old=remove_old)
        name = self.final.name

        def interrupted(child: str) -> bool:
            parts = leftover_of(child)
            return (parts is not None and parts[0] in (TMP_PREFIX, OLD_PREFIX) and parts[1] == name
                    and parts[2] != self.token)

        clean_leftovers(self.final.parent, interrupted)


def find_io(trainer: Trainer) -> DCPCheckpointIO | None:
    """The trainer's :class:`DCPCheckpointIO` (also inside Lightning's IO wrappers), else ``None``."""
    io = unwrap_checkpoint_io(trainer.strategy.checkpoint_io)
    return io if isinstance(io, DCPCheckpointIO) else None


_RECOVER_IO = "_areal_recover_io"


def attach_recover_io(trainer: Trainer, io: DCPCheckpointIO | None) -> None:
    """Note (``None``: forget) the private ``DCPCheckpointIO`` a ``RecoverCallback`` writes its
    checkpoints through during this fit (see :func:`checkpoints_through_dcp`)."""
    if io is None:
        trainer.strategy.__dict__.pop(_RECOVER_IO, None)
    else:
        trainer.strategy.__dict__[_RECOVER_IO] = io


def checkpoints_through_dcp(trainer: Trainer) -> bool:
    """Whether this fit checkpoints through a :class:`DCPCheckpointIO`: the Trainer's, or the one
    of an enabled ``RecoverCallback`` (set up already): the run opted into async checkpointing."""
    return find_io(trainer) is not None or trainer.strategy.__dict__.get(_RECOVER_IO) is not None


class StagingWaitCallback(*bases("callbacks.Callback")):  # type: ignore[misc]
    """Makes the training loop wait for async staging right before the next optimizer step
    (or, with ``before_forward=True``, before the next batch), so that
    :class:`DCPCheckpointIO` saves return without waiting for the host copy.

    Example:
        >>> Trainer(plugins=[DCPCheckpointIO("async")], callbacks=[StagingWaitCallback()])  # doctest: +SKIP
    """

    def __init__(self, *, before_forward: bool = False) -> None:
        self.before_forward = before_forward
        self._io: DCPCheckpointIO | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Attach to the trainer's ``DCPCheckpointIO`` (warns if there is none) and install
        the strategy bridge, so every rank writes its own shard."""
        self._io = find_io(trainer)
        if self._io is None:
            rank_zero_warn("StagingWaitCallback: the trainer's checkpoint_io is not a DCPCheckpointIO; the callback does nothing")
        else:
            self._io.add_staging_waiter()
            install_bridge(trainer.strategy, self._io)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Detach, so saves outside ``fit`` wait for their own staging again."""
        if self._io is not None:
            self._io.remove_staging_waiter()
            self._io = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """Wait for staging here when ``before_forward`` is set."""
        if self.before_forward and self._io is not None:
            self._io.wait_for_staging()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        """Wait for staging before the optimizer mutates the weights."""
        if self._io is not None:
            self._io.wait_for_staging()
