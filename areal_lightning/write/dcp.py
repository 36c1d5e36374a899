"""Write: ``DCPEngine``, sync/async DCP saves of nested checkpoints and template loads.

Plain Python over ``torch.distributed.checkpoint`` (DCP); it knows nothing of Lightning,
nor of how a written directory is committed (that is :mod:`areal_lightning.commit`).

``DCPEngine(thread_count=2, collective=False, async_executor="thread")``
    ``save(state, path, asynchronous=False, then=None)`` writes any nested checkpoint (dicts
    with any key types, lists, tuples, tensors, other picklable leaves) as a DCP directory:
    ``__{rank}_{i}.distcp`` data files plus ``.metadata``, in the format of
    :mod:`areal_lightning.write.dcp_format`. A rank-local save of plain tensors to a local
    folder needs no plan and is written by :mod:`areal_lightning.write.direct` (same format;
    async: staged into host buffers made once per layout, then written by this process's
    threads or, with ``async_executor="process"``, by a checkpoint process,
    :mod:`areal_lightning.write.process`); so is a collective save of plain tensors that every
    rank holds whole (DDP) and of sharded ones (FSDP2, FSDP1: each rank's local chunks), spread
    over the ranks by :mod:`areal_lightning.write.spread` (sync, and async with the thread
    executor); every other save is planned and written by DCP,
    async ones staged through the engine's :class:`~areal_lightning.stage.BackgroundWorker`
    (its :class:`~areal_lightning.stage.HostStager` is DCP's ``async_stager``). Every item is checksummed (CRC32C) in DCP's writer threads as
    it is written, and the checksums go into ``.metadata`` with DCP's item records
    (:mod:`areal_lightning.write.checksum`); plans are cached across saves. ``then(written)``
    -- a commit target's publish, given what the save wrote and, on the coordinator, its
    manifest (:class:`~areal_lightning.write.checksum.Written`) -- runs after DCP's save
    returned: in the caller (sync) or in the background (async), never inside DCP's storage
    writer. ``last_written`` / ``last_read``: this rank's bytes and hashing time.
    ``load(path, template=None, weights_only=None)`` rebuilds that structure exactly. Tensors
    are read into a template: the caller's tensors where ``template`` has them (same dotted
    paths, e.g. sharded tensors of a live model), else tensors allocated from the saved
    metadata. DCP's empty-planner path, which stringifies keys, is never used. A load whose
    tensors are each saved whole and go to contiguous CPU tensors of their shape and dtype
    needs no plan either (:func:`~areal_lightning.write.direct.whole_reads`). A rank's
    files are read in parallel, each in offset order, every item once, its length and
    CRC32C checked as it is read (a mismatch raises :class:`CheckpointCorruptError` naming
    the file and the key); each tensor read for an engine-allocated slot is adopted as is
    (DCP's stock reader copies it once more into the template).
    Waits (one vocabulary, also that of ``DCPCheckpointIO`` and ``RecoverCallback``):
    ``wait_for_staging()`` returns once the async host copy is done (call it before the next
    optimizer step mutates weights); ``wait()`` returns once the save is durable and its
    ``then`` ran, raising this rank's failure; ``wait_all(what)`` is the collective ``wait``
    (a failure on any rank is raised on every rank); ``wait_quietly(path)`` waits without
    raising (the failure is kept for the next raising call). ``remove(path)`` deletes a checkpoint (waiting first if it is the one being
    written); ``close()`` waits, re-raises a pending failure and frees the staging buffers.

Rules
    At most one job in flight per engine: a new save, a load, a remove of the in-flight
    path and ``close`` first wait for it. A background failure (including DCP's
    ``CheckpointException``, a ``BaseException``, and a failure of ``then``) is stored and
    raised once, as :class:`CheckpointWriteError` naming the save, by the next ``save``,
    ``wait``, ``wait_all`` or ``close`` -- never swallowed.

Completeness marker
    A DCP directory is complete only when its ``.metadata`` file exists
    (:data:`~areal_lightning.layout.COMMIT_MARKER`): DCP writes it last via tmp file + fsync
    + rename (``FileSystemWriter.finish`` in torch 2.13) after the fsynced data files; the
    engine then fsyncs the directory. :meth:`DCPEngine.load` refuses a directory without it
    with :class:`CheckpointCorruptError`. The engine is given fresh ``.tmp-`` directories by
    its callers; if it is pointed at an existing one, that one's marker is removed first,
    so an old marker never sits over new partial data.

Distributed
    With ``collective=False`` (the default; Lightning calls ``CheckpointIO`` on rank 0
    only) DCP runs with ``no_dist=True``. With ``collective=True`` and an initialized process
    group of more than one rank, every rank must call ``save`` together (one DCP save: each
    rank writes its own ``__{rank}_*.distcp`` files, replicated tensors are written once,
    the skeleton by rank 0 only). Every rank first agrees it is ready (a failure on one rank
    is raised on all, see :mod:`areal_lightning.collective`); that agreement also decides,
    on every rank alike, whether the save is spread without planning
    (:mod:`areal_lightning.write.spread`: then one more agreement carries every rank's
    CRC32Cs to rank 0, which writes ``.metadata``). DCP's own exchanges run on the
    dedicated gloo groups of ``engine.ranks`` with their own timeout (sync saves on the
    training thread's group, async saves on the background one), as do the spread save's. Loads are always
    rank-local reads of the shared directory into the caller's template, so DCP reshards to
    whatever the template holds (any world size).

Fault points (see :mod:`areal_lightning._fault`): ``engine.before_staging`` (caller thread,
start of every save), ``engine.after_staging`` (writer thread, state on host, before the
first byte is written), ``engine.before_commit`` (before ``.metadata``),
``engine.after_commit`` (after ``.metadata`` and the directory fsync).

Security: DCP's ``.metadata`` and the skeleton are pickles; load checkpoints only from
trusted storage (``weights_only=True`` restricts the skeleton like ``torch.load`` does).
"""

from __future__ import annotations


import contextlib
import itertools
import os
import pickle
import shutil
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    TensorStorageMetadata,
)

from areal_lightning._fault import fault_point
from areal_lightning._torch_internals import (
    drop_plan_cache,
    load_flat_state_dict,
    quiet_dcp_debug_log,
    save_flat_state_dict,
)
from areal_lightning.collective import DEFAULT_TIMEOUT_S, CheckpointGroup
from areal_lightning.errors import CheckpointCorruptError, CheckpointWriteError, ConfigError, PathOccupiedError, UsageError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.objectstore import filesystem, is_remote, strip
from areal_lightning.stage.host import bind_thread_to, copy_into, cuda_device, pin_buffers, pinning_possible
from areal_lightning.stage.worker import BackgroundWorker
from areal_lightning.write.checksum import (
    Written,
)
from areal_lightning.write.dcp_format import (
    SKELETON_KEY,
    unflatten,
    flat_tensors,
    flatten,
)
from areal_lightning.write import direct, replicas, spread
from areal_lightning.write.durable import fsync_dir
from areal_lightning.write.process import ASYNC_EXECUTORS, CheckpointProcess
from areal_lightning.write.objectstore_fs import Location, location, on_object_store
from areal_lightning.write.dcp_writer import CachingSavePlanner, HashingWriter
from areal_lightning.write.dcp_reader import READ_THREADS, Read, TemplateLoadPlanner, check_complete, reader_of

PathLike = Union[str, "os.PathLike[str]"]



_ENGINES = itertools.count()
"""Serial numbers of this process's engines (their plan-cache keys)."""

# Async saves in flight in this process, by absolute path: a load of that path from another
# engine (e.g. a new Trainer's DCPCheckpointIO) waits for it instead of finding no marker.
_IN_FLIGHT: "weakref.WeakValueDictionary[str, BackgroundWorker]" = weakref.WeakValueDictionary()





def _key(path: PathLike) -> str:
    """The identity of a checkpoint path in this process (absolute for local paths)."""
    return path if isinstance(path, str) and is_remote(path) else os.path.abspath(path)



def _then(upload: Future, then: Callable[[Written], None] | None, what: str, written: Written) -> Future:
    """A future that completes once ``upload`` did and ``then(written)`` ran after it (in the
    thread completing ``upload``: DCP's background thread); a failure of either becomes a
    :class:`CheckpointWriteError` naming the save (``what``: its path and where it was written)."""
    done: Future = Future()

    def chain(finished: Future) -> None:
        try:
            finished.result()
            if then is not None:
                then(written)
        except BaseException as exc:  # noqa: BLE001 - stored in the future, raised by wait()
            error = CheckpointWriteError(f"checkpoint save to {what} failed: {exc!r}")
            error.__cause__ = exc
            done.set_exception(error)
        else:
            done.set_result(None)

    upload.add_done_callback(chain)
    return done



def _training_queue() -> tuple[Any, Any]:
    """The training thread's CUDA device and an event recorded on its current stream (what
    training queued before the save, which a staging copy waits for); ``(None, None)`` off CUDA."""
    device = cuda_device()
    if device is None:
        return None, None
    ready = torch.cuda.Event()
    ready.record()
    return device, ready


def _invalidate(path: Path, *, withdraw_marker: bool = True) -> None:
    """Prepare ``path`` for a new save: create it, or withdraw its old commit marker (done
    by rank 0 alone in a collective save, before its first collective: no rank writes data
    before every rank has entered the save)."""
    if path.exists() and not path.is_dir():
        raise PathOccupiedError(f"cannot write a DCP checkpoint to {path}: a file exists there; remove it or choose another path")
    path.mkdir(parents=True, exist_ok=True)
    withdrawn = False
    for name in (COMMIT_MARKER, COMMIT_MARKER + ".tmp") if withdraw_marker else ():
        marker = path / name
        if marker.exists():
            marker.unlink(missing_ok=True)
            withdrawn = True
    if withdrawn:
        fsync_dir(path)



_NO_SKELETON = object()
"""A flat dict without the skeleton (a collective save's rank other than 0)."""


class DCPEngine:
    """Sync/async DCP saves and template loads with one save in flight (see module doc).

    Args:
        thread_count: writer threads per rank (each writes its own ``__{rank}_{i}.distcp``).
        collective: all ranks call ``save`` together (one shard per rank) when a process
            group is initialized; ``False`` means rank-local saves (``no_dist``).
    """

    def __init__(self, *, thread_count: int = 2, collective: bool = False,
                 collective_timeout: float = DEFAULT_TIMEOUT_S, async_executor: str = "thread") -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ConfigError("thread_count", f"expected an integer >= 1, got {thread_count!r}")
        if async_executor not in ASYNC_EXECUTORS:
            raise ConfigError("async_executor", f"unknown executor {async_executor!r}; allowed: {', '.join(ASYNC_EXECUTORS)}")
        self.thread_count = thread_count
        self.async_executor = async_executor
        """Where async saves that need no plan are written: ``thread`` or ``process``
        (:mod:`areal_lightning.write.process`); every other async save in a thread."""
        self._process: CheckpointProcess | None = None
        self.collective = collective
        quiet_dcp_debug_log()  # per-item DEBUG records nobody receives, built in the training thread
        self.ranks = CheckpointGroup(collective_timeout)
        """The dedicated gloo group (with its own timeout) of collective saves."""
        self.storage_options: dict[str, Any] = {}
        """Options of the object-store file system (credentials, endpoint...) for URI paths."""
        self._worker = BackgroundWorker("areal-dcp")
        self._plan_keys: set[str] = set()
        self._checked_plans: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._layout: direct.ByteLayout | None = None  # of the last rank-local save of plain tensors
        self._paths: dict[str, Any] = {}  # flatten's memo: the dotted paths of the state dicts
        self._signatures = direct.Signatures()  # an async save's layout signature, checked in one call while it holds
        self._offers = spread.Tokens()  # a collective save's offer to be spread (write/spread.py)
        self._local_shards = direct.LocalShards()  # its sharded tensors as their local chunks
        self._local_signatures = direct.Signatures()  # the signature of those chunks
        self._spread: spread.Plan | None = None  # this rank's part of the last spread save
        self._buffers: tuple[direct.ByteLayout, dict[str, torch.Tensor]] | None = None  # its async staging buffers
        self._copy_into: tuple[dict[str, torch.Tensor], direct.StagingCopy] | None = None  # their StagingCopy
        self._copy_stream: Any = None  # CUDA: the stream of those copies
        self._upload_thread: ThreadPoolExecutor | None = None
        self._serial = next(_ENGINES)
        self.last_written: Written | None = None
        """What this rank wrote in the last save (:class:`~areal_lightning.write.checksum.Written`)."""
        self.last_read: Read | None = None
        """What this rank read in the last load (:class:`Read`)."""
        self.last_per_rank: dict[str, torch.Tensor] = {}
        """The tensors the last load gave this rank from its own per-rank copies, by flat key
        (:mod:`~areal_lightning.write.replicas`); for a caller that must apply them again."""
        self._checked: tuple[Location, frozenset[str]] | None = None  # see checked_before()

    @property
    def in_flight(self) -> str | None:
        """Label (the path) of the async save still running, else ``None``."""
        return self._worker.in_flight

    @property
    def stager(self) -> Any:
        """The :class:`~areal_lightning.stage.HostStager` of this engine's async saves."""
        return self._worker.stager

    @property
    def staging_buffers(self) -> dict[str, torch.Tensor] | None:
        """The host buffers async saves that need no plan are staged into (pinned on CUDA;
        ``None`` before the first one); other async saves stage through :attr:`stager`."""
        return self._buffers[1] if self._buffers is not None else None

    def save(
        self,
        state: Mapping[str, Any],
        path: PathLike,
        *,
        asynchronous: bool = False,
        then: Callable[[Written], None] | None = None,
        label: PathLike | None = None,
        prepare: Callable[[], Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        """Write ``state`` to the DCP directory ``path``.

        First waits for the previous async save and raises its failure. Sync: returns when
        the checkpoint is durable and committed. Async: returns once the copy to host has
        started; call :meth:`wait_for_staging` before mutating the tensors, :meth:`wait`
        for durability. Raises :class:`CheckpointWriteError` naming ``path`` on failure.

        ``then`` (e.g. a commit target's ``finalize``, passed on the coordinator only) runs
        after DCP's save has returned and the directory is committed: in the caller for a
        sync save, in the background for an async one; its failure is the save's failure.
        In a collective sync save every rank then agrees that it succeeded, so a failure of
        rank 0's ``then`` is raised on every rank. ``label`` names the save in messages and
        in :attr:`in_flight` (default: ``path``). ``storage_options``: the object-store options of
        this save (default: the engine's)."""
        path = location(path)
        label = str(label if label is not None else path)
        what = label if label == str(path) else f"{label} (written at {path})"
        collective = self.is_collective()
        rank = dist.get_rank() if collective else 0
        error: BaseException | None = None
        mine: Any = None
        signature, plain, chunks = None, False, None
        local: dict[str, Any] = {}
        try:
            self._worker.wait()
            fault_point("engine.before_staging")
            if prepare is not None:
                prepare()
            flat = flatten(state, self._paths)
            if rank != 0:
                # Collective save: rank 0's skeleton describes the checkpoint; the others'
                # contribute tensors only (DCP would keep one arbitrary rank's byte item).
                flat.pop(SKELETON_KEY)
            if collective:
                # which replicated tensors are not equal on every rank (write/replicas.py), and
                # whether this rank can write its part without DCP's planning (write/spread.py):
                # plain tensors, or sharded ones as their local chunks
                if isinstance(path, Path) and not (asynchronous and self.async_executor == "process"):
                    pinned = pin_buffers() if asynchronous else None
                    signature, plain = self._signature(flat, pinned)
                    if signature is None and (shards := self._local_shards(flat)) is not None \
                            and self._local_shards.disjoint:
                        local, chunks = shards
                        signature, plain = self._signature(local, pinned, self._local_signatures)
                mine = (replicas.fingerprints(flat),
                        self._offers(None if signature is None else (signature, chunks), self.thread_count))
            if isinstance(path, str):  # object store: a fresh generation prefix, no folders to make
                writer = HashingWriter(path, single_file_per_rank=True, sync_files=False,
                                       thread_count=self.thread_count)
                on_object_store(writer, path, self.storage_options if storage_options is None else storage_options)
            else:
                _invalidate(path, withdraw_marker=rank == 0)
                writer = HashingWriter(path, single_file_per_rank=True, sync_files=True,
                                       thread_count=self.thread_count)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the agreement (on every rank)
            if not collective:
                raise
            error = exc
        if collective:
            # No rank enters DCP's collectives unless every rank is ready: a failure here on
            # one rank is an error on all of them, not a hang. The same exchange carries every
            # rank's fingerprints: a tensor that differs is stored per rank.
            gathered = self.ranks.agree(error, f"checkpoint save to {what}", mine)
            differ = replicas.differing([fingerprints for fingerprints, _ in gathered])
            self._spread = spread.plan(gathered, differ, rank, signature, self.thread_count, self._spread, chunks)
            written_from = local if chunks is not None else flat  # sharded tensors: their local chunks
            values = [value for key, value in written_from.items() if key != SKELETON_KEY] if self._spread else None
            replicas.store_per_rank(flat, differ, rank, len(gathered))
            if self._spread is not None and chunks is not None:
                replicas.store_per_rank(local, differ, rank, len(gathered))
            if self._spread is not None and asynchronous:
                self._spread_start(written_from, values, plain, path, writer, then, what, label, rank)
                return
            if self._spread is not None:
                self._spread_save(written_from, values, plain, path, writer, then, what, rank)
                return
        if not asynchronous:
            error = None
            try:
                self._write(flat, path, writer, collective, background=False)
            except (Exception, CheckpointException) as exc:
                raise CheckpointWriteError(f"checkpoint save to {what} failed: {exc!r}") from exc
            self.last_written = writer.checksums.written
            try:
                if then is not None:
                    then(writer.checksums.written)
            except BaseException as exc:  # noqa: BLE001 - raised below (on every rank when collective)
                error = CheckpointWriteError(f"checkpoint save to {what} failed: {exc!r}")
                error.__cause__ = exc
            if collective:
                self.ranks.agree(error, f"checkpoint commit of {what}")
            elif error is not None:
                raise error
            return
        error = None
        try:
            layout, plain = None, False
            if not collective and isinstance(path, Path):
                if self.async_executor == "process":
                    if self._process is None:
                        self._process = CheckpointProcess(self.thread_count)
                    key, plain = self._signature(flat, pinned=False)
                    layout = self._process.layout_for(key)
                else:
                    layout, plain = self._direct_layout(flat, pinned=pin_buffers())
            if layout is not None:  # a save that needs no plan: staged into buffers of its layout
                staged, upload = self._staged_save(flat, path, layout, writer, plain)
            else:
                # What dcp.async_save does with a THREAD checkpointer (the host copy in the
                # stager's thread, then DCP's save of the copy in one background thread), without
                # its per-value Stateful pass in this, the training, thread.
                staged = self._worker.stager.stage(flat)
                upload = self._uploads().submit(
                    lambda: self._write(staged.result(), path, writer, collective, background=True))
        except (Exception, CheckpointException) as exc:
            error = CheckpointWriteError(f"checkpoint save to {what} failed to start: {exc!r}")
            error.__cause__ = exc
        if collective:
            # A save that failed to start on one rank fails on every rank now (the caller may
            # next enter a collective of its own, e.g. Trainer.save_checkpoint's barrier).
            self.ranks.agree(error, f"checkpoint save to {what} (start)")
        elif error is not None:
            raise error
        self._worker.track(label, _then(upload, then, what, writer.checksums.written), staged)
        self.last_written = writer.checksums.written  # filled in as the background save runs
        _IN_FLIGHT[_key(label)] = self._worker

    def _spread_save(self, flat: dict[str, Any], values: list[Any], plain: bool, path: Path, writer: HashingWriter,
                     then: Callable[[Written], None] | None, what: str, rank: int) -> None:
        """A collective sync save by :mod:`~areal_lightning.write.spread` (its plan in
        ``self._spread``), in the caller's thread (:meth:`_spread_finish`). ``values``: this
        rank's tensors in its signature's order."""
        self._spread_finish(self._spread, direct.tensors_of(flat, plain, [values[i] for i in self._spread.positions]),
                            flat[SKELETON_KEY] if rank == 0 else None, path, writer.checksums.written, writer.device,
                            what, rank, then, background=False)

    def _spread_finish(self, part: spread.Plan, source: direct.TensorSource, skeleton: Any, path: Path,
                       written: Written, device: Any, what: str, rank: int, then: Callable[[Written], None] | None,
                       *, background: bool, error: BaseException | None = None) -> None:
        """Collective: write this rank's part of a spread save (``skeleton``: the skeleton on
        rank 0, else ``None``) and agree, every rank's CRC32Cs going to rank 0; rank 0 writes
        the merged ``.metadata`` and runs ``then``; all agree on that commit. A failure on any
        rank (or this rank's ``error``) is raised on every rank, and every rank then drops the
        plan (the next save plans anew). ``background``: on the background group (an async
        save's thread; a commit that fails there fails every rank's save, as inside DCP's last
        collective)."""
        try:
            report = None
            if error is None:
                try:
                    data = direct.skeleton_bytes(skeleton) if skeleton is not None else None
                    direct.write_files(source, data, path, part.layout, written, device=device)
                    report = part.report()
                except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
                    error = CheckpointWriteError(f"checkpoint save to {what} failed: {exc!r}")
                    error.__cause__ = exc
            reports = self.ranks.agree(error, f"checkpoint save to {what}", report, background=background)
            part.confirmed = True
            self.last_written = written  # every rank's part written (an async save's: the object it already was)
            if rank == 0:
                try:
                    merged = part.merged(reports)
                    direct.write_metadata(path, merged.metadata, written, layout=merged)
                    if then is not None:
                        then(written)
                except BaseException as exc:  # noqa: BLE001 - raised below, on every rank
                    error = CheckpointWriteError(f"checkpoint save to {what} failed: {exc!r}")
                    error.__cause__ = exc
            self.ranks.agree(error, f"checkpoint commit of {what}", background=background)
        except BaseException:
            self._spread = None  # raised on every rank alike (an async save's next save waits for this first)
            raise

    def _spread_start(self, flat: dict[str, Any], values: list[Any], plain: bool, path: Path, writer: HashingWriter,
                      then: Callable[[Written], None] | None, what: str, label: str, rank: int) -> None:
        """A collective async save by :mod:`~areal_lightning.write.spread`: this rank's part
        staged into host buffers of its layout (made once) and written in the engine's
        background thread, as :meth:`_spread_finish` (``then`` after it on rank 0). Every rank
        agrees that it can start before any starts (a failure here is raised on all, and no
        rank's background thread is left waiting for another's)."""
        part, written = self._spread, writer.checksums.written
        error: BaseException | None = None
        try:
            tensors = dict(zip((entry[0] for entry in part.layout.key), (values[i] for i in part.positions)))
            buffers = self._host_buffers(part.layout)
            uploads = self._uploads()
            device, ready = _training_queue()
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = CheckpointWriteError(f"checkpoint save to {what} failed to start: {exc!r}")
            error.__cause__ = exc
        self.ranks.agree(error, f"checkpoint save to {what} (start)")
        skeleton = flat[SKELETON_KEY] if rank == 0 else None
        staged: Future = Future()

        def job() -> None:
            failure: BaseException | None = None
            try:
                self._stage(buffers, tensors, plain, device, ready)
            except BaseException as exc:  # noqa: BLE001 - this rank's failure, raised on every rank below
                staged.set_exception(exc)
                failure = exc
            else:
                staged.set_result(None)
            # then runs after the job, on rank 0 (_then below)
            self._spread_finish(part, direct.tensors_of(buffers, plain=True), skeleton, path, written, device, what,
                                rank, None, background=True, error=failure)

        upload = uploads.submit(job)
        self._worker.track(label, _then(upload, then, what, written), staged)
        self.last_written = written  # filled in as the background save runs
        _IN_FLIGHT[_key(label)] = self._worker

    def _staged_save(self, flat: dict[str, Any], path: Path, layout: direct.ByteLayout,
                     writer: HashingWriter, plain: bool = False) -> tuple[Future, Future]:
        """Start an async save that needs no plan: in this engine's background thread, the
        copy into staging buffers made once per layout (the checkpoint process's segment, or
        host buffers, pinned on CUDA), then the files, written by the checkpoint process or
        by this process's writer threads. ``plain``: ``flat``'s tensors are plain (see
        :meth:`_signature`): copied into the buffers by :class:`~areal_lightning.write.direct.StagingCopy`.
        Returns the staging and the save futures."""
        process = self._process if self.async_executor == "process" else None
        device, ready = _training_queue()
        staged: Future = Future()

        def job() -> None:
            try:
                bind_thread_to(device)  # before the buffers: the segment is pinned on the training thread's device
                buffers = process.buffers(layout) if process is not None else self._host_buffers(layout)
                self._stage(buffers, flat, plain, device, ready)
            except BaseException as exc:
                staged.set_exception(exc)
                raise
            staged.set_result(None)
            skeleton = direct.skeleton_bytes(flat[SKELETON_KEY])
            if process is not None:
                process.save(path, skeleton, writer.checksums.written)
            else:
                direct.save(direct.tensors_of(buffers, plain=True), skeleton, path, layout, writer.checksums.written,
                            device=device)

        return staged, self._uploads().submit(job)

    def _stage(self, buffers: dict[str, torch.Tensor], tensors: Mapping[str, Any], plain: bool, device: Any,
               ready: Any) -> None:
        """In the engine's background thread: copy ``tensors`` (the buffers' keys, in their order)
        into ``buffers``, by one :class:`~areal_lightning.write.direct.StagingCopy` where they
        are ``plain`` host tensors, else one ``copy_`` each (on CUDA on the engine's copy stream,
        after the event ``ready`` of :func:`_training_queue`)."""
        bind_thread_to(device)
        if device is not None and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        if plain and device is None and direct.STAGING_COPY:
            self._staging_copy(buffers)(tensors)
        else:
            copy_into(buffers, tensors, ready=ready, stream=self._copy_stream if device is not None else None)

    def _host_buffers(self, layout: direct.ByteLayout) -> dict[str, torch.Tensor]:
        """Host buffers of ``layout``'s tensors, made on its first async save (pinned on CUDA)."""
        if self._buffers is None or self._buffers[0] is not layout:
            self._buffers = self._copy_into = None  # the old ones go before the new ones are made
            pin = pin_buffers()
            self._buffers = (layout, {key: torch.empty(shape, dtype=dtype, pin_memory=pin)
                                      for key, shape, dtype, _, _ in layout.key})
        return self._buffers[1]

    def _staging_copy(self, buffers: dict[str, torch.Tensor]) -> direct.StagingCopy:
        """The :class:`~areal_lightning.write.direct.StagingCopy` into ``buffers`` (this
        engine's host buffers or the checkpoint process's segment of the layout; made at their
        first use, kept while they are the ones staged into)."""
        if self._copy_into is None or self._copy_into[0] is not buffers:
            self._copy_into = None
            self._copy_into = (buffers, direct.StagingCopy(buffers))
        return self._copy_into[1]

    def _signature(self, flat: dict[str, Any], pinned: bool | None,
                   signatures: direct.Signatures | None = None) -> tuple[tuple[Any, ...] | None, bool]:
        """:func:`~areal_lightning.write.direct.signature` of ``flat``, by
        :class:`~areal_lightning.write.direct.Signatures`: one check of its tensors while they
        stay alike (the skeleton set aside meanwhile, then put back last). ``pinned``: an async
        save's (where its bytes are staged from); ``None``: a sync save, which writes from the
        tensors themselves, whose pinning the check does not cover: read from each one where
        this process can pin memory, else known (none is pinned). Also returns whether
        ``flat``'s tensors are known to be contiguous host tensors with a storage, in order."""
        if pinned is None:
            if pinning_possible():
                return direct.signature(flat, None), False
            pinned = False
        signatures = signatures or self._signatures  # another one for sharded tensors' local chunks
        skeleton = flat.pop(SKELETON_KEY, _NO_SKELETON)
        try:
            key = signatures(flat, pinned)
        finally:
            if skeleton is not _NO_SKELETON:
                flat[SKELETON_KEY] = skeleton
        return key, key is not None and signatures.plain

    def _direct_layout(self, flat: dict[str, Any], pinned: bool | None = None) -> tuple[direct.ByteLayout | None, bool]:
        """The layout of a save of ``flat`` that needs no plan (reused while the keys, shapes
        and dtypes stay), or ``None`` when DCP must plan it; and whether ``flat``'s tensors are
        plain (see :meth:`_signature`)."""
        key, plain = self._signature(flat, pinned)
        if key is None:
            return None, False
        if self._layout is None or self._layout.key != key:
            self._layout = direct.ByteLayout(key, self.thread_count)
        return self._layout, plain

    def _write(self, flat: dict[str, Any], path: Location, writer: HashingWriter, collective: bool, *,
               background: bool) -> None:
        """Save ``flat`` to ``path``: by :mod:`~areal_lightning.write.direct` when it is a
        rank-local save of plain tensors to a local folder (its layout cached between saves),
        else by DCP through ``writer``; what was written goes to ``writer.checksums.written``."""
        if not collective and isinstance(path, Path):
            layout, plain = self._direct_layout(flat)
            if layout is not None:
                direct.save(direct.tensors_of(flat, plain), direct.skeleton_bytes(flat[SKELETON_KEY]), path, layout,
                            writer.checksums.written, device=writer.device)
                return
        save_flat_state_dict(flat, writer, self._planner(), **self._dist_kwargs(background=background))

    # -- waits: one vocabulary (the same words in DCPCheckpointIO and RecoverCallback) --------
    #   wait_for_staging()   the live tensors may change again (an async save's host copy is done)
    #   wait()               durable and committed; raises this rank's failure
    #   wait_all(what)       wait() on every rank, then a failure on any rank is raised on all
    #   wait_quietly(path)   durable or failed, the failure kept for the next raising call; also
    #                        waits for another engine of this process still writing ``path``

    def wait_for_staging(self) -> None:
        """Return once the in-flight async save no longer reads the live tensors."""
        self._worker.wait_for_staging()

    def wait(self) -> None:
        """Return once the in-flight save is durable; raise its (or a stored) failure."""
        self._worker.wait()

    @contextlib.contextmanager
    def checked_before(self, path: PathLike, files: Iterable[str]) -> Iterator[None]:
        """Within: a load of ``path`` reads the items of its data ``files`` (names in the folder)
        without checking their CRC32Cs again; the caller checked every one just before and
        nothing writes there meanwhile (a memory-tier slot, checked by
        :meth:`~areal_lightning.commit.memory_tier.MemoryTier.choose` before every rank agreed on
        it: its bytes are read once more, not hashed twice). Items of other files are checked."""
        self._checked = (location(path), frozenset(files))
        try:
            yield
        finally:
            self._checked = None

    def wait_quietly(self, path: PathLike | None = None) -> None:
        """Wait for the save in flight (and its ``then``), and for another engine of this
        process still writing ``path``; keep a failure for the next raising call."""
        self._worker.join()
        owner = _IN_FLIGHT.get(_key(path)) if path is not None else None
        if owner is not None and owner.in_flight is not None:
            owner.join()

    def wait_all(self, what: str) -> None:
        """Collective when saves are: every rank waits for its save in flight, then all
        agree that every one succeeded, so a failure on any rank (e.g. rank 0's publish of
        an async save, which only rank 0 runs) is raised on every rank."""
        error: BaseException | None = None
        try:
            self._worker.wait()
        except CheckpointWriteError as exc:
            error = exc
        if self.is_collective():
            self.ranks.agree(error, what)
        elif error is not None:
            raise error

    def load(
        self,
        path: PathLike,
        *,
        template: Mapping[str, Any] | None = None,
        weights_only: bool | None = None,
        read_threads: int = READ_THREADS,
    ) -> dict[str, Any]:
        """Read the checkpoint at ``path`` back into its saved structure.

        Waits for an in-flight save first (its failure stays stored for the next save).
        ``template``: optional nested dict whose tensors (by dotted path) are loaded in
        place; all other tensors are allocated on CPU from the saved metadata.
        ``weights_only`` is applied to the skeleton as ``torch.load`` would. ``read_threads``:
        files read at once (1 bounds the memory of the read buffers to one item's)."""
        self.wait_quietly(path)  # also another engine of this process still writing it
        self.last_per_rank = {}
        path = check_complete(path, self.storage_options)
        reader = reader_of(path, self.storage_options, threads=read_threads)
        if self._checked is not None and path == self._checked[0]:
            reader.checked_files = self._checked[1]
        try:
            metadata = reader.read_metadata()
        except Exception as exc:
            raise CheckpointCorruptError(f"{path}/{COMMIT_MARKER} is unreadable: {exc!r}") from exc
        entries = metadata.state_dict_metadata
        if not isinstance(entries.get(SKELETON_KEY), BytesStorageMetadata):
            raise CheckpointCorruptError(
                f"{path} is a DCP checkpoint but was not written by areal_lightning (no "
                f"{SKELETON_KEY!r} entry); load it with torch.distributed.checkpoint directly"
            )
        given = flat_tensors(template) if template is not None else {}
        flat: dict[str, Any] = {SKELETON_KEY: None}
        allocated: set[str] = set()
        grouped = dist.is_available() and dist.is_initialized()
        own, other_world = replicas.restore_per_rank(entries, dist.get_rank() if grouped else 0,
                                                     dist.get_world_size() if grouped else 1)
        replicas.warn_world_change(other_world)
        replaced = set(own.values())
        for fqn, md in entries.items():
            if replicas.is_per_rank_key(fqn) and fqn not in own:
                continue  # another rank's copy (or rank 0's usual key serves this run)
            if fqn in replaced:
                continue  # this rank reads its own copy instead
            if isinstance(md, TensorStorageMetadata):
                if fqn in own and own[fqn] in given:  # this rank's copy, straight into the template
                    flat[fqn] = given[own[fqn]]
                    continue
                if fqn in given:
                    flat[fqn] = given[fqn]
                else:  # placeholder (not touched): the read tensor replaces it
                    flat[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
                    allocated.add(fqn)
        # a sharded tensor none of which this rank holds (a rank-local save has no record of it): given back as it is
        held_nowhere = {fqn: value for fqn, value in given.items()
                        if fqn not in flat and hasattr(value, "local_shards") and not value.local_shards()}
        planner = TemplateLoadPlanner(weights_only, allocated)
        self.last_read = reader.stats
        try:
            reads = direct.whole_reads(metadata, flat) if isinstance(path, Path) else None
            if reads is not None:  # every tensor whole into its own destination: nothing to plan
                planner.state_dict = flat  # what DCP's set_up_planner keeps (store_bytes fills it)
                reader.read_whole(reads, planner)
            else:
                # Always rank-local: every rank reads the shared directory into its own template
                # (DCP reshards from the saved chunks), so loads need no collective.
                load_flat_state_dict(flat, reader, planner)
        except UsageError:
            raise  # the caller's template, not the checkpoint
        except (Exception, CheckpointException) as exc:
            if reader.failure is not None:
                raise reader.failure from None
            if planner.refused is not None:
                raise pickle.UnpicklingError(
                    f"{path}: the checkpoint's non-tensor state is refused by weights_only={weights_only!r} "
                    f"(torch.load's default is True); pass weights_only=False if the checkpoint comes from "
                    f"trusted storage, or allowlist the type with torch.serialization.add_safe_globals. "
                    f"{planner.refused}"
                ) from planner.refused
            raise CheckpointCorruptError(f"failed to read checkpoint {path}: {exc!r}") from exc
        flat.update(held_nowhere)
        skeleton = flat.pop(SKELETON_KEY)
        for fqn, usual in own.items():
            flat[usual] = flat.pop(fqn)
        self.last_per_rank = {usual: flat[usual] for usual in own.values()}
        return unflatten(skeleton, flat)

    def remove(self, path: PathLike) -> None:
        """Delete the checkpoint at ``path``; waits first if it is the save in flight."""
        path = location(path)
        if self._worker.in_flight == str(path):
            self._worker.join()
        if isinstance(path, str):
            fs = filesystem(path, self.storage_options)
            if fs.exists(strip(fs, path)):
                fs.rm(strip(fs, path), recursive=True)
        elif path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    def close(self) -> None:
        """Wait for the save in flight (joining its thread), free staging buffers and cached
        plans, end the checkpoint process groups, raise any stored failure."""
        try:
            self._worker.close()
        finally:
            if self._process is not None:  # first: it dies with the upload thread that started it
                self._process.close()
                self._process = None
            if self._upload_thread is not None:
                self._upload_thread.shutdown(wait=True)
                self._upload_thread = None
            for key in self._plan_keys:
                drop_plan_cache(key)
            self._plan_keys.clear()
            self._checked_plans.clear()
            self._layout = self._buffers = self._copy_into = self._copy_stream = self._spread = None
            self.ranks.close()

    def _planner(self) -> CachingSavePlanner:
        """The save planner, its plan cache keyed by this engine and the save's kind (rank-local
        or collective, and the world size): every rank of a collective save uses its own
        engine's key, and engines are made and used in the same order on every rank."""
        world = dist.get_world_size() if self.is_collective() else 1
        key = f"areal_lightning:{self._serial}:{world}"  # never reused: a new engine starts uncached on every rank
        self._plan_keys.add(key)
        return CachingSavePlanner(key, self._checked_plans)

    def _uploads(self) -> ThreadPoolExecutor:
        """The one background thread that runs this engine's async saves (DCP's save of the
        staged copy, then ``then``); made on first use, ended by :meth:`close`."""
        if self._upload_thread is None:
            self._upload_thread = ThreadPoolExecutor(1, thread_name_prefix="areal-dcp-save")
        return self._upload_thread

    def is_collective(self) -> bool:
        """Whether saves are collective now (``collective`` and more than one rank)."""
        return self.collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _dist_kwargs(self, *, background: bool) -> dict[str, Any]:
        if not (dist.is_available() and dist.is_initialized()):
            return {"no_dist": True}
        if not self.is_collective():
            # Rank-local call (DCP's exchanges are skipped; the background one names its group).
            return {"no_dist": True, "process_group": self.ranks.local_group if background else None}
        # DCP's exchanges run on the dedicated gloo groups, bounded by their timeout: sync
        # saves on the training thread's, async ones on the background one (the training
        # thread's agreements may run meanwhile).
        return {"process_group": self.ranks.background_group if background else self.ranks.group}
