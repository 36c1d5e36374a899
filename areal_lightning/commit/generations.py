"""Commit on object stores: generations under a prefix, each made visible by a marker object
written last (the second strategy beside :class:`~areal_lightning.commit.atomic.AtomicDir`'s
rename, after Orbax's commit-file strategy for object stores).

::

    {prefix}/{gen}/...               # the files of one save; a prefix never reused
    {prefix}/{gen}/COMMITTED.json    # written last, created only if absent; {"seq": n, ...}

A generation without its marker does not exist for any reader. The newest committed one
(highest ``seq``) is *the* checkpoint at ``prefix``; older ones are deleted after a new
commit, marker first, so a crash mid-delete never leaves a half-deleted generation that
still counts. Writes that a crash interrupted stay invisible (an S3 multipart upload is not
an object until completed) and are removed, with their incomplete uploads, after the next
commit (:meth:`Generations.clean`). Nothing is ever renamed or copied.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from collections.abc import Mapping
from typing import Any

from areal_lightning._fault import fault_point
from areal_lightning.errors import CheckpointCorruptError, CheckpointNotFoundError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.objectstore import abort_uploads, filesystem, join, name, strip, write_exclusive

__all__ = ["MARKER", "Generations"]

log = logging.getLogger(__name__)

MARKER = "COMMITTED.json"
"""The commit marker object of a generation (written last, never overwritten)."""


def utc_now() -> str:
    """The time of a commit (ISO 8601, UTC, milliseconds)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


class Generations:
    """The generations under one object-store ``prefix`` (see the module doc).

    Args:
        prefix: the URI holding the generations (``s3://bucket/.../recover_info``).
        storage_options: the file system's options (credentials, endpoint...).
    """

    def __init__(self, prefix: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.prefix = prefix.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs = filesystem(self.prefix, self.storage_options)

    def uri(self, gen: str, *parts: str) -> str:
        """The URI of generation ``gen`` (or of a file inside it)."""
        return join(self.prefix, gen, *parts)

    def names(self) -> list[str]:
        """Every generation under the prefix, committed or not (a fresh listing)."""
        self.fs.invalidate_cache(strip(self.fs, self.prefix))
        try:
            entries = self.fs.ls(strip(self.fs, self.prefix), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(name(e["name"]) for e in entries if e.get("type") == "directory")

    def marker(self, gen: str) -> dict[str, Any] | None:
        """The marker of ``gen`` (``None``: not committed)."""
        try:
            data = self.fs.cat_file(strip(self.fs, self.uri(gen, MARKER)))
        except FileNotFoundError:
            return None
        try:
            marker = json.loads(data)
        except ValueError:
            log.warning("%s is not valid JSON; the generation is not treated as committed", self.uri(gen, MARKER))
            return None
        return marker if isinstance(marker, dict) and isinstance(marker.get("seq"), int) else None

    def committed(self) -> list[tuple[int, str, dict[str, Any]]]:
        """``(seq, gen, marker)`` of every committed generation, oldest first."""
        found = []
        for gen in self.names():
            marker = self.marker(gen)
            if marker is not None:
                found.append((marker["seq"], gen, marker))
        return sorted(found)

    def newest(self) -> tuple[str, dict[str, Any]] | None:
        """The newest committed generation and its marker, else ``None``."""
        committed = self.committed()
        return (committed[-1][1], committed[-1][2]) if committed else None

    def commit(self, gen: str, payload: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Write the marker of ``gen`` (conditional create: ``FileExistsError`` if one is there),
        with ``seq`` one past the newest committed generation's. Returns the marker."""
        newest = self.committed()
        marker = {**(payload or {}), "seq": (newest[-1][0] + 1) if newest else 0, "generation": gen,
                  "commit_time": utc_now()}
        fault_point("objectstore.before_marker")
        write_exclusive(self.uri(gen, MARKER), json.dumps(marker, indent=2, sort_keys=True).encode(),
                        self.storage_options)
        fault_point("objectstore.after_marker")
        return marker

    def delete(self, gen: str) -> None:
        """Delete generation ``gen``: its marker first (it stops counting), then its files."""
        try:
            self.fs.rm_file(strip(self.fs, self.uri(gen, MARKER)))
        except FileNotFoundError:
            pass
        fault_point("objectstore.marker_deleted")
        try:
            self.fs.rm(strip(self.fs, self.uri(gen)), recursive=True)
        except FileNotFoundError:
            pass

    def clean(self, keep: set[str]) -> list[str]:
        """Delete every generation not in ``keep`` (older committed ones, and uncommitted ones
        left by interrupted saves) and abort the incomplete multipart uploads under the
        prefix. Call only when no save into the prefix is in flight. Returns the deleted names."""
        deleted = []
        for gen in self.names():
            if gen not in keep:
                self.delete(gen)
                deleted.append(gen)
        aborted = abort_uploads(self.prefix, self.storage_options)
        if deleted or aborted:
            log.info("%s: removed %d generation(s) (%s) and %d incomplete upload(s)", self.prefix, len(deleted),
                     ", ".join(deleted) or "-", aborted)
        return deleted


class GenerationCommit:
    """The :class:`~areal_lightning.commit.atomic.CommitTarget` of a save to the object-store
    path ``final`` (``DCPCheckpointIO.save_checkpoint("s3://...")``): the files go to the
    fresh generation ``{final}/{token}/``; :meth:`finalize` writes its marker, then removes
    the generations it replaced and what interrupted saves left."""

    def __init__(self, final: str, token: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.final = final.rstrip("/")
        self.generations = Generations(self.final, storage_options)
        self.token = token
        self.tmp = self.generations.uri(token)

    def create(self) -> str:
        """Nothing to create on an object store; the generation's prefix."""
        return self.tmp

    def finalize(self, written: Any = None) -> None:
        """Commit the generation (its DCP ``.metadata`` must be there), then clean the prefix."""
        check_written(self.generations, self.token)
        self.generations.commit(self.token, {"files": getattr(written, "files", None)})
        self.generations.clean({self.token})

    def discard(self) -> None:
        """Remove what a failed save wrote (best effort: the next commit cleans up too)."""
        try:
            self.generations.delete(self.token)
        except Exception as exc:  # noqa: BLE001 - cleanup of a failure already being raised
            log.warning("%s: could not remove the failed save's files: %r", self.tmp, exc)


def check_written(generations: Generations, gen: str) -> None:
    """Raise :class:`CheckpointCorruptError` unless DCP's ``.metadata`` of ``gen`` is there."""
    fs = generations.fs
    uri = generations.uri(gen, COMMIT_MARKER)
    fs.invalidate_cache(strip(fs, generations.uri(gen)))
    if not fs.exists(strip(fs, uri)):
        raise CheckpointCorruptError(f"{uri} is missing at commit time; the generation is not committed and the "
                                     "previous checkpoint stays in place")


def resolve(path: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """The DCP prefix to load for an object-store ``path``: ``path`` itself if it holds a DCP
    ``.metadata``, else its newest committed generation (``FileNotFoundError`` if none)."""
    generations = Generations(path, storage_options)
    fs = generations.fs
    fs.invalidate_cache(strip(fs, generations.prefix))
    if fs.exists(strip(fs, join(generations.prefix, COMMIT_MARKER))):
        return generations.prefix
    newest = generations.newest()
    if newest is None:
        raise CheckpointNotFoundError(f"checkpoint not found: {path} holds no committed generation ({MARKER})")
    return generations.uri(newest[0])
