"""Write: reading a DCP checkpoint back. :class:`TemplateLoadPlanner` loads into the caller's
template (tensors it has) or freshly allocated tensors and unpickles the skeleton (restricted
with ``weights_only``); :class:`AdoptingReader` reads a rank's files in parallel, each in
offset order, verifies every item's length and CRC32C as it is read and adopts a tensor read for
an engine-allocated slot as is; :func:`check_complete` refuses a folder without its marker.

A load of whole tensors from a local file (:meth:`AdoptingReader.read_whole`) reads each part of
the file into its tensors by one call of the compiled extension (:data:`ONE_PASS_READ`: adjacent
small items by one ``preadv``, each part checksummed right after its read while in the cache,
the GIL released), and a skeleton of plain types is unpickled by Python's compiled unpickler
restricted to types ``weights_only`` allows (:func:`~areal_lightning.write.dcp_format.load_plain`):
64 MB in 2,000 tensors loaded in 0.033 s against 0.066 s with a call or two per item in Python
and torch's Python weights-only unpickler."""

from __future__ import annotations


import contextlib
import gc
import io
import os
import pickle
import time
import types
from array import array
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future as TorchFuture

from areal_lightning.errors import CheckpointCorruptError, CheckpointNotFoundError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.objectstore import filesystem, strip
from areal_lightning.write.checksum import (
    ITEM_CHECKSUM,
    KERNEL,
    check_item,
    mismatch,
    one_pass,
    read_item,
    truncated,
)
from areal_lightning.write.dcp_format import (
    NOT_PLAIN,
    SlotUnpickler,
    load_plain,
    slot_globals,
)
from areal_lightning.write.raw import RAW_DESCRIPTOR, is_raw, read_into, shows_its_bytes
from areal_lightning.write.objectstore_fs import Location, location, on_object_store

PathLike = Union[str, "os.PathLike[str]"]


def _load_trusted(value: io.BytesIO) -> Any:
    """Unpickle without restrictions: only when the caller passed ``weights_only=False``
    (e.g. ``RecoverCallback(weights_only=False)`` for storage it trusts)."""
    return torch.load(value, weights_only=False, pickle_module=_TRUSTED_PICKLE)


_TRUSTED_PICKLE = types.SimpleNamespace(Unpickler=SlotUnpickler, load=pickle.load, loads=pickle.loads,
                                        __name__="areal_lightning_trusted_pickle")
"""``torch.load``'s ``pickle_module`` for trusted loads: finds tensor slots under old names."""


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused (then resumed, if it ran before). Unpickling the
    ``.metadata`` of 2,000 items makes about 10 objects per item, whose allocations start
    collections, now and then a full one, which scans every object of the process: in a fresh
    process with Lightning and transformers imported, at every 2,000-item load (0.24 s of its
    0.33 s, measured). The objects live until the load ends and are freed by their reference
    counts."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if running:
            gc.enable()


class TemplateLoadPlanner(DefaultLoadPlanner):
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
                    obj = load_plain(value.getvalue())  # plain types only: Python's compiled unpickler
                    if obj is NOT_PLAIN:
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


ONE_PASS_READ = one_pass("read")
"""Whether a load of whole tensors from a local file reads each part of the file into its
tensor and checksums it right after, while in the cache, by one call of the compiled extension
per file part (:meth:`AdoptingReader.read_whole`); else a read then a CRC32C pass per item, in
Python."""

_DATA_PTR = torch.Tensor.data_ptr
_NBYTES = attrgetter("nbytes")
_LENGTH = attrgetter("length")
_OFFSET = attrgetter("offset")

READ_THREADS = 4
"""Files read in parallel by one load (DCP writes ``thread_count`` files per rank)."""


class AdoptingReader(FileSystemReader):
    """``FileSystemReader`` that reads its files in parallel, each in offset order, verifies
    every item's bytes as it reads them (:func:`~areal_lightning.write.checksum.read_item`
    and ``check_item``: length and CRC32C, naming the file and the key), and hands every
    loaded tensor to
    :meth:`TemplateLoadPlanner.load_tensor`, so tensors the engine allocated are not copied
    a second time (DCP's reader always copies into the template)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stats = Read()
        self.failure: CheckpointCorruptError | None = None
        self.threads = READ_THREADS  # files read at once (1: one item's buffers at a time)
        self.split_files = True  # a whole load reads a file in parts at once where files < threads (local files)
        self.checked_files: frozenset[str] = frozenset()  # whose items the caller checked just before: not hashed
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
            with paused_gc():
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
                    self._check(data, path, info, key, stats)
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

    def _check(self, data: Any, path: Any, info: Any, key: str, stats: Read) -> None:
        """``check_item`` of an item's bytes (unless its file is one of :attr:`checked_files`),
        counted in ``stats``."""
        if info.relative_path not in self.checked_files:
            start = time.perf_counter()
            stats.verified += check_item(data, path, info, key)
            stats.verify_s += time.perf_counter() - start

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
        direct = (type(dest) is torch.Tensor and dest.is_cpu and dest.dtype == dtype and dest.is_contiguous()
                  and shows_its_bytes(dest))
        target, view = self.read_chunk(file, path, info, item.storage_index, dest if direct else None)
        self._check(view, path, info, key, stats)
        stats.nbytes += info.length
        if direct:
            planner.commit_tensor(item, target)
        else:
            planner.load_tensor(item, _narrowed(target, item))

    def read_whole(self, per_file: dict[str, list[tuple[Any, str, Any]]], planner: "TemplateLoadPlanner") -> None:
        """A load that needs no planning (:func:`~areal_lightning.write.direct.whole_reads`):
        each raw item read into its destination tensor and checked there, the skeleton
        unpickled by ``planner``; the files in parallel, each in offset order (a local file of
        fewer files than threads in parts of about equal bytes, read in parallel: a memory-tier
        slot is one file)."""

        def read_file(name: str, entries: list[tuple[Any, str, Any]]) -> Read:
            stats = Read()
            entries.sort(key=lambda entry: entry[0].offset)
            path = self.fs.concat_path(self.path, name)
            with self.fs.create_stream(path, "rb") as file:
                batch = [entry for entry in entries if entry[2] is not None and entry[0].length] \
                    if ONE_PASS_READ and isinstance(file, io.BufferedReader) else []
                if batch:  # a local file: its tensors by one call of the extension
                    try:
                        self._read_batch(file.fileno(), path, batch, stats)
                    except CheckpointCorruptError as exc:
                        self.failure = self.failure or exc
                        raise
                    entries = [entry for entry in entries if entry[2] is None]
                for info, key, dest in entries:
                    if not info.length and dest is not None:
                        continue  # an empty tensor: nothing to read (as DCP's reader)
                    try:
                        if dest is None:
                            data = read_item(file, path, info, key)
                        else:
                            _check_length(path, key, info, dest)
                            data = read_into(file, dest, path, info.offset, key)
                        self._check(data, path, info, key, stats)
                    except CheckpointCorruptError as exc:
                        self.failure = self.failure or exc
                        raise
                    stats.nbytes += info.length
                    if dest is None:
                        planner.store_bytes(key, io.BytesIO(data))
            return stats

        parts = self.threads // max(1, len(per_file)) if self.split_files else 1
        self._gather([(name, part) for name, entries in per_file.items() for part in split_by_bytes(entries, parts)],
                     read_file)

    def _read_batch(self, fd: int, path: Any, batch: list[tuple[Any, str, torch.Tensor]], stats: Read) -> None:
        """:meth:`read_whole`'s tensors of one part of a local file (``fd``), in offset order,
        each of bytes: read into its destination with its CRC32C by one call of the one-pass
        extension (:data:`ONE_PASS_READ`), the GIL released; then each CRC32C compared with the
        recorded one (unless the file is one of :attr:`checked_files`)."""
        infos, _, dests = zip(*batch)
        try:
            sizes = array("Q", map(_LENGTH, infos))
            same = array("Q", map(_NBYTES, dests)) == sizes
        except (OverflowError, TypeError):  # a recorded length that is no byte count at all
            same = False
        if not same:
            for info, key, dest in batch:
                _check_length(path, key, info, dest)
        # (whole_reads refused a destination whose storage holds fewer bytes than it spans: each
        # has its memory, none an address 0)
        addresses = array("Q", map(_DATA_PTR, dests))
        out = array("I", bytes(4 * len(batch)))
        ended, hash_s = KERNEL.read(fd, array("Q", map(_OFFSET, infos)), addresses, sizes, out)
        if ended >= 0:
            info, key, _ = batch[ended]
            raise truncated(path, key, info.offset, info.length, os.fstat(fd).st_size)
        stats.nbytes += sum(sizes)
        if infos[0].relative_path in self.checked_files:
            return
        wanted = [getattr(info, ITEM_CHECKSUM, None) for info in infos]
        if out.tolist() == wanted:  # (every item's recorded, every one equal: the usual case, compared in C)
            verified = len(wanted)
        else:
            verified = 0
            for i, want in enumerate(wanted):
                if isinstance(want, int):
                    if out[i] != want:
                        raise mismatch(path, infos[i], batch[i][1])
                    verified += 1
        stats.verified += verified
        stats.verify_s += hash_s

    def _gather(self, jobs: Any, read_file: Callable[[str, list[Any]], Read]) -> None:
        """Run ``read_file`` for every ``(file, entries)`` of ``jobs`` (a list of pairs, or a dict),
        ``threads`` at once (reads and CRCs release the GIL), adding up their stats."""
        jobs = list(jobs.items()) if isinstance(jobs, dict) else jobs
        if len(jobs) <= 1 or self.threads == 1:
            results = [read_file(name, entries) for name, entries in jobs]
        else:
            with ThreadPoolExecutor(min(len(jobs), self.threads), thread_name_prefix="areal-dcp-read") as pool:
                futures = [pool.submit(read_file, name, entries) for name, entries in jobs]
                results = [future.result() for future in futures]
        for stats in results:
            self.stats.nbytes += stats.nbytes
            self.stats.verified += stats.verified
            self.stats.verify_s += stats.verify_s

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture:
        infos = [self.storage_data[item.storage_index] for item in plan.items]
        if not isinstance(planner, TemplateLoadPlanner) or \
                any(info.transform_descriptors not in (None, [], [RAW_DESCRIPTOR]) for info in infos):
            return super().read_data(plan, planner)
        per_file: dict[str, list[tuple[Any, ReadItem]]] = {}
        for info, item in zip(infos, plan.items):
            per_file.setdefault(info.relative_path, []).append((info, item))
        self._gather(per_file, lambda name, entries: self._read_file(name, entries, planner))
        done: TorchFuture = TorchFuture()
        done.set_result(None)
        return done



def _check_length(path: Any, key: str, info: Any, dest: torch.Tensor) -> None:
    """Refuse a whole read whose recorded length is not its destination's size (a damaged
    ``.metadata``: the read would write past the tensor or leave part of it)."""
    if dest.nbytes != info.length:
        raise CheckpointCorruptError(
            f"{path}: '{key}' is recorded as {info.length} bytes but its tensor {list(dest.shape)} of {dest.dtype} "
            f"holds {dest.nbytes}; the checkpoint's .metadata is damaged")


def split_by_bytes(entries: list[Any], k: int) -> list[list[Any]]:
    """``entries`` (``(info, ...)`` of one file) in offset order, cut into up to ``k`` runs of
    about equal bytes (each run read by one thread, in order)."""
    entries = sorted(entries, key=lambda entry: entry[0].offset)
    total = sum(entry[0].length for entry in entries)
    if k <= 1 or len(entries) <= 1 or not total:
        return [entries]
    parts: list[list[Any]] = [[]]
    done = 0
    for entry in entries:
        if parts[-1] and done >= total * len(parts) / k:
            parts.append([])
        parts[-1].append(entry)
        done += entry[0].length
    return parts


def reader_of(path: PathLike, storage_options: Mapping[str, Any] | None = None,
              threads: int = READ_THREADS) -> "AdoptingReader":
    """This engine's DCP reader of the checkpoint at ``path`` (a local folder or an object-store
    prefix), reading ``threads`` files at once."""
    path = location(path)
    reader = AdoptingReader(path)
    reader.threads = threads
    if isinstance(path, str):
        on_object_store(reader, path, storage_options or {})
        reader.split_files = False  # one stream per object
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
