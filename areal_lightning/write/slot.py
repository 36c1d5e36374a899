"""Write: one rank's slot of the memory tier, its tensors in one memory-mapped file.

A slot is the rank-local DCP checkpoint :mod:`areal_lightning.write.direct` writes (one data
file ``__0_0.distcp``, the skeleton after the tensors, ``.metadata`` with every item's CRC32C),
so every reader of recover checkpoints reads it. What differs is how it is written: the data
file of a slot is created once per layout (the tensors' keys, shapes and dtypes) and stays
mapped (``MAP_SHARED``; on tmpfs the mapping *is* the file's memory). A save is

* :meth:`SlotFile.copy` -- at the save point, each host tensor's bytes copied into its place in
  the mapping and checksummed in the same pass (:data:`FUSED`, the compiled ``_crc32c_copy``:
  one call per half of a thread's share of the items, the GIL released); the work split over a
  few threads. Where that extension is not built: a memcpy a chunk at a time, each chunk's
  CRC32C computed right after its copy, while it is in the CPU's cache; small tensors a group of
  about 1 MB at a time, by one call (:class:`_Unit`). It returns a :class:`PendingCopy`;
* :meth:`PendingCopy.wait` -- on CUDA, the device copies landed and their CRC32Cs;
* :meth:`SlotFile.finish` -- the skeleton after the tensors, ``.metadata``.

The last two run in the background (:class:`~areal_lightning.commit.memory_tier.MemoryTier`
seals the slot after them) while the next step's forward and backward run, and the next
optimizer step waits for them. (On CPU the checksums stay with the copy: computed later, in
the background, they re-read the slot from memory while training's threads use every core,
which slowed the next steps by more than the checksums cost here: measured in
``benchmarks/memory_tier.py``.)

On CUDA (:meth:`SlotFile.copy` given a stream) the mapping is page-locked for CUDA once per
layout (``cudaHostRegister``: the slot's own pages, no second host buffer) and the device
tensors are copied into it by DMA on a side stream, ordered after what training queued so
far; the save point returns once the copies are queued. The tensors the next step may change
before its optimizer step (buffers such as BatchNorm's statistics, anything that is not a
parameter or an optimizer state) are copied first, and the training stream waits on the GPU
for that part alone; parameters and optimizer states are copied while the next step's forward
and backward run, and :meth:`PendingCopy.wait` waits for them to land first.

One file, one mapping and one ``.metadata`` per slot, whatever the number of tensors.
"""

from __future__ import annotations

import ctypes
import os
from array import array
from collections.abc import Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Callable

import torch

from areal_lightning._fault import fault_point
from areal_lightning._torch_internals import DATA_PTR_FUNCTION, DATA_SUFFIX, copy_tensors
from areal_lightning.errors import CheckpointWriteError
from areal_lightning.stage.host import register_host, unregister_host
from areal_lightning.write.checksum import ITEM_CHECKSUM, KERNEL as _crc32c_copy, Written, crc32c, one_pass
from areal_lightning.write.direct import ByteLayout, freed_tensor, write_metadata
from areal_lightning.write.raw import tensor_bytes

__all__ = ["SlotFile", "PendingCopy", "DATA_FILE", "COPY_THREADS", "FUSED"]

FUSED = one_pass("copy")
"""Whether a slot's items are copied and checksummed in one pass (the compiled
``_crc32c_copy``: each byte loaded once, stored and fed to the CPU's CRC32C instruction; a call
of 4 MB or more stores past the caches; about 0.6-0.9x the time of torch's ``copy_`` here,
against 1.1-1.8x for a copy then a checksum); else
(not built, or no SSE4.2) a ``memmove`` or a group copy, then ``crc32c``."""

_ADDRESSES = DATA_PTR_FUNCTION if one_pass("addresses") else None
"""Where the one-pass extension reads a save's addresses in one call (torch's exported data_ptr
function); ``None`` where torch exports no such function or the extension was built before it
had ``addresses``: then each tensor's address is read in Python, with a look at the tensor."""

_CHUNK = 1 << 20
"""Bytes copied and then checksummed at a time (while the chunk is still in the CPU's cache)."""

COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
"""Threads a slot's copy is split over (each copies and checksums its share of the items)."""


_SMALL = 128 << 10
"""Items under this size are copied a group at a time (see :class:`_Unit`)."""

_GROUP = _CHUNK
"""Bytes of a group of consecutive small items, copied by one call, then checksummed while in
cache (groups of 128 KB made the 2,000-tensor save twice as slow: the GIL changes hands at
every call; groups of 4 MB outgrow the cache: measured)."""

_ITEM_COST = 4 << 10
"""An item's fixed cost in a group (about a microsecond: its copy's dispatch, its checksum call),
in bytes copied in that time."""


class _Unit:
    """What one call copies: a large item (chunk by chunk, each chunk checksummed right after
    its copy), or a group of consecutive small ones, copied into ``typed`` (views of their slot
    bytes with their shapes and dtypes) by one call that releases the GIL, then each
    checksummed; ``loose``: those of the group whose dtype cannot view their bytes at their
    offset (an odd-sized item before them), copied one by one. Items copied one at a time by
    threads taking turns at the GIL cost more than one thread copying them all (measured);
    groups spread over the threads do not."""

    __slots__ = ("entries", "grouped", "keys", "typed", "loose", "cost")

    def __init__(self, entries: list[Any], specs: Mapping[str, tuple[Any, torch.dtype]] | None = None) -> None:
        self.entries = entries
        views = [_typed(entry[1], *specs[entry[0].key]) if specs is not None else None for entry in entries]
        self.grouped = [entry for entry, view in zip(entries, views) if view is not None]
        self.keys = [entry[0].key for entry in self.grouped]
        self.typed = [view for view in views if view is not None]
        self.loose = [entry for entry, view in zip(entries, views) if view is None]
        self.cost = sum(entry[0].nbytes for entry in entries) + _ITEM_COST * len(entries)


def _typed(view: torch.Tensor, shape: Any, dtype: torch.dtype) -> torch.Tensor | None:
    """The slot bytes ``view`` as a tensor of ``shape`` and ``dtype`` (``None``: not aligned for it)."""
    try:
        return view.view(dtype).view(shape)
    except RuntimeError:
        return None


def _units(items: list[Any], specs: Mapping[str, tuple[Any, torch.dtype]] | None = None) -> list[_Unit]:
    """``items`` (entries in file order) as units: each item of :data:`_SMALL` bytes or more its
    own; runs of smaller ones in groups of up to :data:`_GROUP` bytes. ``specs``: each key's
    shape and dtype (``None``: groups without typed views, for checksums only)."""
    units: list[_Unit] = []
    run: list[Any] = []
    size = 0
    for entry in items:
        nbytes = entry[0].nbytes
        if run and (nbytes >= _SMALL or size + nbytes > _GROUP):
            units.append(_Unit(run, specs))
            run, size = [], 0
        if nbytes >= _SMALL:
            units.append(_Unit([entry]))
        else:
            run.append(entry)
            size += nbytes
    if run:
        units.append(_Unit(run, specs))
    return units


def _shares(units: list[_Unit], k: int) -> list[list[_Unit]]:
    """``units`` split into up to ``k`` lists of about equal cost (largest first to the least
    loaded), each in file order."""
    shares: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(units)), key=lambda i: -units[i].cost):
        least = loads.index(min(loads))
        shares[least].append(i)
        loads[least] += units[i].cost
    return [[units[i] for i in sorted(share)] for share in shares if share]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as a flat ``uint8`` tensor (a view when contiguous, else a contiguous
    copy), what a slot's byte view is copied from."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class _Pass:
    """Items for one call of the one-pass copy (:data:`FUSED`): their keys, slot views and
    records, and their slot addresses, sizes and the CRC32Cs out, as the arrays it takes;
    ``index``: the positions of the pass's tensors among all of a save's, in the layout's order
    (``sources``: their addresses, read by the extension's ``addresses``)."""

    __slots__ = ("keys", "views", "infos", "dsts", "sizes", "none", "out", "index", "sources")

    def __init__(self, entries: list[Any], position: Mapping[str, int]) -> None:
        self.keys = [entry[0].key for entry in entries]
        self.views = [entry[1] for entry in entries]
        self.infos = [entry[0].info for entry in entries]
        self.dsts = array("Q", [entry[2] for entry in entries])
        self.sizes = array("Q", [entry[0].nbytes for entry in entries])
        self.none = array("Q", bytes(8 * len(entries)))  # no sources: checksums of the slot bytes
        self.out = array("I", bytes(4 * len(entries)))
        self.index = array("Q", [position[key] for key in self.keys])
        self.sources = array("Q", bytes(8 * len(entries)))  # filled by each save's addresses

    def copy(self, flat: Mapping[str, Any] | None, values: list[torch.Tensor] | None = None) -> None:
        """Copy each item from ``flat`` into the slot and compute its CRC32C, in one call that
        releases the GIL (:meth:`record` puts the CRC32Cs on the records, after the save point);
        ``flat=None``: only the CRC32Cs of what the slot holds. ``values``: ``flat``'s tensors in
        the layout's order, all contiguous host tensors with a storage (known by the caller:
        their addresses are read by one call of :data:`_ADDRESSES`, without a look at each one);
        else a source the call cannot read (not a contiguous host tensor) is copied by
        ``copy_`` first, then checksummed in the slot."""
        if flat is None:
            sources = self.none
        elif values is not None:  # every address by one call
            sources = self.sources
            freed = _crc32c_copy.addresses(_ADDRESSES, torch.Tensor, values, self.index, sources)
            if freed >= 0:  # (to the copy, 0 is no source: the slot's own bytes checksummed)
                raise _no_storage(self.keys[freed])
        else:
            tensors = [flat[key] for key in self.keys]
            sources = array("Q", [t.data_ptr() if t.is_cpu and t.is_contiguous() else 0 for t in tensors])
            if 0 in sources:
                for i, source in enumerate(sources):
                    if not source:
                        if tensors[i].is_cpu and tensors[i].is_contiguous():
                            raise _no_storage(self.keys[i])
                        self.views[i].copy_(_as_bytes(tensors[i]))
        _crc32c_copy.copy(self.dsts, sources, self.sizes, self.out)

    def record(self) -> None:
        """Put the CRC32Cs of the last :meth:`copy` on the items' records (for ``.metadata``)."""
        for info, value in zip(self.infos, self.out):
            setattr(info, ITEM_CHECKSUM, value)


_DATA_PTR = torch.Tensor.data_ptr


def _no_storage(key: str) -> CheckpointWriteError:
    """:func:`~areal_lightning.write.direct.freed_tensor` of the memory tier's copy."""
    return freed_tensor(key, "memory tier", "copy")


def _refuse_freed(keys: list[str], addresses: Any) -> None:
    """Raise :func:`_no_storage` for the first of ``keys`` whose address (``data_ptr()``, in the
    same order) is 0."""
    if 0 in addresses:
        raise _no_storage(keys[addresses.index(0)])


def _passes(share: list[_Unit], position: Mapping[str, int]) -> list[_Pass]:
    """A share of units as the two halves the one-pass copy takes (the fault point between)."""
    entries = [entry for unit in share for entry in unit.entries]
    return [_Pass(entries[:len(entries) // 2], position), _Pass(entries[len(entries) // 2:], position)]


def _fused_copy(passes: list[_Pass], flat: Mapping[str, Any], fault: bool,
                values: list[torch.Tensor] | None = None) -> None:
    """:func:`_copy_share` by the one-pass copy (:data:`FUSED`); ``fault``: ``memory.mid_copy``
    between its halves; ``values``: see :meth:`_Pass.copy`."""
    passes[0].copy(flat, values)
    if fault:
        fault_point("memory.mid_copy")
    passes[1].copy(flat, values)


def _fused_checksum(passes: list[_Pass]) -> None:
    """:func:`_checksum_share` by the one-pass code (:data:`FUSED`)."""
    for part in passes:
        part.copy(None)
        part.record()


def _copy_share(share: list[_Unit], flat: Mapping[str, Any], fault: bool, values: Any = None) -> None:
    """Copy each unit of ``share`` into the slot and put each item's CRC32C on its record: a
    group by one call, then each item checksummed (on the slot's bytes, ``mapped``: a view made
    with the layout) while in cache; a contiguous host tensor by ``memmove`` one chunk at a
    time, each chunk checksummed right after its copy; others by ``copy_``, then checksummed.
    ``fault``: this share hits ``memory.mid_copy`` halfway; ``values``: unused (the one-pass
    copy's)."""
    half = len(share) // 2
    for i, unit in enumerate(share):
        if fault and i == half:
            fault_point("memory.mid_copy")
        if unit.typed:
            sources = [flat[key] for key in unit.keys]
            _refuse_freed(unit.keys, list(map(_DATA_PTR, sources)))
            copy_tensors(unit.typed, sources)
            for item, _view, _address, mapped in unit.grouped:
                setattr(item.info, ITEM_CHECKSUM, crc32c(mapped))
        for item, view, address, mapped in unit.loose:
            _copy_item(item, view, address, mapped, flat[item.key])


def _copy_item(item: Any, view: torch.Tensor, address: int, mapped: memoryview, tensor: torch.Tensor) -> None:
    """One item of :func:`_copy_share` copied on its own."""
    nbytes = item.nbytes
    source = tensor.data_ptr()
    if not source:
        raise _no_storage(item.key)
    if tensor.is_cpu and tensor.is_contiguous():
        if nbytes <= _CHUNK:
            ctypes.memmove(address, source, nbytes)
            value = crc32c(mapped)
        else:
            value = 0
            for offset in range(0, nbytes, _CHUNK):
                size = min(_CHUNK, nbytes - offset)
                ctypes.memmove(address + offset, source + offset, size)
                value = crc32c(mapped[offset:offset + size], value)
    else:
        view.copy_(_as_bytes(tensor))
        value = crc32c(mapped)
    setattr(item.info, ITEM_CHECKSUM, value)


def _checksum_share(share: list[_Unit]) -> None:
    """Put the CRC32C of each item's slot bytes on its record (after a device copy landed)."""
    for unit in share:
        for item, _view, _address, mapped in unit.entries:
            setattr(item.info, ITEM_CHECKSUM, crc32c(mapped))


def _run_shares(function: Callable[..., None], shares: list[list[Any]], pool: Executor | None, *args: Any) -> None:
    """``function(share, *args)`` for every share, the first in the calling thread, the others
    on ``pool``; returns once all ended, raising the first failure."""
    assert pool is not None or len(shares) <= 1
    futures = [pool.submit(function, share, *args) for share in shares[1:]] if pool is not None else []
    try:
        if shares:
            function(shares[0], *args)
    finally:
        done = [future.exception() for future in futures]  # every share ends before the slot is used
    for failure in done:
        if failure is not None:
            raise failure


class PendingCopy:
    """One save's copy into a slot, returned by :meth:`SlotFile.copy` at the save point (the
    host tensors copied and checksummed): :meth:`wait` returns once the device copies queued on
    the copy stream landed and every item's CRC32C is on its record (the host items' were
    computed by the copy: ``copied``, the one-pass halves that put them there)."""

    def __init__(self, done: Any, shares: list[list[Any]], device: bool, pinned: bool,
                 copied: list[list[_Pass]] | None = None) -> None:
        self._done = done
        self._shares = shares
        self._copied = copied or []
        self.device = device
        """Whether CUDA tensors were copied (on the copy stream)."""
        self.pinned = pinned
        """CUDA: whether the copies went to page-locked memory (else they ran synchronously)."""

    def wait(self, pool: Executor | None = None) -> None:
        """Until the copies landed; then the checksums, in the copy's shares of the items (the
        calling thread takes one, ``pool`` the others; all in this thread without a pool)."""
        for passes in self._copied:  # off the save point: 2,000 records cost 0.1 ms
            for part in passes:
                part.record()
        if self._done is not None:
            self._done.synchronize()
        if self._shares:
            shares = self._shares if pool is not None else [[part for share in self._shares for part in share]]
            _run_shares(_fused_checksum if FUSED else _checksum_share, shares, pool)


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
        self._items = [(item, view, base + item.offset, tensor_bytes(view)) for item, view in self.views if item.nbytes]
        self._empty_items = [(item, view) for item, view in self.views if item.nbytes == 0]
        self._specs = {fqn: (shape, dtype) for fqn, shape, dtype, *_ in layout.key}
        self._position = {fqn: i for i, (fqn, *_) in enumerate(layout.key)}  # in a save's flat dict
        self._split_made: tuple[Any, ...] | None = None  # (device keys and k, host shares, device shares)
        self._pinned: bool | None = None  # CUDA: whether the mapping is page-locked (None: not tried)

    @property
    def key(self) -> tuple[Any, ...]:
        """The layout's signature (what the file was made for)."""
        return self.layout.key

    def copy(self, flat: Mapping[str, Any], pool: Executor | None = None, threads: int = 1, *,
             stream: Any = None, late: Callable[[torch.Tensor], bool] | None = None,
             plain: bool = False) -> PendingCopy:
        """Copy every tensor of ``flat`` (the layout's keys) into its bytes in the mapping; the
        host tensors are split into up to ``threads`` shares of about equal cost (see
        :func:`_shares`), run on ``pool`` (the calling thread takes one); each copies a chunk of about 1 MB (a ``memmove`` for a
        contiguous tensor, ``copy_`` otherwise) and checksums it while it is in the CPU's cache.
        Fault point ``memory.mid_copy`` halfway through the first share (with CUDA tensors: after
        their early part was queued).

        ``stream`` (a CUDA stream): the CUDA tensors are copied on it instead, after what the
        current stream queued so far; those ``late`` says may wait (parameters, optimizer
        states) after the others, and the current stream waits for the others only. Returns
        the :class:`PendingCopy` to wait for (its checksums computed) before the ``late``
        tensors change and before the slot is sealed.

        ``plain``: the caller knows every tensor of ``flat`` is a contiguous host tensor with a
        storage and ``flat`` is in the layout's order (its
        :class:`~areal_lightning.write.direct.Signatures` checked them): where the extension
        reads addresses (:data:`_ADDRESSES`), they are taken without a look at each one."""
        k = threads if pool is not None else 1
        device = ([entry for entry in self._items if flat[entry[0].key].is_cuda]
                  if stream is not None and not plain else [])
        host_shares, device_shares = self._split(device, k)
        done = self._copy_device(flat, device, stream, late or (lambda tensor: False)) if device else None
        values = list(flat.values()) if plain and _ADDRESSES is not None else None
        try:
            _run_shares(_fused_copy if FUSED else _copy_share, host_shares, pool, flat, not device, values)  # fault: host-only
        except BaseException:
            if done is not None:
                done.synchronize()  # the device copies end before the failure leaves the slot
            raise
        for item, _ in self._empty_items:
            setattr(item.info, ITEM_CHECKSUM, crc32c(b""))
        return PendingCopy(done, device_shares, bool(device), bool(self._pinned), host_shares if FUSED else None)

    def _copy_device(self, flat: Mapping[str, Any], device: list[Any], stream: Any,
                     late: Callable[[torch.Tensor], bool]) -> Any:
        """Queue the copies of the CUDA tensors ``device`` (entries of the layout) on ``stream``
        (see :meth:`copy`); the mapping is page-locked at the first one. Returns the event
        recorded after the last one. A non-contiguous tensor
        is copied in the early part (its contiguous copy, made on the training stream, is
        released at once: ``record_stream`` keeps the allocator from reusing it before the copy
        stream read it). A failure after copies were queued waits for them before it propagates
        (the slot's pages stay mapped and registered while a copy may write them)."""
        if self._pinned is None:
            self._pinned = register_host(self.data.data_ptr(), self.nbytes)
        early, rest = [], []
        for entry in device:
            tensor = flat[entry[0].key]
            (rest if tensor.is_contiguous() and late(tensor) else early).append(entry)
        current = torch.cuda.current_stream()
        stream.wait_stream(current)  # the state as training left it at the save point
        try:
            with torch.cuda.stream(stream):
                for part in (early, rest):
                    for item, view, _address, _mapped in part:
                        tensor = flat[item.key].detach()
                        if tensor.is_contiguous():
                            source = _as_bytes(tensor)  # a view: no kernel
                        else:
                            with torch.cuda.stream(current):  # its contiguous copy, on the training stream
                                source = _as_bytes(tensor)
                            stream.wait_stream(current)
                        view.copy_(source, non_blocking=bool(self._pinned))
                        source.record_stream(stream)
                    if part is early:
                        first = torch.cuda.Event()
                        first.record(stream)
                        fault_point("memory.mid_copy")
                done = torch.cuda.Event()
                done.record(stream)
        except BaseException:
            stream.synchronize()
            raise
        current.wait_event(first)  # the next step's kernels run after the early part landed
        return done

    def _split(self, device: list[Any], k: int) -> tuple[list[list[Any]], list[list[Any]]]:
        """For ``k`` threads: the shares of the host tensors' units (copied at the save point) and
        of the CUDA tensors' (``device``, entries: only checksummed, once landed; small ones in
        groups too, so threads do not take turns at the GIL per item); with :data:`FUSED` each
        share as its two :class:`_Pass` halves. Made once per set of CUDA tensors and ``k``."""
        key = (frozenset(entry[0].key for entry in device), k, FUSED)
        if self._split_made is None or self._split_made[0] != key:
            host = [entry for entry in self._items if entry[0].key not in key[0]]
            split = _shares(_units(host, None if FUSED else self._specs), k), _shares(_units(device), k)
            if FUSED:
                split = tuple([_passes(share, self._position) for share in shares] for shares in split)
            self._split_made = (key, *split)
        return self._split_made[1], self._split_made[2]

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
        write_metadata(self.folder, self.layout.metadata, written, points=(None, None), layout=self.layout)

    def close(self) -> None:
        """Drop the mapping (the file stays); unregister it from CUDA first."""
        if self._pinned:
            unregister_host(self.data.data_ptr())
            self._pinned = None
        self.views, self._items, self._empty_items, self._split_made = [], [], [], None
        self.data = torch.empty(0, dtype=torch.uint8)
