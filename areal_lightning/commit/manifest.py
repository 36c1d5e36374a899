"""Commit: the manifest of a recover checkpoint, and the checks of its files against it.

``checkpoint_info.json``'s ``files`` lists every file of the DCP directory. Written by this
version (``checksum: "crc32c"``), it is made from DCP's item table on rank 0 without reading
any file (:func:`~areal_lightning.write.checksum.manifest_of`)::

    "__0_0.distcp": {"size": 8391234, "items": 12}     # each item's CRC32C is in .metadata
    ".metadata":    {"size": 20211, "crc32c": 3735928559}

so the chain is manifest -> ``.metadata`` (its CRC32C) -> every item (its CRC32C, verified
by the rank that loads it, as it reads it). Checkpoints of earlier versions list
``{"size", "crc32"}`` (zlib, whole file) and are checked by a full pass.

* :func:`check_files`: presence and sizes (``stat`` only), and ``.metadata``'s CRC32C:
  what a resume checks before loading (metadata-sized work).
* :func:`verify_files`: additionally every byte of every data file against its item CRC32C
  (``areal-lightning inspect --verify``, :meth:`RecoverCallback.last_checkpoint`).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

from areal_lightning.errors import CheckpointCorruptError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.objectstore import filesystem, strip
from areal_lightning.write.checksum import (
    ALGORITHM,
    check_item,
    crc32c,
    file_checksum,
    file_crc32c,
    read_item,
    truncated,
)

__all__ = ["check_files", "verify_files", "verify_mapped", "metadata_checksum", "LEGACY_ALGORITHM"]

LEGACY_ALGORITHM = "crc32"
"""Whole-file zlib CRC32 of manifests written before per-item checksums."""


def _zlib_crc32(path: Path) -> int:
    return file_checksum(path, zlib.crc32)


Location = Union[Path, str]
"""A checkpoint folder: a local ``Path``, or an object-store prefix URI (``str``)."""


class _Objects:
    """The files of a checkpoint on an object store: one listing, whole-object reads."""

    def __init__(self, prefix: str, storage_options: Mapping[str, Any] | None) -> None:
        self.prefix = prefix.rstrip("/")
        self.fs = filesystem(prefix, storage_options)
        self.fs.invalidate_cache(strip(self.fs, self.prefix))
        try:
            listing = self.fs.ls(strip(self.fs, self.prefix), detail=True, refresh=True)
        except FileNotFoundError:
            listing = []
        self.sizes = {e["name"].rsplit("/", 1)[-1]: e.get("size") for e in listing if e.get("type") == "file"}

    def path(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(strip(self.fs, self.path(rel)))


def metadata_checksum(ckpt_dir: Location, entry: dict[str, Any],
                      storage_options: Mapping[str, Any] | None = None) -> bool:
    """Does ``ckpt_dir/.metadata`` have the checksum its manifest ``entry`` records?"""
    if isinstance(ckpt_dir, str):
        return crc32c(_Objects(ckpt_dir, storage_options).read(COMMIT_MARKER)) == entry.get(ALGORITHM)
    path = ckpt_dir / COMMIT_MARKER
    if isinstance(entry.get(ALGORITHM), int):
        return file_crc32c(path) == entry[ALGORITHM]
    return _zlib_crc32(path) == entry.get(LEGACY_ALGORITHM)


def check_files(ckpt_dir: Location, files: dict[str, Any], where: Location, hint: str, *, data: bool | None = None,
                storage_options: Mapping[str, Any] | None = None) -> int:
    """Check the checkpoint ``ckpt_dir`` against its manifest ``files``; return bytes read
    (see :func:`_check_local`; on an object store the same, from one listing)."""
    if isinstance(ckpt_dir, str):
        return _check_objects(ckpt_dir, files, where, hint, data=data, storage_options=storage_options)
    return _check_local(ckpt_dir, files, where, hint, data=data)


def _check_objects(prefix: str, files: dict[str, Any], where: Location, hint: str, *, data: bool | None,
                   storage_options: Mapping[str, Any] | None) -> int:
    if COMMIT_MARKER not in files or not isinstance(files[COMMIT_MARKER], dict) \
            or not isinstance(files[COMMIT_MARKER].get(ALGORITHM), int):
        raise CheckpointCorruptError(f"{where} lists no {COMMIT_MARKER} with its {ALGORITHM}")
    objects = _Objects(prefix, storage_options)
    for rel, want in sorted(files.items()):
        if not isinstance(want, dict) or not isinstance(want.get("size"), int):
            raise CheckpointCorruptError(f"{where}: bad entry for {rel!r}: {want!r}")
        size = objects.sizes.get(rel)
        if size is None:
            raise CheckpointCorruptError(f"{objects.path(rel)} is missing: {hint}.")
        if size != want["size"]:
            raise CheckpointCorruptError(
                f"{objects.path(rel)} has {size} bytes, expected {want['size']} (truncated?): {hint}.")
    metadata = objects.read(COMMIT_MARKER)
    if crc32c(metadata) != files[COMMIT_MARKER][ALGORITHM]:
        raise CheckpointCorruptError(f"{objects.path(COMMIT_MARKER)} fails its CRC32C check (content altered): {hint}.")
    nbytes = len(metadata)
    if data:
        nbytes += verify_files(prefix, hint, storage_options)
    return nbytes


def _check_local(ckpt_dir: Path, files: dict[str, Any], where: Location, hint: str, *, data: bool | None = None) -> int:
    """Check the checkpoint ``ckpt_dir`` against its manifest ``files``; return bytes read.

    Every file must exist with its recorded size, and ``.metadata`` must match its checksum.
    ``data=True`` also reads every data file and checks each item (or, for a legacy
    manifest, each whole file); ``None`` (what a load needs) does so for legacy manifests
    only: their files carry no item checksums a load could verify. Raises :class:`CheckpointCorruptError`
    naming the first missing, truncated or altered file (``where``: the manifest's path,
    ``hint``: what to do)."""
    if COMMIT_MARKER not in files:
        raise CheckpointCorruptError(f"{where} lists no {COMMIT_MARKER}")
    legacy = not isinstance(files[COMMIT_MARKER], dict) or ALGORITHM not in files[COMMIT_MARKER]
    nbytes = 0
    for rel, want in sorted(files.items()):
        path = ckpt_dir / rel
        if not isinstance(want, dict) or not isinstance(want.get("size"), int) or (
                legacy and not isinstance(want.get(LEGACY_ALGORITHM), int)):
            raise CheckpointCorruptError(f"{where}: bad entry for {rel!r}: {want!r}")
        if not path.is_file():
            raise CheckpointCorruptError(f"{path} is missing: {hint}.")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointCorruptError(f"{path} has {size} bytes, expected {want['size']} (truncated?): {hint}.")
        if rel == COMMIT_MARKER:
            ok = metadata_checksum(ckpt_dir, want)
        elif legacy and data is not False:
            ok = _zlib_crc32(path) == want[LEGACY_ALGORITHM]
        else:
            continue
        nbytes += size
        if not ok:
            name = LEGACY_ALGORITHM.upper() if legacy else ALGORITHM.upper()
            raise CheckpointCorruptError(f"{path} fails its {name} check (content altered): {hint}.")
    if data and not legacy:
        nbytes += verify_files(ckpt_dir, hint)
    return nbytes


def _items_by_file(ckpt_dir: Location, hint: str,
                   storage_options: Mapping[str, Any] | None) -> tuple[Any, list[tuple[str, list[tuple[Any, Any]]]]]:
    """The checkpoint's reader and its items, ``(info, index)``, grouped by data file (files by
    name, items by offset); an unreadable ``.metadata`` is :class:`CheckpointCorruptError`."""
    from areal_lightning.write.dcp_reader import reader_of

    reader = reader_of(ckpt_dir, storage_options)
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise CheckpointCorruptError(f"{ckpt_dir}/{COMMIT_MARKER} is unreadable ({exc!r}): {hint}.") from exc
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        by_file.setdefault(info.relative_path, []).append((info, index))
    return reader, [(rel, sorted(entries, key=lambda entry: entry[0].offset))
                    for rel, entries in sorted(by_file.items())]


_PARALLEL = 16 << 20
"""A mapped file of this many bytes or more is checked by threads (:func:`verify_mapped`)."""


def verify_mapped(ckpt_dir: Path, hint: str) -> int:
    """:func:`verify_files` of a local folder, each data file memory-mapped: every item's CRC32C
    computed on the file's pages in place (no copy into a buffer: on tmpfs, at checksum speed);
    a file of :data:`_PARALLEL` bytes or more in parts of about equal bytes, by threads (the
    CRC releases the GIL: a memory-tier slot is one file). Returns bytes checked."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from areal_lightning.write.dcp_reader import READ_THREADS, split_by_bytes

    _, by_file = _items_by_file(ckpt_dir, hint, None)
    nbytes = 0
    for rel, entries in by_file:
        path = Path(ckpt_dir) / rel
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
        try:
            view = memoryview(mapped) if mapped is not None else memoryview(b"")

            def check(part: list[tuple[Any, Any]]) -> int:
                checked = 0
                for info, index in part:
                    if info.offset + info.length > size:
                        raise truncated(path, index.fqn, info.offset, info.length, size)
                    with view[info.offset:info.offset + info.length] as item:  # released even on a raise
                        check_item(item, path, info, index.fqn)
                    checked += info.length
                return checked

            try:
                parts = split_by_bytes(entries, READ_THREADS if size >= _PARALLEL else 1)
                if len(parts) > 1:
                    with ThreadPoolExecutor(len(parts), thread_name_prefix="areal-verify") as pool:
                        nbytes += sum(pool.map(check, parts))  # the first part's failure first; all end here
                else:
                    nbytes += check(entries)
            except CheckpointCorruptError as exc:
                raise CheckpointCorruptError(f"{str(exc).split('; the checkpoint is damaged')[0]}: {hint}.") from None
            finally:
                view.release()
        finally:
            if mapped is not None:
                mapped.close()
    return nbytes


def verify_files(ckpt_dir: Location, hint: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """Read every item of every data file once, in offset order, checking length and CRC32C
    (the offline check; loads verify what they read themselves; an item without a recorded
    checksum is checked by length only). Returns bytes read."""
    reader, by_file = _items_by_file(ckpt_dir, hint, storage_options)
    nbytes = 0
    for rel, entries in by_file:
        path = reader.fs.concat_path(reader.path, rel)
        with reader.fs.create_stream(path, "rb") as f:
            for info, index in entries:
                try:
                    data = read_item(f, path, info, index.fqn)
                    check_item(data, path, info, index.fqn)
                    nbytes += len(data)
                except CheckpointCorruptError as exc:
                    raise CheckpointCorruptError(f"{str(exc).split('; the checkpoint is damaged')[0]}: {hint}.") from None
    return nbytes
