"""Durability of written files: fsync of folders and trees (the write stage makes its bytes
durable; the commit stage, :mod:`areal_lightning.commit`, makes them visible)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "fsync_tree"]


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
