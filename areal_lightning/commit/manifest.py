"""Commit: the manifest of a checkpoint, the size and checksum of every file it holds.

``checkpoint_info.json`` lists ``{relative path: {"size", "crc32"}}`` of every file of the
recover checkpoint; :meth:`~areal_lightning.commit.recover_store.RecoverStore.verify` and
``areal-lightning inspect --verify`` check the files against it.
"""

from __future__ import annotations

import zlib
from pathlib import Path

__all__ = ["file_checksums", "file_checksums_of"]

_CHUNK = 8 << 20


def file_checksums_of(path: Path) -> dict[str, int]:
    """``{"size", "crc32"}`` of one file."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": crc}


def file_checksums(root: Path) -> dict[str, dict[str, int]]:
    """``{relative path: {"size", "crc32"}}`` of every file below ``root``."""
    return {str(p.relative_to(root)): file_checksums_of(p) for p in sorted(root.rglob("*")) if p.is_file()}


