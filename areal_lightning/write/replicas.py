"""Write: replicated tensors that are not equal on every rank.

torch DCP treats a tensor that is not sharded (no ``DTensor`` / ``ShardedTensor``) as
identical on every rank and writes it once, from whichever rank its de-duplication picks.
Under DDP that holds for parameters and optimizer states, not for state a rank keeps of its
own: BatchNorm running statistics (each rank updates them in its own forward; DDP broadcasts
rank 0's at the start of the next one), or buffers a user never synchronizes (a per-rank
experience buffer, per-rank running reward statistics).

So a collective save agrees, per tensor, whether it is equal on every rank: each rank sends a
fingerprint of each of its replicated tensors (CRC32C of the bytes for CPU tensors, 16 MB pieces
hashed in parallel threads; for
device tensors two position-weighted sums computed on the device, 16 bytes copied back) with
the agreement every save already makes; no tensor is gathered. A tensor equal everywhere is
stored once, as before. One that differs is stored under its usual key by rank 0 only (so
``convert``, a stock DCP load and Lightning's view of the checkpoint see rank 0's copy, as in
Lightning's own checkpoint) and by every other rank under
``areal_per_rank/{world_size}/{rank}/{key}``. At load, each rank of a run with the same
world size takes its own copy back; under another world size every rank takes rank 0's (what
DDP itself would broadcast), and the tensors concerned are named in a warning.
"""

from __future__ import annotations

import logging
import os
from array import array
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import torch

from areal_lightning.write.checksum import KERNEL, crc32c, one_pass
from areal_lightning.write.raw import resolved, shows_its_bytes, tensor_bytes

log = logging.getLogger(__name__)

__all__ = ["PREFIX", "fingerprints", "differing", "store_per_rank", "restore_per_rank", "is_per_rank_key",
           "warn_world_change"]

PREFIX = "areal_per_rank/"
"""Key prefix of the per-rank copies: ``areal_per_rank/{world_size}/{rank}/{key}``."""


def _replicated(value: Any) -> bool:
    """A dense, unquantized tensor that is not a ``DTensor`` / ``ShardedTensor`` (those are
    sharded by their owner); sparse and quantized tensors have no flat bytes to fingerprint and
    keep DCP's write-once treatment."""
    return (isinstance(value, torch.Tensor) and not hasattr(value, "device_mesh")
            and not hasattr(value, "local_shards") and value.layout == torch.strided and not value.is_quantized)


_CHUNK = 1 << 22  # bytes summed at once on the device: bounds the scratch memory to ~100 MB


def _device_fingerprints(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Two position-weighted sums of each tensor's bytes, computed where the tensor is, a chunk
    at a time (one copy of 16 bytes per tensor back to the host, for all of them at once)."""
    sums = []
    for t in tensors:
        data = resolved(t).contiguous().reshape(-1).view(torch.uint8)
        weights = torch.arange(min(_CHUNK, data.numel()), device=data.device, dtype=torch.int64)
        total = torch.zeros(2, dtype=torch.int64, device=data.device)
        for start in range(0, data.numel(), _CHUNK):
            chunk = data[start:start + _CHUNK].to(torch.int64)
            position = (weights[:chunk.numel()] + start) % 65521 + 1
            total += torch.stack([chunk.sum(), (chunk * position).sum()])
        sums.append(total)
    if not sums:
        return []
    return [tuple(pair) for pair in torch.stack(sums).cpu().tolist()]


_PIECE = 16 << 20  # bytes of a host tensor hashed as one piece (pieces are hashed in parallel)
_THREADS = min(8, os.cpu_count() or 1)  # CRC32C releases the GIL: the pieces scale with the cores


_ONE_CALL = one_pass("copy")
"""Whether the extension checksums many items' bytes by one call (``copy`` without sources)."""


def _host_digests(tensors: list[torch.Tensor]) -> list[tuple[int, ...]]:
    """CRC32C of each host tensor's bytes, one per piece of ``_PIECE`` bytes, the pieces of all
    tensors hashed by up to ``_THREADS`` threads once there are two pieces' worth of bytes (a
    replicated save hashes every rank's whole replicated state: one thread would cost about a
    memcpy of it; a small state is hashed on the calling thread, without starting threads).
    Tensors of one piece whose memory holds their values (contiguous, with a storage, not a
    lazily conjugated or negated view) are hashed by one call of the extension, the GIL
    released: a view of each costs about 15 us (2,048 tensors: 33-108 ms a save -> 3 ms)."""
    out: list[list[int]] = [[] for _ in tensors]
    rest = list(range(len(tensors)))
    if _ONE_CALL and tensors:
        rest, at, sizes, index = [], array("Q"), array("Q"), []
        for i, t in enumerate(tensors):
            nbytes = t.numel() * t.element_size()
            address = t.data_ptr() if 0 < nbytes < _PIECE and t.is_contiguous() and shows_its_bytes(t) else 0
            if address:
                at.append(address)
                sizes.append(nbytes)
                index.append(i)
            else:
                rest.append(i)
        crcs = array("I", bytes(4 * len(index)))
        KERNEL.copy(at, array("Q", bytes(8 * len(index))), sizes, crcs)  # no sources: each item's own bytes, read
        for i, crc in zip(index, crcs):
            out[i].append(crc)
    pieces: list[tuple[int, memoryview]] = []
    for index, t in ((i, tensors[i]) for i in rest):
        data = resolved(t)
        view = tensor_bytes(data if data.is_contiguous() else data.contiguous())
        pieces += [(index, view[start:start + _PIECE]) for start in range(0, max(len(view), 1), _PIECE)]
    if _THREADS > 1 and len(pieces) > 1 and sum(len(view) for _, view in pieces) >= 2 * _PIECE:
        with ThreadPoolExecutor(_THREADS, thread_name_prefix="areal-fingerprint") as pool:
            digests = list(pool.map(lambda piece: crc32c(piece[1]), pieces))
    else:
        digests = [crc32c(view) for _, view in pieces]
    for (index, _), digest in zip(pieces, digests):
        out[index].append(digest)
    return [tuple(d) for d in out]


def fingerprints(flat: Mapping[str, Any]) -> dict[str, tuple]:
    """``{key: fingerprint}`` of every replicated tensor of a flat state dict: dtype, shape
    and a digest of the bytes (exact for all practical purposes, no tensor leaves the rank)."""
    out: dict[str, tuple] = {}
    on_host: list[tuple[str, torch.Tensor]] = []
    on_device: list[tuple[str, torch.Tensor]] = []
    for key, value in flat.items():
        if _replicated(value):
            (on_host if value.is_cpu else on_device).append((key, value))
    for (key, value), digest in zip(on_host, _host_digests([v for _, v in on_host])):
        out[key] = (str(value.dtype), tuple(value.shape), digest)
    for (key, value), digest in zip(on_device, _device_fingerprints([v for _, v in on_device])):
        out[key] = (str(value.dtype), tuple(value.shape), digest)
    return out


def differing(gathered: list[Mapping[str, tuple]]) -> list[str]:
    """Keys (present on every rank) whose fingerprints are not the same on every rank; the same
    list on every rank, given every rank's fingerprints."""
    common = set(gathered[0]).intersection(*gathered[1:])
    return sorted(key for key in common if any(g[key] != gathered[0][key] for g in gathered[1:]))


def store_per_rank(flat: dict[str, Any], keys: Iterable[str], rank: int, world_size: int) -> None:
    """On ranks other than 0, move each of ``keys`` to its per-rank key (rank 0 keeps the
    usual key, so it alone writes it). In place."""
    if rank == 0:
        return
    for key in keys:
        flat[f"{PREFIX}{world_size}/{rank}/{key}"] = flat.pop(key)


def is_per_rank_key(key: str) -> bool:
    """Whether ``key`` is a per-rank copy."""
    return key.startswith(PREFIX)


def restore_per_rank(keys: Iterable[str], rank: int, world_size: int) -> tuple[dict[str, str], list[str]]:
    """For the saved keys ``keys``: ``({per-rank key: usual key} to load for this rank, [usual
    keys saved per rank that this run resolves to rank 0's copy])``. ``rank``/``world_size``:
    this process's (0 and 1 without a process group: rank 0's copies)."""
    mine: dict[str, str] = {}
    other_world: set[str] = set()
    for key in keys:
        if not is_per_rank_key(key):
            continue
        world, owner, usual = key[len(PREFIX):].split("/", 2)
        if int(world) == world_size and int(owner) == rank:
            mine[key] = usual
        elif int(world) != world_size:  # also one process: a 1-rank resume, or convert
            other_world.add(usual)
    return mine, sorted(other_world)


def warn_world_change(keys: list[str]) -> None:
    """The warning of a load under another world size that resolves per-rank tensors."""
    if keys:
        shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        log.warning("areal_lightning: %d tensor(s) differed across the ranks that saved this checkpoint (%s); "
                    "this load under another world size (or convert) takes rank 0's copy of each, the one DDP broadcasts",
                    len(keys), shown)
