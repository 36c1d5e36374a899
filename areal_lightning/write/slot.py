"""Write: one rank's slot of the memory tier, its tensors in one memory-mapped file.

A slot is the rank-local DCP checkpoint :mod:`areal_lightning.write.direct` writes (one data
file ``__0_0.distcp``, the skeleton after the tensors, ``.metadata`` with every item's CRC32C),
so every reader of recover checkpoints reads it. What differs is how it is written: the data
file of a slot is created once per layout (the tensors' keys, shapes and dtypes) and stays
mapped (``MAP_SHARED``; on tmpfs the mapping *is* the file's memory). A save is

* :meth:`SlotFile.copy` -- each tensor's bytes copied into its place in the mapping (a memcpy
  on CPU), each item's CRC32C computed by a second thread as the copy goes on;
* :meth:`SlotFile.finish` -- the skeleton after the tensors, ``.metadata``.

Both run at the save point, and the slot is then sealed: a crash after the save point of a step
never loses that step.

One file, one mapping and one ``.metadata`` per slot, whatever the number of tensors.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import torch

from areal_lightning._fault import fault_point
from areal_lightning._torch_internals import DATA_SUFFIX
from areal_lightning.write.checksum import ITEM_CHECKSUM, Written, crc32c
from areal_lightning.write.direct import ByteLayout, write_metadata
from areal_lightning.write.raw import tensor_bytes

__all__ = ["SlotFile", "DATA_FILE"]

_HASH_BATCH = 16 << 20
"""Bytes of copied items checksummed as one task of the hashing thread."""


def _hash(batch: list[tuple[Any, torch.Tensor]]) -> float:
    """Put each item's CRC32C (of its bytes in the slot) on its record; seconds spent."""
    start = time.perf_counter()
    for item, view in batch:
        setattr(item.info, ITEM_CHECKSUM, crc32c(tensor_bytes(view)))
    return time.perf_counter() - start


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future

DATA_FILE = f"__0_0{DATA_SUFFIX}"
"""The data file of a slot (a rank-local checkpoint: written as rank 0's first file)."""



class SlotFile:
    """The mapped data file of one slot for one layout (see the module doc).

    Args:
        folder: the slot's folder (created).
        layout: where each tensor goes (a one-file :class:`~areal_lightning.write.direct.ByteLayout`).
    """

    def __init__(self, folder: Path, layout: ByteLayout) -> None:
        self.folder = folder
        self.layout = layout
        items = layout.files[0]
        self.nbytes = sum(item.nbytes for item in items)
        """Bytes of the tensors (the skeleton follows them in the file)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / DATA_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
        finally:
            os.close(fd)
        self.data = (torch.from_file(str(self.path), shared=True, size=self.nbytes, dtype=torch.uint8)
                     if self.nbytes else torch.empty(0, dtype=torch.uint8))
        self.views = [(item, self.data[item.offset:item.offset + item.nbytes]) for item in items]
        base = self.data.data_ptr() if self.nbytes else 0
        self._items = [(item, view, base + item.offset) for item, view in self.views if item.nbytes]
        self._empty_items = [(item, view) for item, view in self.views if item.nbytes == 0]

    @property
    def key(self) -> tuple[Any, ...]:
        """The layout's signature (what the file was made for)."""
        return self.layout.key

    def copy(self, flat: Mapping[str, Any], hasher: Executor | None = None) -> float:
        """Copy every tensor of ``flat`` (the layout's keys) into its bytes in the mapping and
        checksum what was copied (each item's CRC32C): a contiguous host tensor by one ``memmove``
        (a few microseconds less per tensor than a torch operation, and one thread: the other
        cores hash), others (device, non-contiguous) by ``copy_``. The checksums of each run of
        about 16 MB of copied items are computed by ``hasher`` (a thread) while the next items
        are copied: the copy and the hashing overlap, CRC32C and memcpy running at about the same
        speed. Fault point ``memory.mid_copy`` halfway through the tensors. Returns the seconds
        spent hashing."""
        pending: list[Future] = []
        batch: list[tuple[Any, torch.Tensor]] = []
        size = 0

        def flush() -> None:
            nonlocal batch, size
            if batch:
                pending.append(hasher.submit(_hash, batch) if hasher is not None else _done(_hash(batch)))
            batch, size = [], 0

        half = len(self._items) // 2
        for i, (item, view, address) in enumerate(self._items):
            if i == half:
                fault_point("memory.mid_copy")
            tensor = flat[item.key]
            if tensor.is_cpu and tensor.is_contiguous():
                ctypes.memmove(address, tensor.data_ptr(), item.nbytes)
            else:
                view.copy_(tensor.detach().reshape(-1).view(torch.uint8))
            batch.append((item, view))
            size += item.nbytes
            if size >= _HASH_BATCH:
                flush()
        for item, _ in self._empty_items:
            setattr(item.info, ITEM_CHECKSUM, crc32c(b""))
        flush()
        return sum(future.result() for future in pending)

    def finish(self, skeleton: bytes, written: Written) -> None:
        """After :meth:`copy`: the ``skeleton`` after the tensors, then ``.metadata`` (after the
        fault point ``memory.before_metadata``); what was written goes to ``written``."""
        with open(self.path, "r+b") as file:
            file.seek(self.nbytes)
            file.write(skeleton)
            file.truncate()
        info = self.layout.skeleton
        info.offset, info.length = self.nbytes, len(skeleton)
        setattr(info, ITEM_CHECKSUM, crc32c(skeleton))
        written.nbytes += self.nbytes + len(skeleton)
        written.items = len(self.views) + 1
        fault_point("memory.before_metadata")
        write_metadata(self.folder, self.layout.metadata, written, points=(None, None))

    def close(self) -> None:
        """Drop the mapping (the file stays)."""
        self.views, self._items, self._empty_items = [], [], []
        self.data = torch.empty(0, dtype=torch.uint8)
