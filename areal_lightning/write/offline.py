"""Write: reading and copying recover checkpoints outside a training run (``convert``,
``inspect``, the commit stage's verification): tensor entries, tensors into given buffers, and
the stock-layout copy of ``convert --to dcp``."""

from __future__ import annotations


import io
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    TensorStorageMetadata,
)

from areal_lightning._torch_internals import (
    load_flat_state_dict,
    storage_info,
)
from areal_lightning.errors import CheckpointCorruptError
from areal_lightning.layout import COMMIT_MARKER
from areal_lightning.write.checksum import (
    ITEM_CHECKSUM,
    crc32c,
    check_item,
    read_item,
)
from areal_lightning.write.durable import fsync_dir
from areal_lightning.write.raw import is_raw
from areal_lightning.write.dcp_reader import Read, TemplateLoadPlanner, check_complete, reader_of

PathLike = Union[str, "os.PathLike[str]"]


def tensor_entries(path: PathLike, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The saved tensors of a complete checkpoint: flat key -> ``(size, dtype)``, in saved order."""
    path = check_complete(path, storage_options)
    try:
        metadata = reader_of(path, storage_options).read_metadata()
    except Exception as exc:
        raise CheckpointCorruptError(f"{path}/{COMMIT_MARKER} is unreadable: {exc!r}") from exc
    return {fqn: (tuple(md.size), md.properties.dtype) for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def read_tensors(path: PathLike, into: Mapping[str, torch.Tensor],
                 storage_options: Mapping[str, Any] | None = None) -> Read:
    """Read the tensors saved under the flat keys of ``into`` into those tensors (full size),
    each item verified against its CRC32C as it is read, without a process group; returns what
    was read. Only these items are read, one at a time, each straight into its tensor of
    ``into`` (a ``torch.save`` item of 0.2.0 and earlier: its bytes and the decoded tensor)."""
    path = check_complete(path, storage_options)
    reader = reader_of(path, storage_options, threads=1)
    try:
        load_flat_state_dict(dict(into), reader, TemplateLoadPlanner(True, set()))
    except (Exception, CheckpointException) as exc:
        if reader.failure is not None:
            raise reader.failure from None
        raise CheckpointCorruptError(f"failed to read checkpoint {path}: {exc!r}") from exc
    return reader.stats


def write_stock_copy(path: PathLike, out: Path) -> Read:
    """Copy the complete checkpoint at ``path`` into the new folder ``out`` in the layout of
    torch's own ``FileSystemWriter`` (every tensor item a ``torch.save`` container), which a
    stock ``dcp.load`` with a plain ``FileSystemReader`` reads; same files, keys, chunks and
    skeleton, each item's CRC32C recorded as in our saves. Every item is verified as it is
    read, one at a time (memory: about twice the largest item). Returns what was read."""
    path = check_complete(path)
    reader = reader_of(path, threads=1)
    try:
        metadata = reader.read_metadata()
    except Exception as exc:
        raise CheckpointCorruptError(f"{path}/{COMMIT_MARKER} is unreadable: {exc!r}") from exc
    reader.set_up_storage_reader(metadata, True)
    stats = Read()
    per_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in metadata.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((index, info))
    out.mkdir(parents=True)
    storage: dict[Any, Any] = {}
    for name, entries in per_file.items():
        source = reader.fs.concat_path(reader.path, name)
        with reader.fs.create_stream(source, "rb") as file, open(out / name, "wb") as target:
            for index, info in sorted(entries, key=lambda entry: entry[1].offset):
                if is_raw(info.transform_descriptors):
                    tensor, view = reader.read_chunk(file, source, info, index)
                    check_item(view, source, info, index.fqn)
                    buffer = io.BytesIO()
                    torch.save(tensor, buffer)
                    data = buffer.getbuffer()
                else:
                    data = read_item(file, source, info, index.fqn)
                    check_item(data, source, info, index.fqn)
                stats.nbytes += info.length
                record = storage_info(name, target.tell(), len(data))
                setattr(record, ITEM_CHECKSUM, crc32c(data))
                target.write(data)
                storage[index] = record
            target.flush()
            os.fsync(target.fileno())
    metadata.storage_data = storage
    if getattr(metadata, "storage_meta", None) is not None:
        metadata.storage_meta.load_id = None  # as saved: the reader stamped this read's random id on it
    with open(out / COMMIT_MARKER, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(out)
    return stats
