"""Commit: which HF exports are kept (``max_keep``), after Orbax's preservation policies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_lightning._fault import fault_point
from areal_lightning.commit.atomic import remove_dir
from areal_lightning.commit.upload import committed_exports, remove_export
from areal_lightning.layout import TrialLayout

__all__ = ["keep_newest", "keep_newest_remote"]


def keep_newest(layout: TrialLayout, name: str, max_keep: int | None) -> list[Path]:
    """Delete all but the newest ``max_keep`` exports of model ``name`` (by global step;
    only folders with an export name; ``None`` keeps all). Each one is renamed away before
    it is removed (:func:`~areal_lightning.commit.atomic.remove_dir`). Returns the removed folders."""
    if max_keep is None:
        return []
    exports = layout.list_exports(name)
    removed = []
    for _, path in exports[: max(len(exports) - max_keep, 0)]:
        fault_point("hf.prune")
        remove_dir(path)
        removed.append(path)
    return removed


def keep_newest_remote(model_dir: str, max_keep: int | None, storage_options: Any = None) -> list[str]:
    """:func:`keep_newest` on an object store: the committed exports of ``model_dir`` beyond the
    newest ``max_keep`` are deleted, each marker first. Returns the removed URIs."""
    if max_keep is None:
        return []
    exports = committed_exports(model_dir, storage_options)
    removed = []
    for _, uri in exports[: max(len(exports) - max_keep, 0)]:
        fault_point("hf.prune")
        remove_export(uri, storage_options)
        removed.append(uri)
    return removed
