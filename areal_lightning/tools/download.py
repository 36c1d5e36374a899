"""Download a committed HF export from an object store to a local folder, for ``from_pretrained``.

``transformers`` loads from a local folder or the Hub, never from ``s3://``: ::

    from areal_lightning import download_export
    path = download_export("s3://bucket/ckpt/checkpoints/alice/exp/run1/default")  # the newest export
    model = AutoModelForCausalLM.from_pretrained(path)

or ``areal-lightning download s3://.../default/epoch0epochstep99globalstep99 ./export``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from areal_lightning.commit.generations import MARKER
from areal_lightning.commit.upload import committed_exports
from areal_lightning.errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError, PathOccupiedError
from areal_lightning.layout import parse_export_name
from areal_lightning.objectstore import check_path, filesystem, is_remote, join, name, strip

__all__ = ["download_export"]


def download_export(uri: str, local_dir: str | os.PathLike[str] | None = None,
                    storage_options: Mapping[str, Any] | None = None) -> Path:
    """Download the committed HF export ``uri`` into ``local_dir`` and return that folder.

    Args:
        uri: an export folder (``.../epoch{E}epochstep{S}globalstep{G}``), or a model folder
            (``.../{trial}/default``), meaning its newest committed export.
        local_dir: where the files go (created; must not exist or be empty). Default: a new
            temporary folder.
        storage_options: options of the object-store file system.

    Raises:
        FileNotFoundError: no committed export at ``uri``.
        CheckpointCorruptError: a downloaded file does not have the size its marker records.
    """
    check_path(uri, "uri")
    if not is_remote(uri):
        raise ConfigError("uri", f"{uri!r} is not an object-store URI; a local export folder loads with from_pretrained as is")
    uri = uri.rstrip("/")
    if parse_export_name(name(uri)) is None:
        exports = committed_exports(uri, storage_options)
        if not exports:
            raise CheckpointNotFoundError(f"{uri} holds no committed HF export ({MARKER})")
        uri = exports[-1][1]
    fs = filesystem(uri, storage_options)
    try:
        marker = json.loads(fs.cat_file(strip(fs, join(uri, MARKER))))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{uri} is not a committed HF export (no {MARKER}: the upload was interrupted, "
                                "or it is being replaced)") from None
    files: dict[str, int] = marker.get("files", {})
    target = Path(local_dir) if local_dir is not None else Path(tempfile.mkdtemp(prefix=f"{name(uri)}-"))
    if target.exists() and any(target.iterdir()):
        raise PathOccupiedError(f"{target} is not empty; give a new or empty folder")
    target.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    try:
        rels = sorted(files)
        for rel in rels:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get([strip(fs, join(uri, rel)) for rel in rels], [str(tmp / rel) for rel in rels])  # in parallel
        for rel, size in files.items():
            got = (tmp / rel).stat().st_size
            if got != size:
                raise CheckpointCorruptError(f"{join(uri, rel)}: downloaded {got} bytes, its marker records {size}")
        for child in tmp.iterdir():
            os.replace(child, target / child.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
