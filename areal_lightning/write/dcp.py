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
    :mod:`areal_lightning.write.process`); every other save is planned and written by DCP,
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
    ``wait_for_staging()`` returns once the async host copy is done (call it before the next
    optimizer step mutates weights); ``wait()`` returns once the save is durable and its
    ``then`` ran; ``remove(path)`` deletes a checkpoint (waiting first if it is the one being
    written); ``close()`` waits, re-raises a pending failure and frees the staging buffers.

Rules
    At most one job in flight per engine: a new save, a load, a remove of the in-flight
    path and ``close`` first wait for it. A background failure (including DCP's
    ``CheckpointException``, a ``BaseException``, and a failure of ``then``) is stored and
    raised once, as :class:`CheckpointWriteError` naming the save, by the next ``save``,
    ``wait``, ``raise_if_failed`` or ``close`` -- never swallowed.

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
    is raised on all, see :mod:`areal_lightning.collective`); DCP's own exchanges run on the
    dedicated gloo groups of ``engine.ranks`` with their own timeout (sync saves on the
    training thread's group, async saves on the background one). Loads are always
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
import io
import itertools
import logging
import os
import pickle
import shutil
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from areal_lightning._fault import fault_enabled, fault_point
from areal_lightning._torch_internals import (
    DATA_SUFFIX,
    FsspecFileSystem,
    cached_save_plan,
    drop_plan_cache,
    load_flat_state_dict,
    quiet_dcp_debug_log,
    save_flat_state_dict,
    send_changed_plan,
    set_plan_cache_key,
    storage_info,
)
from areal_lightning.collective import DEFAULT_TIMEOUT_S, CheckpointGroup
from areal_lightning.errors import CheckpointCorruptError, CheckpointNotFoundError, CheckpointWriteError, ConfigError, PathOccupiedError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.objectstore import filesystem, is_remote, strip
from areal_lightning.stage.host import bind_thread_to, copy_into, cuda_device, pin_buffers
from areal_lightning.stage.worker import BackgroundWorker
from areal_lightning.write.checksum import (
    ITEM_CHECKSUM,
    ChecksumLog,
    crc32c,
    HashingStream,
    Written,
    check_item,
    manifest_of,
    read_item,
)
from areal_lightning.write.dcp_format import (
    SKELETON_KEY,
    SlotUnpickler,
    fill,
    flat_tensors,
    slot_globals,
    split,
)
from areal_lightning.write import direct, replicas
from areal_lightning.write.durable import fsync_dir
from areal_lightning.write.process import ASYNC_EXECUTORS, CheckpointProcess
from areal_lightning.write.raw import RAW_DESCRIPTOR, is_plain, is_raw, read_into, tensor_bytes

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

# DCP warns on every rank-local save/load that it "assumes the intent" of a single process;
# that is exactly our intent, so this one message is silenced (nothing else is).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


_ENGINES = itertools.count()
"""Serial numbers of this process's engines (their plan-cache keys)."""

# Async saves in flight in this process, by absolute path: a load of that path from another
# engine (e.g. a new Trainer's DCPCheckpointIO) waits for it instead of finding no marker.
_IN_FLIGHT: "weakref.WeakValueDictionary[str, BackgroundWorker]" = weakref.WeakValueDictionary()




# --------------------------------------------------------------------------------------
# Where a checkpoint lives: a local folder (Path) or an object-store prefix (str URI)

Location = Union[Path, str]
"""A checkpoint directory: a local ``Path``, or an object-store URI (``s3://...``) as ``str``."""


def location(path: PathLike) -> Location:
    """``path`` as a :data:`Location`: a supported object-store URI stays a ``str``, anything else is a ``Path``."""
    return path if isinstance(path, str) and is_remote(path) else Path(path)


def _key(path: PathLike) -> str:
    """The identity of a checkpoint path in this process (absolute for local paths)."""
    return path if isinstance(path, str) and is_remote(path) else os.path.abspath(path)


class _ObjectFileSystem(FsspecFileSystem):
    """torch's fsspec ``FileSystem`` for object stores: our file system instance (with the
    caller's ``storage_options``), and no ``makedirs`` (object stores have no folders, and
    s3fs's may call ``CreateBucket``, which least-privilege credentials refuse)."""

    def __init__(self, storage_options: Mapping[str, Any]) -> None:
        super().__init__()
        self._options = dict(storage_options)

    def init_path(self, path: Any, **kwargs: Any) -> Any:
        self.fs = filesystem(str(path), self._options)
        return str(path)

    def mkdir(self, path: Any) -> None:
        """Nothing to create on an object store."""

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Any:
        """The object ``path`` opened in ``mode``. A write that fails is *discarded*: its
        multipart upload is aborted and no object appears (closing the file, as torch's
        fsspec stream does on an error, would upload the truncated buffer as an object)."""
        stream = self.fs.open(str(path), mode)
        if not any(ch in mode for ch in "wax+"):
            with stream:
                yield stream
            return
        upload = _Upload(stream)
        try:
            yield upload
        except BaseException as exc:
            stream.discard()  # s3fs: aborts the multipart upload; nothing is uploaded at close
            stream.closed = True
            if upload.error is not None and upload.error is not exc:
                # torch.save's zip writer reports a failed write as "unexpected pos": the cause is this
                raise upload.error from exc
            raise
        stream.close()


class _Upload:
    """An object being written: keeps the first error of a ``write`` (a failed part upload),
    which ``torch.save``'s zip writer would otherwise replace by its own message, and reports
    the fault point ``objectstore.mid_upload`` once the first part of a multipart upload is
    sent (the object is then incomplete and invisible)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._watch = fault_enabled()
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            written = self._raw.write(data)
            if self._watch and getattr(self._raw, "parts", None):
                self._watch = False
                fault_point("objectstore.mid_upload")
        except BaseException as exc:
            self.error = self.error or exc
            raise
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _on_object_store(storage: Any, path: Location, storage_options: Mapping[str, Any]) -> None:
    """Point a DCP ``FileSystemWriter``/``Reader`` at the object-store prefix ``path`` (what
    torch's ``FsspecWriter``/``FsspecReader`` do, with :class:`_ObjectFileSystem`)."""
    storage.fs = _ObjectFileSystem(storage_options)
    storage.path = storage.fs.init_path(path)


# --------------------------------------------------------------------------------------
# DCP storage with commit marker and fault points


class _CommitWriter(FileSystemWriter):
    """``FileSystemWriter`` that checksums every item in the writer threads as it is written
    (:mod:`areal_lightning.write.checksum`), fsyncs the directory after DCP's atomic
    ``.metadata`` rename and exposes the engine's fault points. Nothing else runs inside
    DCP's save: publishing (a commit target's ``finalize``) runs after ``dcp.save`` returned.

    ``checksums.written`` says what this rank wrote; on the coordinator its ``files`` is the
    manifest, built from DCP's item table and the hashed ``.metadata`` (no file is read)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = cuda_device()  # of the training thread (an async save runs in a background thread)
        self.checksums = ChecksumLog()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        bind_thread_to(self.device)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        fault_point("engine.after_staging")

    @contextlib.contextmanager
    def _hashed(self, on_closed: Callable[[str, HashingStream], None],
                errors: list[BaseException] | None = None) -> Any:
        """For the duration of the block, every stream this writer's FileSystem creates is a
        :class:`HashingStream`, handed to ``on_closed(name, stream)`` once written and closed.
        An error while one is opened, written or closed is appended to ``errors`` (then raised
        on); once there is one, no further stream of the save is opened, and the block waits
        until the streams still open in other writer threads are closed (torch returns from
        a failed save without joining its writer threads)."""
        create_stream = self.fs.create_stream
        open_streams = threading.Condition()
        count = [0]

        @contextlib.contextmanager
        def hashing(path: Any, mode: str) -> Any:
            if errors:
                raise CheckpointWriteError(f"{path}: not written, the save already failed: {errors[0]!r}")
            with open_streams:
                count[0] += 1
            try:
                with create_stream(path, mode) as raw:
                    stream = HashingStream(raw)
                    yield stream
                    stream.close()
                on_closed(Path(path).name, stream)
            except BaseException as exc:
                if errors is not None:
                    errors.append(exc)
                raise
            finally:
                with open_streams:
                    count[0] -= 1
                    open_streams.notify_all()

        self.fs.create_stream = hashing  # this writer's own FileSystem, for this call only
        try:
            yield
        except BaseException:
            with open_streams:  # the other writer threads' files: finished (or failed) before the save fails
                open_streams.wait_for(lambda: count[0] == 0, timeout=DEFAULT_TIMEOUT_S)
            raise
        finally:
            del self.fs.create_stream

    def write_data(self, plan: Any, planner: Any) -> Any:
        # The files are written by this writer's threads (an async save runs this in a
        # background thread), ``thread_count`` files per rank: byte items first, then tensor
        # items as raw bytes (:mod:`areal_lightning.write.raw`). Every error of a file's write
        # is kept and re-raised once the other files are finished, and the items written are
        # counted against the plan, so the save fails as a whole. Fault point
        # "engine.after_shard_file" after each shard file is written, fsynced and closed: a
        # "kill" SIGKILLs the whole process from any thread.
        errors: list[BaseException] = []
        faults = fault_enabled()

        def closed(name: str, stream: HashingStream) -> None:
            self.checksums.add(name, stream)
            if faults:
                fault_point("engine.after_shard_file")

        with self._hashed(closed, errors):
            results = self._write_files(plan, planner, errors)
        if errors:
            raise errors[0]
        if len(results) != len(plan.items):
            raise CheckpointWriteError(f"{self.path}: the writer threads wrote {len(results)} of the "
                                       f"{len(plan.items)} items of this rank; a writer thread failed")
        self.checksums.attach(results)
        if self.checksums.written.unhashed:
            log.warning("%s: %d of %d items were written in a way this version cannot checksum; they are "
                        "checked by size only", self.path, self.checksums.written.unhashed,
                        self.checksums.written.items)
        done: TorchFuture = TorchFuture()
        done.set_result(results)
        return done

    def _write_files(self, plan: SavePlan, planner: SavePlanner, errors: list[BaseException]) -> list[WriteResult]:
        """Write this rank's items into ``thread_count`` files in parallel; their results."""
        prefix = plan.storage_data.prefix  # DCP's per-rank file prefix ("__{rank}_")
        buckets = _buckets(plan.items, self.thread_count)

        def write_file(index: int, items: list[WriteItem]) -> list[WriteResult]:
            name = f"{prefix}{index}{DATA_SUFFIX}"
            results = []
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
                for item in items:
                    data = planner.resolve_data(item)
                    offset = stream.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                        descriptors = None
                    else:
                        tensor = data.detach()
                        if not tensor.is_cpu:
                            tensor = tensor.cpu()
                        if is_plain(tensor):
                            stream.write(tensor_bytes(tensor.contiguous()))
                            descriptors = [RAW_DESCRIPTOR]
                        else:  # a quantized, sparse or subclass tensor: a torch.save item, as DCP writes one
                            if tensor.untyped_storage().nbytes() != tensor.nbytes:
                                tensor = tensor.clone()  # not the whole storage of a view
                            torch.save(tensor, stream)
                            descriptors = None
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=storage_info(name, offset, length, descriptors)))
                if self.sync_files:
                    stream.flush()
                    os.fsync(stream.fileno())
            return results

        with ThreadPoolExecutor(len(buckets), thread_name_prefix="areal-dcp-write") as pool:
            jobs = [pool.submit(write_file, index, items) for index, items in enumerate(buckets)]
        written: list[WriteResult] = []
        for job in jobs:
            if job.exception() is not None:
                if not errors:
                    errors.append(job.exception())
                continue
            written += job.result()
        return written

    def finish(self, metadata: Metadata, results: list) -> None:
        fault_point("engine.before_commit")
        streams: dict[str, HashingStream] = {}
        with self._hashed(streams.__setitem__):
            super().finish(metadata, results)
        if isinstance(self.path, Path):  # an object becomes visible complete, nothing to sync
            fsync_dir(self.path)
        (name, stream), = streams.items()  # the .metadata written (as a tmp file, then renamed)
        self.checksums.written.nbytes += stream.pos
        self.checksums.written.files = manifest_of(metadata.storage_data, stream, COMMIT_MARKER)
        fault_point("engine.after_commit")


class _CachingSavePlanner(DefaultSavePlanner):
    """DCP's save planner with plan caching (``enable_plan_caching=True``): when a rank's
    local plan is the one of its previous save, it sends an empty plan and the coordinator
    reuses the cached global plan and metadata (no plan gather, dedup or validation).

    Our dict is already flat: DCP must store the skeleton as ONE byte item, untouched (its
    flattening passes rebuild nested dicts with string keys). The cache is DCP's class-level
    one, under a key of this engine's (:meth:`DCPEngine.close` drops it); a plan equal to
    the cached one but for a tensor's dtype (which DCP's comparison ignores, and which the
    cached metadata would then misrecord) is sent as changed."""

    def __init__(self, cache_key: str, checked: dict[str, tuple[Any, dict[str, Any]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, enable_plan_caching=True)
        set_plan_cache_key(self, cache_key)
        self._key = cache_key
        self._checked = checked  # the engine's: cache key -> (cached plan, the dtypes it was checked for)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        if plan.usable:
            return plan
        cached = cached_save_plan(self)
        dtypes = {key: getattr(value, "dtype", None) for key, value in self.state_dict.items()}
        seen = self._checked.get(self._key)
        if seen is not None and seen[0] is cached and seen[1] == dtypes:
            return plan  # the dtypes this very cached plan was checked against: no second plan
        fresh = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        if _dtypes(fresh) == _dtypes(cached):
            self._checked[self._key] = (cached, dtypes)
            return plan
        send_changed_plan(self, fresh)
        return fresh


def _buckets(items: list[WriteItem], count: int) -> list[list[WriteItem]]:
    """``count`` files' items: byte items dealt in turn, then tensors largest first, each to
    the file with the fewest bytes so far (as DCP's ``FileSystemWriter`` splits them)."""
    buckets: list[list[WriteItem]] = [[] for _ in range(count)]
    sizes = [0] * count
    data = [item for item in items if item.type == WriteItemType.BYTE_IO]
    for i, item in enumerate(data):
        buckets[i % count].append(item)

    def nbytes(item: WriteItem) -> int:
        return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize

    for item in sorted((item for item in items if item.type != WriteItemType.BYTE_IO), key=nbytes, reverse=True):
        smallest = sizes.index(min(sizes))
        buckets[smallest].append(item)
        sizes[smallest] += nbytes(item)
    return buckets


def _dtypes(plan: SavePlan) -> list[Any]:
    return [item.tensor_data.properties.dtype if item.tensor_data is not None else None for item in plan.items]


def _load_trusted(value: io.BytesIO) -> Any:
    """Unpickle without restrictions: only when the caller passed ``weights_only=False``
    (e.g. ``RecoverCallback(weights_only=False)`` for storage it trusts)."""
    return torch.load(value, weights_only=False, pickle_module=_TRUSTED_PICKLE)


_TRUSTED_PICKLE = types.SimpleNamespace(Unpickler=SlotUnpickler, load=pickle.load, loads=pickle.loads,
                                        __name__="areal_lightning_trusted_pickle")
"""``torch.load``'s ``pickle_module`` for trusted loads: finds tensor slots under old names."""


class _TemplateLoadPlanner(DefaultLoadPlanner):
    """Loads the flat dict in place; unpickles the skeleton with the caller's
    ``weights_only`` (DCP's default planner always uses ``weights_only=False``).

    Entries named in ``allocated`` are placeholders the engine made from the metadata:
    a whole tensor read for one of them is adopted as is instead of copied into it."""

    def __init__(self, weights_only: bool | None, allocated: set[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._weights_only = weights_only
        self._allocated = allocated

        self.refused: pickle.UnpicklingError | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.store_bytes(read_item.dest_index.fqn, value)

    def store_bytes(self, fqn: str, value: io.BytesIO) -> None:
        """Unpickle the byte item ``fqn`` (the skeleton) with the caller's ``weights_only``."""
        try:
            with torch.serialization.safe_globals(slot_globals()):
                if self._weights_only is False:  # the caller's explicit choice (trusted storage)
                    obj = _load_trusted(value)
                else:  # None (default) and True: weights-only, whatever torch's default is
                    obj = torch.load(value, weights_only=True)
            self.state_dict[fqn] = obj
        except pickle.UnpicklingError as exc:
            self.refused = exc
            raise

    def load_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Store a tensor read from storage (already narrowed to ``read_item``)."""
        fqn = read_item.dest_index.fqn
        if fqn in self._allocated and tensor.shape == self.state_dict[fqn].shape:
            self.state_dict[fqn] = tensor
            return
        target = self.resolve_tensor(read_item).detach()
        target.copy_(tensor)
        self.commit_tensor(read_item, target)


def _narrowed(tensor: torch.Tensor, item: ReadItem) -> torch.Tensor:
    """The part of a saved chunk that ``item`` reads."""
    for dim, (begin, size) in enumerate(zip(item.storage_offsets, item.lengths)):
        if size < tensor.size(dim):
            tensor = tensor.narrow(dim, begin, size)
    return tensor


@dataclass
class Read:
    """What one rank read in a load: ``nbytes`` of checkpoint items, ``verified`` of them
    against their recorded CRC32C, in ``verify_s`` seconds of hashing."""

    nbytes: int = 0
    verified: int = 0
    verify_s: float = 0.0


_READ_THREADS = 4
"""Files read in parallel by one load (DCP writes ``thread_count`` files per rank)."""


class _AdoptingReader(FileSystemReader):
    """``FileSystemReader`` that reads its files in parallel, each in offset order, verifies
    every item's bytes as it reads them (:func:`~areal_lightning.write.checksum.read_item`
    and ``check_item``: length and CRC32C, naming the file and the key), and hands every
    loaded tensor to
    :meth:`_TemplateLoadPlanner.load_tensor`, so tensors the engine allocated are not copied
    a second time (DCP's reader always copies into the template)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats = Read()
        self.failure: CheckpointCorruptError | None = None
        self.threads = _READ_THREADS  # files read at once (1: one item's buffers at a time)
        self._metadata: Metadata | None = None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # each saved chunk's shape and dtype, by its storage index: what a raw item holds
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[(fqn, tuple(chunk.offsets))] = (chunk.sizes, md.properties.dtype)

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self._metadata = None
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``.metadata``, unpickled once per reader (``dcp.load`` asks again after the engine did)."""
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def chunk(self, index: Any) -> tuple[torch.Size, torch.dtype]:
        """The shape and dtype of the saved chunk at DCP's storage ``index`` (a ``MetadataIndex``)."""
        return self._chunks[(index.fqn, tuple(index.offset))]

    def _read_file(self, relative_path: str, entries: list[tuple[Any, ReadItem]], planner: LoadPlanner) -> Read:
        """Read, verify and load the items of one file, in offset order."""
        stats = Read()
        entries.sort(key=lambda entry: entry[0].offset)
        path = self.fs.concat_path(self.path, relative_path)
        with self.fs.create_stream(path, "rb") as file:
            for info, item in entries:
                key = item.storage_index.fqn
                try:
                    if item.type != LoadItemType.BYTE_IO and is_raw(info.transform_descriptors):
                        self._read_raw(file, path, info, item, planner, stats)
                        continue
                    data = read_item(file, path, info, key)
                    start = time.perf_counter()
                    stats.verified += check_item(data, path, info, key)
                    stats.verify_s += time.perf_counter() - start
                except CheckpointCorruptError as exc:
                    self.failure = self.failure or exc  # raised as itself by DCPEngine.load (DCP wraps it)
                    raise
                stats.nbytes += len(data)
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(data))
                    continue
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                planner.load_tensor(item, _narrowed(tensor, item))
        return stats

    def read_chunk(self, file: Any, path: Any, info: Any, index: Any,
                   target: torch.Tensor | None = None) -> tuple[torch.Tensor, memoryview]:
        """Read the raw item ``info`` (the saved chunk at storage ``index``) whole, into
        ``target`` (contiguous, on the CPU, of the chunk's shape and dtype; allocated when
        ``None``); returns the tensor and the view of its memory that was filled, whose CRC32C
        the caller checks. A recorded length that is not the chunk's size is refused."""
        sizes, dtype = self.chunk(index)
        if sizes.numel() * dtype.itemsize != info.length:
            raise CheckpointCorruptError(
                f"{path}: '{index.fqn}' is recorded as {info.length} bytes but its chunk {list(sizes)} of {dtype} "
                f"holds {sizes.numel() * dtype.itemsize}; the checkpoint's .metadata is damaged")
        if target is None:
            target = torch.empty(sizes, dtype=dtype)
        return target, read_into(file, target, path, info.offset, index.fqn)

    def _read_raw(self, file: Any, path: Any, info: Any, item: ReadItem, planner: LoadPlanner, stats: Read) -> None:
        """Read a raw tensor item into its destination's memory (one copy, from the page
        cache), check its CRC32C over that memory, then hand it to the planner. The item is
        read whole (its CRC covers it): into the destination when the destination is that
        whole chunk, contiguous, on the CPU and of its dtype, else into a scratch tensor
        narrowed and copied from."""
        key = item.storage_index.fqn
        sizes, dtype = self.chunk(item.storage_index)
        whole = not any(item.storage_offsets) and list(item.lengths) == list(sizes)
        dest = planner.resolve_tensor(item).detach() if whole else None
        direct = type(dest) is torch.Tensor and dest.is_cpu and dest.dtype == dtype and dest.is_contiguous()
        target, view = self.read_chunk(file, path, info, item.storage_index, dest if direct else None)
        start = time.perf_counter()
        stats.verified += check_item(view, path, info, key)
        stats.verify_s += time.perf_counter() - start
        stats.nbytes += info.length
        if direct:
            planner.commit_tensor(item, target)
        else:
            planner.load_tensor(item, _narrowed(target, item))

    def read_whole(self, per_file: dict[str, list[tuple[Any, str, Any]]], planner: "_TemplateLoadPlanner") -> None:
        """A load that needs no planning (:func:`~areal_lightning.write.direct.whole_reads`):
        each raw item read into its destination tensor and checked there, the skeleton
        unpickled by ``planner``; the files in parallel, each in offset order."""

        def read_file(name: str, entries: list[tuple[Any, str, Any]]) -> Read:
            stats = Read()
            entries.sort(key=lambda entry: entry[0].offset)
            path = self.fs.concat_path(self.path, name)
            with self.fs.create_stream(path, "rb") as file:
                for info, key, dest in entries:
                    if not info.length and dest is not None:
                        continue  # an empty tensor: nothing to read (as DCP's reader)
                    try:
                        if dest is None:
                            data = read_item(file, path, info, key)
                        else:
                            if dest.nbytes != info.length:
                                raise CheckpointCorruptError(
                                    f"{path}: '{key}' is recorded as {info.length} bytes but its tensor "
                                    f"{list(dest.shape)} of {dest.dtype} holds {dest.nbytes}; the checkpoint's "
                                    ".metadata is damaged")
                            data = read_into(file, dest, path, info.offset, key)
                        start = time.perf_counter()
                        stats.verified += check_item(data, path, info, key)
                        stats.verify_s += time.perf_counter() - start
                    except CheckpointCorruptError as exc:
                        self.failure = self.failure or exc
                        raise
                    stats.nbytes += info.length
                    if dest is None:
                        planner.store_bytes(key, io.BytesIO(data))
            return stats

        self._gather(per_file, read_file)

    def _gather(self, per_file: dict[str, list[Any]], read_file: Callable[[str, list[Any]], Read]) -> None:
        """Run ``read_file`` for every file, ``threads`` at once (reads and CRCs release the GIL), adding up their stats."""
        if len(per_file) <= 1 or self.threads == 1:
            results = [read_file(name, entries) for name, entries in per_file.items()]
        else:
            with ThreadPoolExecutor(min(len(per_file), self.threads), thread_name_prefix="areal-dcp-read") as pool:
                jobs = [pool.submit(read_file, name, entries) for name, entries in per_file.items()]
                results = [job.result() for job in jobs]
        for stats in results:
            self.stats.nbytes += stats.nbytes
            self.stats.verified += stats.verified
            self.stats.verify_s += stats.verify_s

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture:
        infos = [self.storage_data[item.storage_index] for item in plan.items]
        if not isinstance(planner, _TemplateLoadPlanner) or \
                any(info.transform_descriptors not in (None, [], [RAW_DESCRIPTOR]) for info in infos):
            return super().read_data(plan, planner)
        per_file: dict[str, list[tuple[Any, ReadItem]]] = {}
        for info, item in zip(infos, plan.items):
            per_file.setdefault(info.relative_path, []).append((info, item))
        self._gather(per_file, lambda name, entries: self._read_file(name, entries, planner))
        done: TorchFuture = TorchFuture()
        done.set_result(None)
        return done


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


def reader_of(path: PathLike, storage_options: Mapping[str, Any] | None = None,
              threads: int = _READ_THREADS) -> "_AdoptingReader":
    """This engine's DCP reader of the checkpoint at ``path`` (a local folder or an object-store
    prefix), reading ``threads`` files at once."""
    path = location(path)
    reader = _AdoptingReader(path)
    reader.threads = threads
    if isinstance(path, str):
        _on_object_store(reader, path, storage_options or {})
    return reader


def check_complete(path: PathLike, storage_options: Mapping[str, Any] | None = None) -> Location:
    """Return ``path`` as a :data:`Location` if it is a committed DCP directory, else raise
    ``FileNotFoundError`` (nothing there) or :class:`CheckpointCorruptError`."""
    path = location(path)
    if isinstance(path, str):
        fs = filesystem(path, storage_options)
        fs.invalidate_cache(strip(fs, path))
        if not fs.exists(strip(fs, f"{path.rstrip('/')}/{COMMIT_MARKER}")):
            if not fs.exists(strip(fs, path)):
                raise CheckpointNotFoundError(f"checkpoint not found: {path}")
            raise CheckpointCorruptError(
                f"{path} has no {COMMIT_MARKER}: the save was interrupted or the prefix is not a DCP checkpoint")
        return path
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint not found: {path}")
    if not path.is_dir():
        raise CheckpointCorruptError(
            f"{path} is a file, not a DCP checkpoint directory (was it written by Lightning's "
            "TorchCheckpointIO? load it without DCPCheckpointIO)"
        )
    if not (path / COMMIT_MARKER).is_file():
        raise CheckpointCorruptError(
            f"{path} has no {COMMIT_MARKER} commit marker: the save was interrupted or the "
            "directory is not a DCP checkpoint; delete it or load another checkpoint"
        )
    return path


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


# --------------------------------------------------------------------------------------
# Engine


def tensor_entries(path: PathLike, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The saved tensors of a complete checkpoint: flat key -> ``(size, dtype)``, in saved order."""
    path = check_complete(path, storage_options)
    try:
        metadata = reader_of(path, storage_options).read_metadata()
    except Exception as exc:
        raise CheckpointCorruptError(f"{path}/{COMMIT_MARKER} is unreadable: {exc!r}") from exc
    return {fqn: (tuple(md.size), md.properties.dtype) for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def read_tensors(path: PathLike, into: Mapping[str, torch.Tensor],
                 storage_options: Mapping[str, Any] | None = None) -> Read:
    """Read the tensors saved under the flat keys of ``into`` into those tensors (full size),
    each item verified against its CRC32C as it is read, without a process group; returns what
    was read. Only these items are read, one at a time, each straight into its tensor of
    ``into`` (a ``torch.save`` item of 0.2.0 and earlier: its bytes and the decoded tensor)."""
    path = check_complete(path, storage_options)
    reader = reader_of(path, storage_options, threads=1)
    try:
        load_flat_state_dict(dict(into), reader, _TemplateLoadPlanner(True, set()))
    except (Exception, CheckpointException) as exc:
        if reader.failure is not None:
            raise reader.failure from None
        raise CheckpointCorruptError(f"failed to read checkpoint {path}: {exc!r}") from exc
    return reader.stats


def write_stock_copy(path: PathLike, out: Path) -> Read:
    """Copy the complete checkpoint at ``path`` into the new folder ``out`` in the layout of
    torch's own ``FileSystemWriter`` (every tensor item a ``torch.save`` container), which a
    stock ``dcp.load`` with a plain ``FileSystemReader`` reads; same files, keys, chunks and
    skeleton, each item's CRC32C recorded as in our saves. Every item is verified as it is
    read, one at a time (memory: about twice the largest item). Returns what was read."""
    path = check_complete(path)
    reader = reader_of(path, threads=1)
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise CheckpointCorruptError(f"{path}/{COMMIT_MARKER} is unreadable: {exc!r}") from exc
    reader.set_up_storage_reader(metadata, True)
    stats = Read()
    per_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in metadata.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((index, info))
    out.mkdir(parents=True)
    storage: dict[Any, Any] = {}
    for name, entries in per_file.items():
        source = reader.fs.concat_path(reader.path, name)
        with reader.fs.create_stream(source, "rb") as file, open(out / name, "wb") as target:
            for index, info in sorted(entries, key=lambda entry: entry[1].offset):
                if is_raw(info.transform_descriptors):
                    tensor, view = reader.read_chunk(file, source, info, index)
                    check_item(view, source, info, index.fqn)
                    buffer = io.BytesIO()
                    torch.save(tensor, buffer)
                    data = buffer.getbuffer()
                else:
                    data = read_item(file, source, info, index.fqn)
                    check_item(data, source, info, index.fqn)
                stats.nbytes += info.length
                record = storage_info(name, target.tell(), len(data))
                setattr(record, ITEM_CHECKSUM, crc32c(data))
                target.write(data)
                storage[index] = record
            target.flush()
            os.fsync(target.fileno())
    metadata.storage_data = storage
    with open(out / COMMIT_MARKER, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(out)
    return stats


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
        self._layout: direct.Layout | None = None  # of the last rank-local save of plain tensors
        self._buffers: tuple[direct.Layout, dict[str, torch.Tensor]] | None = None  # its async staging buffers
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
        mine: dict[str, tuple] = {}
        try:
            self._worker.wait()
            fault_point("engine.before_staging")
            if prepare is not None:
                prepare()
            flat = split(state)
            if rank != 0:
                # Collective save: rank 0's skeleton describes the checkpoint; the others'
                # contribute tensors only (DCP would keep one arbitrary rank's byte item).
                flat.pop(SKELETON_KEY)
            if collective:  # which replicated tensors are not equal on every rank (write/replicas.py)
                mine = replicas.fingerprints(flat)
            if isinstance(path, str):  # object store: a fresh generation prefix, no folders to make
                writer = _CommitWriter(path, single_file_per_rank=True, sync_files=False,
                                       thread_count=self.thread_count)
                _on_object_store(writer, path, self.storage_options if storage_options is None else storage_options)
            else:
                _invalidate(path, withdraw_marker=rank == 0)
                writer = _CommitWriter(path, single_file_per_rank=True, sync_files=True,
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
            replicas.store_per_rank(flat, replicas.differing(gathered), rank, len(gathered))
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
            layout = None
            if not collective and isinstance(path, Path):
                if self.async_executor == "process":
                    if self._process is None:
                        self._process = CheckpointProcess(self.thread_count)
                    layout = self._process.layout_for(flat)
                else:
                    layout = self._direct_layout(flat, pinned=pin_buffers())
            if layout is not None:  # a save that needs no plan: staged into buffers of its layout
                staged, upload = self._staged_save(flat, path, layout, writer)
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

    def _staged_save(self, flat: dict[str, Any], path: Path, layout: direct.Layout,
                     writer: _CommitWriter) -> tuple[Future, Future]:
        """Start an async save that needs no plan: in this engine's background thread, the
        copy into staging buffers made once per layout (the checkpoint process's segment, or
        host buffers, pinned on CUDA), then the files, written by the checkpoint process or
        by this process's writer threads. Returns the staging and the save futures."""
        process = self._process if self.async_executor == "process" else None
        device = cuda_device()
        ready = None
        if device is not None:
            ready = torch.cuda.Event()
            ready.record()  # on the caller's current stream: what training queued so far
        staged: Future = Future()

        def job() -> None:
            try:
                bind_thread_to(device)
                if device is not None and self._copy_stream is None:
                    self._copy_stream = torch.cuda.Stream()
                buffers = process.buffers(layout) if process is not None else self._host_buffers(layout)
                copy_into(buffers, flat, ready=ready, stream=self._copy_stream if device is not None else None)
            except BaseException as exc:
                staged.set_exception(exc)
                raise
            staged.set_result(None)
            skeleton = direct.skeleton_bytes(flat[SKELETON_KEY])
            if process is not None:
                process.save(path, skeleton, writer.checksums.written)
            else:
                direct.save(direct.tensors_of(buffers), skeleton, path, layout, writer.checksums.written,
                            device=device)

        return staged, self._uploads().submit(job)

    def _host_buffers(self, layout: direct.Layout) -> dict[str, torch.Tensor]:
        """Host buffers of ``layout``'s tensors, made on its first async save (pinned on CUDA)."""
        if self._buffers is None or self._buffers[0] is not layout:
            self._buffers = None  # the old ones go before the new ones are made
            pin = pin_buffers()
            self._buffers = (layout, {key: torch.empty(shape, dtype=dtype, pin_memory=pin)
                                      for key, shape, dtype, _, _ in layout.key})
        return self._buffers[1]

    def _direct_layout(self, flat: Mapping[str, Any], pinned: bool | None = None) -> direct.Layout | None:
        """The layout of a save of ``flat`` that needs no plan (reused while the keys, shapes
        and dtypes stay), or ``None`` when DCP must plan it."""
        key = direct.signature(flat, pinned)
        if key is None:
            return None
        if self._layout is None or self._layout.key != key:
            self._layout = direct.Layout(key, self.thread_count)
        return self._layout

    def _write(self, flat: dict[str, Any], path: Location, writer: _CommitWriter, collective: bool, *,
               background: bool) -> None:
        """Save ``flat`` to ``path``: by :mod:`~areal_lightning.write.direct` when it is a
        rank-local save of plain tensors to a local folder (its layout cached between saves),
        else by DCP through ``writer``; what was written goes to ``writer.checksums.written``."""
        if not collective and isinstance(path, Path):
            layout = self._direct_layout(flat)
            if layout is not None:
                direct.save(direct.tensors_of(flat), direct.skeleton_bytes(flat[SKELETON_KEY]), path, layout,
                            writer.checksums.written, device=writer.device)
                return
        save_flat_state_dict(flat, writer, self._planner(), **self._dist_kwargs(background=background))

    def wait_for_staging(self) -> None:
        """Return once the in-flight async save no longer reads the live tensors."""
        self._worker.wait_for_staging()

    def wait(self) -> None:
        """Return once the in-flight save is durable; raise its (or a stored) failure."""
        self._worker.wait()

    def raise_if_failed(self) -> None:
        """Raise a stored background failure without waiting."""
        self._worker.raise_if_failed()

    def join(self, path: PathLike | None = None) -> None:
        """Wait for the save in flight (and its ``then``), and for another engine of this
        process still writing ``path``; keep a failure for the next raising call."""
        self._worker.join()
        owner = _IN_FLIGHT.get(_key(path)) if path is not None else None
        if owner is not None and owner.in_flight is not None:
            owner.join()

    def settle(self, what: str) -> None:
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
        read_threads: int = _READ_THREADS,
    ) -> dict[str, Any]:
        """Read the checkpoint at ``path`` back into its saved structure.

        Waits for an in-flight save first (its failure stays stored for the next save).
        ``template``: optional nested dict whose tensors (by dotted path) are loaded in
        place; all other tensors are allocated on CPU from the saved metadata.
        ``weights_only`` is applied to the skeleton as ``torch.load`` would. ``read_threads``:
        files read at once (1 bounds the memory of the read buffers to one item's)."""
        self.join(path)  # also another engine of this process still writing it
        self.last_per_rank = {}
        path = check_complete(path, self.storage_options)
        reader = reader_of(path, self.storage_options, threads=read_threads)
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
        planner = _TemplateLoadPlanner(weights_only, allocated)
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
        skeleton = flat.pop(SKELETON_KEY)
        for fqn, usual in own.items():
            flat[usual] = flat.pop(fqn)
        self.last_per_rank = {usual: flat[usual] for usual in own.values()}
        return fill(skeleton, flat)

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
            self._layout = self._buffers = self._copy_stream = None
            self.ranks.close()

    def _planner(self) -> _CachingSavePlanner:
        """The save planner, its plan cache keyed by this engine and the save's kind (rank-local
        or collective, and the world size): every rank of a collective save uses its own
        engine's key, and engines are made and used in the same order on every rank."""
        world = dist.get_world_size() if self.is_collective() else 1
        key = f"areal_lightning:{self._serial}:{world}"  # never reused: a new engine starts uncached on every rank
        self._plan_keys.add(key)
        return _CachingSavePlanner(key, self._checked_plans)

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
