"""Write: tensor items as their raw bytes, read straight into the destination's memory.

Since 0.3.0 a DCP save of this package writes each tensor item as the tensor's bytes in
row-major order (no per-item ``torch.save`` zip, no pickling): dtype and shape are DCP's own
chunk metadata. Such an item's ``_StorageInfo`` carries the transform descriptor
:data:`RAW_DESCRIPTOR`, so a stock DCP reader refuses it by name ("Unknown extension
name='areal.raw'") instead of misreading it; ``areal-lightning convert PATH --to dcp``
writes a copy every stock reader takes. Items without it (0.1.0 / 0.2.0 checkpoints, byte
items) are ``torch.save`` containers, read as before.

* Write: :func:`tensor_bytes` is a zero-copy view of a contiguous CPU tensor's bytes.
* Read: :func:`read_into` fills a contiguous CPU tensor from a file with ``readinto`` and
  computes the CRC32C over that same memory: one copy, from the page cache into the
  destination, then the check (:func:`~areal_lightning.write.checksum.check_item`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, BinaryIO

import torch

from areal_lightning.errors import CheckpointCorruptError
from areal_lightning.write.checksum import truncated

__all__ = ["RAW_DESCRIPTOR", "is_raw", "is_plain", "shows_its_bytes", "resolved", "tensor_bytes", "read_into"]

RAW_DESCRIPTOR = "areal.raw/1"
"""DCP transform descriptor of a tensor item stored as raw row-major bytes (part of the format)."""


def is_raw(descriptors: Sequence[str] | None) -> bool:
    """Whether an item with these transform descriptors is raw bytes (else ``torch.save``).

    Raises :class:`CheckpointCorruptError` for descriptors this version cannot read."""
    if not descriptors:
        return False
    if list(descriptors) == [RAW_DESCRIPTOR]:
        return True
    raise CheckpointCorruptError(f"item encoded as {list(descriptors)!r}: this version reads {RAW_DESCRIPTOR!r} "
                                 "and torch.save items only (was it written by a newer areal-lightning?)")


def is_plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is stored as raw bytes: a plain, dense, unquantized tensor (others,
    e.g. quantized ones, stay ``torch.save`` items, which every reader takes)."""
    return type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_quantized


def shows_its_bytes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds the values it shows: not a lazily conjugated or
    negated view (``z.conj()``, ``z.conj().imag``: torch's conjugate and negative bits), whose
    bytes a raw write would store unconjugated and a raw read would fill wrongly."""
    return not (tensor.is_conj() or tensor.is_neg())


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, its memory holding the values it shows (a copy only for a lazily
    conjugated or negated view, see :func:`shows_its_bytes`)."""
    return tensor.detach().resolve_conj().resolve_neg()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU ``tensor`` (row-major), without a copy; the view keeps
    the tensor alive. (A ctypes array over its memory: about 1 us, against 5 us through
    ``numpy()``, which also has no bfloat16; it is paid per tensor of every save and load.)"""
    if tensor.numel() == 0:
        return memoryview(b"")
    if not (tensor.is_cpu and tensor.is_contiguous()) or not shows_its_bytes(tensor):
        raise ValueError(f"tensor_bytes needs a contiguous CPU tensor whose memory holds its values, got {tensor.device} "
                         f"{'contiguous' if tensor.is_contiguous() else 'non-contiguous'}"
                         f"{'' if shows_its_bytes(tensor) else ', a lazily conjugated or negated view'}")
    memory = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
    memory.owner = tensor  # the buffer lives as long as the view does
    return memoryview(memory).cast("B")


def read_into(file: BinaryIO, dest: torch.Tensor, path: Any, offset: int, key: str) -> memoryview:
    """Fill the contiguous CPU tensor ``dest`` with the bytes of ``file`` at ``offset`` (its
    whole size) and return the view of its memory that was filled (for the CRC).

    Raises :class:`CheckpointCorruptError` naming ``path`` and ``key`` if the file ends first."""
    view = tensor_bytes(dest)
    file.seek(offset)
    filled, need = 0, len(view)
    readinto = getattr(file, "readinto", None)
    while filled < need:
        if readinto is not None:
            got = readinto(view[filled:])
        else:
            chunk = file.read(need - filled)
            got = len(chunk)
            view[filled:filled + got] = chunk
        if not got:
            raise truncated(path, key, offset, need, offset + filled)
        filled += got
    return view
