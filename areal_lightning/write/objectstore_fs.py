"""Write: where a DCP checkpoint lives (a local folder or an object-store prefix) and the
object-store file system DCP's writer and reader use there: our fsspec instance with the caller's
options, no folders to make, and an upload that fails is aborted, never published truncated."""

from __future__ import annotations


import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union


from areal_lightning._fault import fault_enabled, fault_point
from areal_lightning._torch_internals import (
    FsspecFileSystem,
)
from areal_lightning.objectstore import filesystem, is_remote

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------------------
# Where a checkpoint lives: a local folder (Path) or an object-store prefix (str URI)

Location = Union[Path, str]
"""A checkpoint directory: a local ``Path``, or an object-store URI (``s3://...``) as ``str``."""


def location(path: PathLike) -> Location:
    """``path`` as a :data:`Location`: a supported object-store URI stays a ``str``, anything else is a ``Path``."""
    return path if isinstance(path, str) and is_remote(path) else Path(path)



class ObjectFileSystem(FsspecFileSystem):
    """torch's fsspec ``FileSystem`` for object stores: our file system instance (with the
    caller's ``storage_options``), and no ``makedirs`` (object stores have no folders, and
    s3fs's may call ``CreateBucket``, which least-privilege credentials refuse)."""

    def __init__(self, storage_options: Mapping[str, Any]) -> None:
        super().__init__()
        self._options = dict(storage_options)

    def init_path(self, path: Any, **kwargs: Any) -> Any:
        self.fs = filesystem(str(path), self._options)
        return str(path)

    def mkdir(self, path: Any) -> None:
        """Nothing to create on an object store."""

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Any:
        """The object ``path`` opened in ``mode``. A write that fails is *discarded*: its
        multipart upload is aborted and no object appears (closing the file, as torch's
        fsspec stream does on an error, would upload the truncated buffer as an object)."""
        stream = self.fs.open(str(path), mode)
        if not any(ch in mode for ch in "wax+"):
            with stream:
                yield stream
            return
        upload = _Upload(stream)
        try:
            yield upload
        except BaseException as exc:
            stream.discard()  # s3fs: aborts the multipart upload, gcsfs the resumable one; adlfs's blocks stay uncommitted
            stream.closed = True
            if upload.error is not None and upload.error is not exc:
                # torch.save's zip writer reports a failed write as "unexpected pos": the cause is this
                raise upload.error from exc
            raise
        stream.close()


class _Upload:
    """An object being written: keeps the first error of a ``write`` (a failed part upload),
    which ``torch.save``'s zip writer would otherwise replace by its own message, and reports
    the fault point ``objectstore.mid_upload`` once the first part of a multipart upload is
    sent (the object is then incomplete and invisible: an S3 multipart upload, a GCS resumable
    upload, Azure blocks not yet committed)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._watch = fault_enabled()
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        try:
            written = self._raw.write(data)
            if self._watch and (getattr(self._raw, "offset", None) or 0) > 0:  # fsspec: bytes already sent
                self._watch = False
                fault_point("objectstore.mid_upload")
        except BaseException as exc:
            self.error = self.error or exc
            raise
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def on_object_store(storage: Any, path: Location, storage_options: Mapping[str, Any]) -> None:
    """Point a DCP ``FileSystemWriter``/``Reader`` at the object-store prefix ``path`` (what
    torch's ``FsspecWriter``/``FsspecReader`` do, with :class:`ObjectFileSystem`)."""
    storage.fs = ObjectFileSystem(storage_options)
    storage.path = storage.fs.init_path(path)
