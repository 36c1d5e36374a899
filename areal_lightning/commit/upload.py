"""Commit of HF exports on object stores: written in a node-local staging folder, uploaded in
parallel, then made visible by a marker object written last.

::

    {model_dir}/epoch{E}epochstep{S}globalstep{G}/config.json, model.safetensors, tokenizer...
    {model_dir}/epoch{E}epochstep{S}globalstep{G}/COMMITTED.json   # written last

An export folder without its marker does not exist for any reader (``inspect``, ``max_keep``,
:func:`~areal_lightning.tools.download.download_export`). Re-exporting a step (after a resume)
deletes its marker before the new files are uploaded. ``max_keep`` deletes the marker first,
then the files. After each commit, export folders without a marker (interrupted uploads) and
the incomplete multipart uploads under them are removed. ``save_pretrained`` only ever writes
into the local staging folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from areal_lightning._fault import fault_point
from areal_lightning.commit.generations import MARKER, utc_now
from areal_lightning.layout import parse_export_name
from areal_lightning.objectstore import abort_uploads, filesystem, join, name, strip, write_exclusive

__all__ = ["UploadCommit", "exports_of", "committed_exports", "remove_export", "clean_uncommitted_exports",
           "default_staging"]

log = logging.getLogger(__name__)


def default_staging() -> Path:
    """The node-local staging folder of object-store exports (``$TMPDIR/areal-lightning-staging``)."""
    return Path(tempfile.gettempdir()) / "areal-lightning-staging"


class UploadCommit:
    """The commit of one HF export to the object-store folder ``final`` (module doc).

    Args:
        final: the export's URI (``s3://.../default/epoch0epochstep9globalstep9``).
        storage_options: the file system's options.
        staging: the node-local folder under which the export is written first.
        tmp: an existing staging folder of this export (made by :meth:`create` earlier).
    """

    def __init__(self, final: str, storage_options: Mapping[str, Any] | None = None,
                 staging: Path | None = None, tmp: Path | None = None) -> None:
        self.final = final.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.staging = Path(staging) if staging is not None else default_staging()
        self.tmp = Path(tmp) if tmp is not None else None

    def create(self) -> Path:
        """Make (or reuse) the local staging folder; return it."""
        if self.tmp is None:
            self.staging.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f"{name(self.final)}-", dir=self.staging))
        return self.tmp

    def finalize(self, written: Any = None) -> int:
        """Upload the staged files (in parallel), then write the marker; remove the staging
        folder. Returns the bytes uploaded."""
        assert self.tmp is not None, "create() first"
        fs = filesystem(self.final, self.storage_options)
        files = sorted(p for p in self.tmp.rglob("*") if p.is_file())
        remote = [join(self.final, p.relative_to(self.tmp).as_posix()) for p in files]
        try:
            fs.rm_file(strip(fs, join(self.final, MARKER)))  # a re-export: invisible while it is rewritten
        except FileNotFoundError:
            pass
        if files:
            fs.put([str(p) for p in files], [strip(fs, r) for r in remote])
        sizes = {p.relative_to(self.tmp).as_posix(): p.stat().st_size for p in files}
        fault_point("objectstore.before_marker")
        marker = {"files": sizes, "commit_time": utc_now(), "seq": 0, "generation": name(self.final)}
        write_exclusive(join(self.final, MARKER), json.dumps(marker, indent=2, sort_keys=True).encode(),
                        self.storage_options)
        fault_point("objectstore.after_marker")
        shutil.rmtree(self.tmp, ignore_errors=True)
        return sum(sizes.values())

    def discard(self) -> None:
        """Remove the staging folder of a failed export (uploaded files without a marker are
        removed after the next commit)."""
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def exports_of(model_dir: str, storage_options: Mapping[str, Any] | None) -> list[tuple[Any, str, bool]]:
    """``(parsed name, uri, committed)`` of every export-named folder under ``model_dir``."""
    fs = filesystem(model_dir, storage_options)
    fs.invalidate_cache(strip(fs, model_dir))
    try:
        entries = fs.ls(strip(fs, model_dir), detail=True, refresh=True)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        folder = name(entry["name"])
        parsed = parse_export_name(folder)
        if parsed is None or entry.get("type") != "directory":
            continue
        uri = join(model_dir, folder)
        found.append((parsed, uri, fs.exists(strip(fs, join(uri, MARKER)))))
    return sorted(found)


def committed_exports(model_dir: str, storage_options: Mapping[str, Any] | None = None) -> list[tuple[Any, str]]:
    """The committed exports under ``model_dir``, oldest first (by global step)."""
    return [(parsed, uri) for parsed, uri, committed in exports_of(model_dir, storage_options) if committed]


def remove_export(uri: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Delete an export: its marker first (it stops existing), then its files."""
    fs = filesystem(uri, storage_options)
    try:
        fs.rm_file(strip(fs, join(uri, MARKER)))
    except FileNotFoundError:
        pass
    fault_point("objectstore.marker_deleted")
    try:
        fs.rm(strip(fs, uri), recursive=True)
    except FileNotFoundError:
        pass


def clean_uncommitted_exports(model_dir: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Remove export folders without a marker and the incomplete multipart uploads under
    export folders of ``model_dir`` (call with no export in flight). Returns the removed URIs."""
    removed = []
    for _parsed, uri, committed in exports_of(model_dir, storage_options):
        if not committed:
            remove_export(uri, storage_options)
            removed.append(uri)
    aborted = abort_uploads(model_dir, storage_options,
                            keep=lambda key: parse_export_name(key.split("/", 1)[0]) is None)
    if removed or aborted:
        log.info("%s: removed %d uncommitted export(s) and %d incomplete upload(s)", model_dir, len(removed), aborted)
    return removed


def folder_bytes_remote(uri: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """Bytes of the committed export ``uri`` (from its marker)."""
    fs = filesystem(uri, storage_options)
    try:
        marker = json.loads(fs.cat_file(strip(fs, join(uri, MARKER))))
        return int(sum(marker.get("files", {}).values()))
    except (FileNotFoundError, ValueError, TypeError):
        return 0
