"""Write: checksums computed where the bytes are, while they are written and read.

Every byte a DCP save writes passes through :class:`HashingStream` in the writer thread
that writes it: one CRC32C (``crc32c`` package, SSE4.2 hardware CRC, releases the GIL;
chosen by ``benchmarks/hashes.py``: 8-10 GB/s on one thread here, against 2 GB/s for
``zlib.crc32``) per DCP item, i.e. per byte range ``[offset, offset + length)`` of a
``__{rank}_{i}.distcp`` file, which is exactly what a load reads back.

* **Save**: :meth:`ChecksumLog.attach` puts each item's CRC on its ``_StorageInfo`` (DCP's
  per-item storage record) as the attribute :data:`ITEM_CHECKSUM`. DCP itself gathers those
  records from every rank to the coordinator and pickles them into ``.metadata``, so the
  digests of every rank reach rank 0 with DCP's own exchange, and are written by DCP with
  the metadata. Stock DCP readers ignore the extra attribute. No rank reads a file back.
* **Load**: :func:`read_item` reads one item's bytes and checks their length,
  :func:`check_item` their CRC; both name the file and the tensor key on a mismatch: each
  rank verifies exactly the bytes it loads, as it reads them.
* **Manifest**: the coordinator's ``.metadata`` is hashed as it is written; with the item
  table that gives :func:`manifest_of` (``checkpoint_info.json``'s file list) without
  reading any data file.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

import crc32c as _crc32c

from areal_lightning.errors import CheckpointCorruptError

__all__ = ["ALGORITHM", "ITEM_CHECKSUM", "HashingStream", "ChecksumLog", "Written", "crc32c", "file_checksum", "file_crc32c",
           "item_checksum", "truncated", "read_item", "check_item", "mismatch", "manifest_of", "data_files",
           "with_metadata", "KERNEL", "one_pass"]

ALGORITHM = "crc32c"
"""The checksum of every file and item this package records (name used in manifests)."""

try:
    from areal_lightning.write import _crc32c_copy as KERNEL
except ImportError:  # an optional extension: not built without a C compiler
    KERNEL = None
"""The compiled one-pass extension (``write/_crc32c_copy.c``): the memory tier's copy with each
item's CRC32C (:mod:`~areal_lightning.write.slot`) and a local load's read with it
(:mod:`~areal_lightning.write.dcp_reader`); ``None`` where it was not built."""


def one_pass(function: str) -> bool:
    """Whether :data:`KERNEL` was built with ``function`` and this CPU runs it (SSE4.2 on x86-64)."""
    return KERNEL is not None and hasattr(KERNEL, function) and KERNEL.supported()

ITEM_CHECKSUM = "areal_crc32c"
"""Attribute of DCP's ``_StorageInfo`` holding the item's CRC32C (pickled into ``.metadata``)."""

_CHUNK = 16 << 20


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing from ``value``."""
    return _crc32c.crc32c(data, value)


def file_checksum(path: Path, update: Callable[[Any, int], int] = crc32c) -> int:
    """A whole file's checksum by ``update(chunk, value)`` (``crc32c``, or ``zlib.crc32`` for
    manifests of earlier versions); for offline checks and ``.metadata`` only: saves never read."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = update(chunk, value)
    return value


def file_crc32c(path: Path) -> int:
    """CRC32C of a whole file (see :func:`file_checksum`)."""
    return file_checksum(path, crc32c)


def item_checksum(info: Any) -> int | None:
    """The CRC32C recorded for one DCP item (``None``: written before checksums per item)."""
    value = getattr(info, ITEM_CHECKSUM, None)
    return value if isinstance(value, int) else None


class HashingStream:
    """A binary output stream that CRCs what passes through it, one segment per item.

    DCP's writer asks the stream for its position (``tell``) before and after each item;
    every ``tell`` closes the segment since the previous one, so each item's byte range
    gets its own CRC (``segments``: ``{offset: (length, crc)}``). ``close`` ends the last
    segment. ``hash_s`` is the time spent hashing."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.pos = 0
        self.segments: dict[int, tuple[int, int]] = {}
        self.hash_s = 0.0
        self._start = 0
        self._crc = 0

    def write(self, data: Any) -> int:
        written = self.raw.write(data)  # a blocking BufferedWriter writes (and counts) it all
        start = time.perf_counter()
        self._crc = crc32c(data, self._crc)
        self.hash_s += time.perf_counter() - start
        self.pos += written
        return written

    def _cut(self) -> None:
        if self.pos > self._start:
            self.segments[self._start] = (self.pos - self._start, self._crc)
        self._start, self._crc = self.pos, 0

    def tell(self) -> int:
        self._cut()
        return self.pos

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self._cut()
        self.raw.close()

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def __enter__(self) -> "HashingStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class Written:
    """What one rank's part of a DCP save wrote."""

    nbytes: int = 0
    """Bytes this rank wrote (its data files, and ``.metadata`` on the coordinator)."""
    hash_s: float = 0.0
    """Seconds this rank's writer threads spent hashing (summed over threads)."""
    items: int = 0
    """Items this rank wrote; ``unhashed`` of them got no checksum (see :meth:`ChecksumLog.attach`)."""
    unhashed: int = 0
    files: dict[str, dict[str, int]] | None = None
    """The manifest (:func:`manifest_of`), on the coordinator only."""


@dataclass
class ChecksumLog:
    """The streams of one save (filled from DCP's writer threads)."""

    streams: dict[str, HashingStream] = field(default_factory=dict)
    written: Written = field(default_factory=Written)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, stream: HashingStream) -> None:
        """Record a finished stream (thread-safe)."""
        with self._lock:
            self.streams[name] = stream
            self.written.nbytes += stream.pos
            self.written.hash_s += stream.hash_s

    def attach(self, results: list[Any]) -> None:
        """Put each item's CRC on its ``_StorageInfo`` (``results``: DCP's ``WriteResult`` s).

        An item whose byte range is not one segment of its stream (DCP wrote it in a way
        this version does not know) keeps no checksum: it is then checked by size only,
        and counted in ``written.unhashed``."""
        for result in results:
            info = result.storage_data
            stream = self.streams.get(info.relative_path)
            segment = stream.segments.get(info.offset) if stream is not None else None
            self.written.items += 1
            if info.length == 0:  # an empty tensor: no bytes, no segment
                setattr(info, ITEM_CHECKSUM, crc32c(b""))
            elif segment is not None and segment[0] == info.length:
                setattr(info, ITEM_CHECKSUM, segment[1])
            else:
                self.written.unhashed += 1


def manifest_of(storage_data: dict[Any, Any], metadata: HashingStream, metadata_name: str) -> dict[str, dict[str, int]]:
    """``checkpoint_info.json``'s file list from DCP's item table: every data file with its
    size and item count (each item's CRC32C is in ``.metadata``), and ``.metadata`` with its
    size and CRC32C (hashed as it was written)."""
    return with_metadata(data_files(storage_data), metadata, metadata_name)


def data_files(storage_data: dict[Any, Any]) -> dict[str, dict[str, int]]:
    """The data files' part of :func:`manifest_of`: each file's size and item count."""
    files: dict[str, dict[str, int]] = {}
    for info in storage_data.values():
        entry = files.setdefault(info.relative_path, {"size": 0, "items": 0})
        entry["size"] = max(entry["size"], info.offset + info.length)
        entry["items"] += 1
    return files


def with_metadata(files: dict[str, dict[str, int]], metadata: HashingStream,
                  metadata_name: str) -> dict[str, dict[str, int]]:
    """:func:`manifest_of` from its data files' part ``files`` (:func:`data_files`, taken as it is)."""
    files[metadata_name] = {"size": metadata.pos, ALGORITHM: metadata.segments.get(0, (0, 0))[1]}
    return dict(sorted(files.items()))


def truncated(path: Any, key: str, offset: int, length: int, ends_at: int) -> CheckpointCorruptError:
    """The error for an item ``key`` of ``length`` bytes at ``offset`` of ``path`` whose file ends at ``ends_at``."""
    return CheckpointCorruptError(
        f"{path} is truncated: '{key}' needs bytes {offset}..{offset + length} but the file ends at {ends_at}; "
        "the checkpoint is damaged: restore the file, or delete the checkpoint")


def read_item(file: BinaryIO, path: Path, info: Any, key: str) -> bytes:
    """The bytes of one DCP item, of the recorded length (else :class:`CheckpointCorruptError`
    naming ``path`` and the tensor ``key``); check them with :func:`check_item`.

    One ``read`` into a new ``bytes`` object, which ``io.BytesIO`` then shares without a copy
    (measured: faster than streaming ``torch.load`` from the file, and than a reused buffer)."""
    file.seek(info.offset)
    data = file.read(info.length)
    if len(data) != info.length:
        raise truncated(path, key, info.offset, info.length, info.offset + len(data))
    return data


def check_item(data: Any, path: Path, info: Any, key: str) -> bool:
    """Check an item's bytes against its recorded CRC32C; ``False`` when none was recorded.

    Raises :class:`CheckpointCorruptError` naming ``path`` and the tensor ``key``."""
    want = item_checksum(info)
    if want is None:
        return False
    if crc32c(data) != want:
        raise mismatch(path, info, key)
    return True


def mismatch(path: Any, info: Any, key: str) -> CheckpointCorruptError:
    """The error for the item ``info`` (the tensor ``key``) of ``path`` whose bytes fail their recorded CRC32C."""
    return CheckpointCorruptError(
        f"{path} fails its CRC32C check in '{key}' (bytes {info.offset}..{info.offset + info.length}): the file "
        "was altered after it was written; the checkpoint is damaged: restore the file, or delete the checkpoint")
