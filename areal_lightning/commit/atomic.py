"""Atomic publication of folders and files: write aside, fsync, rename into place.

A folder with its final name is always complete: it appears only through ``os.rename`` of a
fully written and fsynced temporary sibling. Deletion first renames the folder to a trash
name, so a crash mid-delete never leaves a half-deleted folder under a final name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from areal_lightning._fault import fault_point
from areal_lightning.layout import (
    TMP_PREFIX,
    TRASH_PREFIX,
    is_export_tmp_name,
    tmp_sibling,
)

__all__ = ["fsync_dir", "fsync_tree", "publish_dir", "remove_dir", "atomic_write_json", "clean_stale_tmp"]


def fsync_dir(path: Path) -> None:
    """fsync a directory entry table (makes renames/creates inside it durable)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory below ``root`` (files first, then their folders)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def publish_dir(tmp: Path, final: Path) -> None:
    """Make the complete folder ``tmp`` visible as ``final``, atomically and durably.

    ``tmp`` must be a sibling of ``final``. If ``final`` already exists (the same step
    exported again after a resume), it is replaced; a crash in between leaves the old
    folder under a trash name or the new one under the final name, never a mix.
    """
    fsync_tree(tmp)
    fault_point("commit.before_rename")
    if final.exists():
        remove_dir(final)
        fault_point("commit.publish.old_removed")
    os.rename(tmp, final)
    fsync_dir(final.parent)
    fault_point("commit.after_rename")


def remove_dir(path: Path) -> None:
    """Delete a folder: rename it to a hidden trash sibling first, then remove the trash."""
    trash = tmp_sibling(path, prefix=TRASH_PREFIX)
    fault_point("commit.remove_dir.begin")
    os.rename(path, trash)
    fsync_dir(path.parent)
    fault_point("commit.remove_renamed")
    shutil.rmtree(trash)
    fault_point("commit.remove_dir.done")


def clean_stale_tmp(parent: Path, keep: tuple[Path, ...] = ()) -> list[Path]:
    """Remove leftover temporary / trash folders of HF exports in ``parent``.

    Call only when no save into ``parent`` is in flight except those listed in ``keep``.
    Returns the removed paths.
    """
    removed = []
    if not parent.is_dir():
        return removed
    keep_names = {p.name for p in keep}
    for child in parent.iterdir():
        if is_export_tmp_name(child.name) and child.name not in keep_names and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


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
