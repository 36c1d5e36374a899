"""Commit: the one atomic-directory protocol, used by every checkpoint this package writes.

A folder with its final name is always complete. :class:`AtomicDir` (after Orbax's
``TemporaryPath``) writes aside and makes the folder visible in one rename:

1. ``create()`` makes the hidden sibling ``.tmp-{final}-{token}``; the write stage fills it.
2. ``finalize()``, run after the write has returned (never inside it): fsync the folder
   (unless the writer already made it durable), move an existing ``final`` aside to
   ``.old-{final}-{token}``, rename the temporary folder to ``final``, fsync the parent,
   then delete the old folder. It is idempotent: run again after a crash (a roll-forward),
   it finishes what is left.

HF exports commit one ``AtomicDir``; ``DCPCheckpointIO`` saves one per checkpoint path; the
recover checkpoint commits two with the same token (``recover_checkpoint/`` then
``recover_info/``, see :mod:`areal_lightning.commit.recover_store`). Deleting a folder
(:func:`remove_dir`) renames it to ``.trash-{final}-{token}`` first, so a crash mid-delete
never leaves a half-deleted folder under a final name. Every name is in
:mod:`areal_lightning.layout`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from areal_lightning.errors import PathOccupiedError
from areal_lightning._fault import fault_point
from areal_lightning.layout import (
    OLD_PREFIX,
    TMP_PREFIX,
    TRASH_PREFIX,
    is_export_tmp_name,
    leftover_of,
    new_token,
    sibling,
    tmp_sibling,
)
from areal_lightning.write.checksum import Written
from areal_lightning.write.durable import fsync_dir, fsync_tree

__all__ = [
    "AtomicDir",
    "CommitTarget",
    "CommitPoints",
    "fsync_dir",
    "fsync_tree",
    "publish_dir",
    "remove_dir",
    "atomic_write_json",
    "write_json",
    "clean_leftovers",
    "clean_stale_tmp",
]


def _before_rename() -> None:
    fault_point("commit.before_rename")


def _old_moved() -> None:
    fault_point("commit.publish.old_removed")


def _in_place() -> None:
    fault_point("commit.after_rename")


@dataclass(frozen=True)
class CommitPoints:
    """The fault points (:mod:`areal_lightning._fault`) one kind of commit reports, as
    calls of ``fault_point`` with the point's name (the registry test finds them there)."""

    before: Callable[[], None] | None = _before_rename
    old_moved: Callable[[], None] = _old_moved
    in_place: Callable[[], None] = _in_place


@runtime_checkable
class CommitTarget(Protocol):
    """What a writer fills and how it is committed (the argument of ``DCPCheckpointIO.write``):
    :class:`AtomicDir`, the recover checkpoint's pair commit, or on an object store (``str``
    URIs) a generation committed by its marker (:mod:`areal_lightning.commit.generations`)."""

    final: Path | str
    tmp: Path | str

    def create(self) -> Path:
        """Make (or reuse) the temporary folder; return it."""
        ...

    def finalize(self, written: Written | None = None) -> None:
        """Make the written folder visible under its final name (idempotent). ``written``: what
        the write stage wrote (a DCP save's :class:`~areal_lightning.write.checksum.Written`,
        its manifest included), for a target that records it (the recover commit)."""
        ...

    def discard(self) -> None:
        """Remove the temporary folder of a failed write."""
        ...


class AtomicDir:
    """A folder written at ``tmp`` and made visible as ``final`` in one rename (module doc).

    Args:
        final: the folder's final path.
        token: names this commit's ``.tmp-`` / ``.old-`` siblings (a fresh one by default;
            every rank of a collective save must use the same).
        fsync: fsync every file and folder below ``tmp`` at ``finalize`` (``False`` when
            the writer made its files durable itself, as DCP does).
        points: the fault points this commit reports.

    Example:
        >>> import tempfile
        >>> d = AtomicDir(Path(tempfile.mkdtemp()) / "export")
        >>> _ = (d.create() / "weights.bin").write_bytes(b"x")
        >>> d.finalize(); sorted(p.name for p in d.final.iterdir())
        ['weights.bin']
    """

    def __init__(self, final: Path, token: str | None = None, *, fsync: bool = True,
                 points: CommitPoints = CommitPoints()) -> None:
        self.final = Path(final)
        self.token = token if token is not None else new_token()
        self.tmp = sibling(self.final, TMP_PREFIX, self.token)
        self.old = sibling(self.final, OLD_PREFIX, self.token)
        self.fsync = fsync
        self.points = points

    @classmethod
    def of_tmp(cls, tmp: Path, final: Path | None = None, **kwargs: Any) -> "AtomicDir":
        """The commit whose temporary folder is ``tmp`` (a ``.tmp-{final}-{token}`` path);
        ``ValueError`` if it is not one, or not one of ``final`` when that is given."""
        parts = leftover_of(Path(tmp).name)
        if parts is None or parts[0] != TMP_PREFIX:
            raise ValueError(f"{tmp} is not a temporary folder name ({TMP_PREFIX}{{final}}-{{token}})")
        commit = cls(Path(tmp).parent / parts[1], parts[2], **kwargs)
        if final is not None and commit.final != Path(final):
            raise ValueError(f"{tmp} is not the temporary folder of {final}")
        return commit

    def create(self) -> Path:
        """Create the parent and the temporary folder (reused if it exists); return it."""
        if self.final.exists() and not self.final.is_dir():
            raise PathOccupiedError(f"cannot write a checkpoint folder to {self.final}: a file exists there; "
                                    "remove it or choose another path")
        self.tmp.mkdir(parents=True, exist_ok=True)
        return self.tmp

    def finalize(self, written: Written | None = None, *, remove_old: bool = True) -> None:
        """Move the written folder into place (see the module doc); idempotent. With
        ``remove_old=False`` the replaced folder stays at :attr:`old` for the caller.
        (``written`` is not needed: the folder is its own record.)"""
        if self.tmp.exists():
            if self.fsync:
                fsync_tree(self.tmp)
            if self.points.before is not None:
                self.points.before()
            if self.final.exists():
                os.rename(self.final, self.old)
                self.points.old_moved()
            os.rename(self.tmp, self.final)
            fsync_dir(self.final.parent)
            self.points.in_place()
        if remove_old:
            self.remove_old()

    @classmethod
    def roll_forward(cls, final: Path) -> bool:
        """Finish a commit of ``final`` that a crash interrupted between its two renames
        (``final`` missing, its ``.old-`` sibling present): the new folder was complete before
        the old one was moved aside, so it is renamed into place (or, if it is gone, the old
        one back). Returns whether anything was done. Call with no commit of ``final`` in flight."""
        final = Path(final)
        if final.exists() or not final.parent.is_dir():
            return False
        for child in sorted(final.parent.iterdir()):
            parts = leftover_of(child.name)
            if parts is None or parts[0] != OLD_PREFIX or parts[1] != final.name:
                continue
            commit = cls(final, parts[2], fsync=False)
            if commit.tmp.is_dir():
                commit.finalize()
            else:
                os.rename(commit.old, final)
                fsync_dir(final.parent)
            return True
        return False

    def remove_old(self) -> None:
        """Delete the folder this commit replaced, if any."""
        shutil.rmtree(self.old, ignore_errors=True)

    def discard(self) -> None:
        """Remove the temporary folder (a failed or abandoned write)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def publish_dir(tmp: Path, final: Path) -> None:
    """Make the complete folder ``tmp`` (from :func:`~areal_lightning.layout.tmp_sibling`)
    visible as ``final``: :meth:`AtomicDir.finalize` of that commit. An existing ``final``
    (the same step exported again after a resume) is replaced; a crash in between leaves
    the old folder under an ``.old-`` name or the new one under the final name, never a mix."""
    AtomicDir.of_tmp(tmp, final).finalize()


def remove_dir(path: Path) -> None:
    """Delete a folder: rename it to a hidden trash sibling first, then remove the trash."""
    trash = tmp_sibling(path, prefix=TRASH_PREFIX)
    fault_point("commit.remove_dir.begin")
    os.rename(path, trash)
    fsync_dir(path.parent)
    fault_point("commit.remove_renamed")
    shutil.rmtree(trash)
    fault_point("commit.remove_dir.done")


def clean_leftovers(parent: Path, is_leftover: Callable[[str], bool], keep: tuple[Path, ...] = ()) -> list[Path]:
    """Remove the folders of ``parent`` whose names ``is_leftover`` accepts, except ``keep``.

    Call only when no commit into ``parent`` is in flight except those in ``keep``.
    Returns the removed paths."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    keep_names = {p.name for p in keep}
    for child in parent.iterdir():
        if is_leftover(child.name) and child.name not in keep_names and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def clean_stale_tmp(parent: Path, keep: tuple[Path, ...] = ()) -> list[Path]:
    """Remove leftover ``.tmp-`` / ``.old-`` / ``.trash-`` folders of HF exports in ``parent``
    (never the recover checkpoint's, which live in the same model folder)."""
    return clean_leftovers(parent, is_export_tmp_name, keep)


def write_json(path: Path, data: Any) -> None:
    """Write JSON to ``path`` in place and fsync the file (not its folder): for files inside
    a folder that is itself committed by a rename (see :class:`AtomicDir`)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON to ``path`` atomically (tmp file + fsync + rename + fsync of the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    fault_point("commit.json.before_replace")
    os.replace(tmp, path)
    fsync_dir(path.parent)
