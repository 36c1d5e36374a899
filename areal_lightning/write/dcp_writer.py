"""Write: DCP's storage writer and save planner of the engine. :class:`HashingWriter` writes each
rank's files with every item's CRC32C computed as it is written (``.metadata``, which records
the checksums, is written last by DCP; committing the folder is :mod:`areal_lightning.commit`'s);
:class:`CachingSavePlanner` keeps DCP's plans across saves and notices a dtype change."""

from __future__ import annotations


import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
)
from torch.distributed.checkpoint.planner import (
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
    cached_save_plan,
    send_changed_plan,
    set_plan_cache_key,
    storage_info,
)
from areal_lightning.collective import DEFAULT_TIMEOUT_S
from areal_lightning.errors import CheckpointWriteError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.stage.host import bind_thread_to, cuda_device
from areal_lightning.write.checksum import (
    ChecksumLog,
    HashingStream,
    manifest_of,
)
from areal_lightning.write.durable import fsync_dir
from areal_lightning.write.raw import RAW_DESCRIPTOR, is_plain, resolved, tensor_bytes

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# DCP storage with commit marker and fault points


class HashingWriter(FileSystemWriter):
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
                        tensor = resolved(data)
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


class CachingSavePlanner(DefaultSavePlanner):
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
