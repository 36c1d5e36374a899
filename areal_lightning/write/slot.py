"""Write: one rank's slot of the memory tier, its tensors in one memory-mapped file.

A slot is the rank-local DCP checkpoint :mod:`areal_lightning.write.direct` writes (one data
file ``__0_0.distcp``, the skeleton after the tensors, ``.metadata`` with every item's CRC32C),
so every reader of recover checkpoints reads it. What differs is how it is written: the data
file of a slot is created once per layout (the tensors' keys, shapes and dtypes) and stays
mapped (``MAP_SHARED``; on tmpfs the mapping *is* the file's memory). A save is

* :meth:`SlotFile.copy` -- each tensor's bytes copied into its place in the mapping: the one
  part of a save training waits for (a memcpy on CPU);
* :meth:`SlotFile.finish` -- then, in the background: each item's CRC32C, the skeleton after
  the tensors, ``.metadata``.

One file, one mapping and one ``.metadata`` per slot, whatever the number of tensors.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from areal_lightning._fault import fault_point
from areal_lightning._torch_internals import DATA_SUFFIX
from areal_lightning.write.checksum import ITEM_CHECKSUM, Written, crc32c
from areal_lightning.write.direct import ByteLayout, write_metadata
from areal_lightning.write.raw import tensor_bytes

__all__ = ["SlotFile", "DATA_FILE"]

_SMALL = 1 << 20
"""Tensors of fewer bytes are copied by ``memmove`` (see :meth:`SlotFile.copy`)."""

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
        self._small = [(item.key, base + item.offset, item.nbytes) for item in items if 0 < item.nbytes < _SMALL]
        self._large = [(item.key, view) for item, view in self.views if item.nbytes >= _SMALL]

    @property
    def key(self) -> tuple[Any, ...]:
        """The layout's signature (what the file was made for)."""
        return self.layout.key

    def copy(self, flat: Mapping[str, Any]) -> None:
        """Copy every tensor of ``flat`` (the layout's keys) into its bytes in the mapping: the
        large ones by ``copy_`` (torch's parallel copy), the small contiguous host ones by one
        ``memmove`` each (a few microseconds less per tensor than a torch operation: what a
        state of thousands of small tensors pays). Fault point ``memory.mid_copy`` after the
        large ones."""
        for key, view in self._large:
            view.copy_(flat[key].detach().reshape(-1).view(torch.uint8))
        fault_point("memory.mid_copy")
        for key, address, nbytes in self._small:
            tensor = flat[key]
            if tensor.is_cpu and tensor.is_contiguous():
                ctypes.memmove(address, tensor.data_ptr(), nbytes)
            else:
                self.data[address - self.data.data_ptr():][:nbytes].copy_(
                    tensor.detach().reshape(-1).view(torch.uint8))

    def finish(self, skeleton: bytes, written: Written) -> None:
        """Each item's CRC32C, the ``skeleton`` after the tensors, then ``.metadata`` (after the
        fault point ``memory.before_metadata``); what was written goes to ``written``."""
        start = time.perf_counter()
        for item, view in self.views:
            setattr(item.info, ITEM_CHECKSUM, crc32c(tensor_bytes(view)))
        written.hash_s += time.perf_counter() - start
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
        self.views, self._small, self._large = [], [], []
        self.data = torch.empty(0, dtype=torch.uint8)
