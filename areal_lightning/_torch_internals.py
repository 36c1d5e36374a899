"""The only module that touches torch's private names (torch 2.13).

Each function or constant below names the private it reads, builds or replaces; every one is
pinned by ``tests/test_torch_internals.py`` against the installed torch, so a torch upgrade
that moves one breaks one test with a clear name instead of a save or a resume.
``tests/test_internals.py`` checks that no other module of the package uses these names.

Why each is needed (public torch has no equivalent):

* DCP's per-item storage record, ``torch.distributed.checkpoint.filesystem._StorageInfo``
  (file, offset, length, transform descriptors): a writer that lays out its own files must
  return one per item, and it is what ``.metadata`` pickles (readers of every version find it
  under that name).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["PRIVATE_NAMES", "DATA_SUFFIX", "storage_info"]

PRIVATE_NAMES = ("_StorageInfo",)
"""torch's private names used here (and nowhere else in the package)."""

DATA_SUFFIX = ".distcp"
"""The suffix of DCP's data files (``torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX``)."""


def storage_info(relative_path: str, offset: int, length: int, descriptors: Sequence[str] | None = None) -> Any:
    """DCP's record of one item (``_StorageInfo``): ``length`` bytes at ``offset`` of the data
    file ``relative_path``, encoded by the transform ``descriptors`` (``None``: a ``torch.save``
    container, what every reader takes)."""
    return _StorageInfo(relative_path, offset, length,
                        transform_descriptors=list(descriptors) if descriptors else None)
