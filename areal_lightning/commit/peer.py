"""Commit: the memory tier's peer copy -- each sealed slot also in the tier of a rank on another node.

With ``replicas=1`` and two nodes or more, rank ``r`` (node ``r // ranks_per_node``: Lightning
numbers ranks node by node) sends each slot it sealed to the same local rank of the next node,
``(r + ranks_per_node) % world``, and receives the slots of the same local rank of the previous
node, over a gloo group of their own, in a background thread, in step order (every rank writes
the same steps). A received slot goes to ``{tier}/replica_of_rank{src}/slot{k}/`` (two slots, so
the newest complete copy is never the one being written): its files first, its ``SEALED.json``
last, as the owner wrote them (their CRC32Cs included). When a node is lost (its processes and
its tmpfs), the rerun on a replacement node gets each of its ranks' slots back from the peer
that holds it (:func:`restore`), then resumes as from its own tier.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_lightning._fault import fault_point
from areal_lightning.layout import COMMIT_MARKER, MEMORY_SEAL

__all__ = ["PeerCopy", "replica_folder", "send_slot", "receive_slot"]

REPLICA_SLOTS = 2


def replica_folder(tier: Path, source: int, serial: int) -> Path:
    """Where this node keeps the copy of rank ``source``'s slot of serial ``serial``."""
    return tier / f"replica_of_rank{source}" / f"slot{serial % REPLICA_SLOTS}"


def _files(slot: Path) -> list[tuple[str, bytes]]:
    """A slot's files, the seal last."""
    names = sorted(n for n in os.listdir(slot) if n != MEMORY_SEAL and not n.endswith(".tmp"))
    return [(name, (slot / name).read_bytes()) for name in [*names, MEMORY_SEAL]]


def _write(folder: Path, files: list[tuple[str, bytes]]) -> None:
    """Write a slot's files into ``folder``, unsealed first, the seal last."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in (MEMORY_SEAL, COMMIT_MARKER):
        (folder / name).unlink(missing_ok=True)
    for name, data in files:
        if name == MEMORY_SEAL:
            continue
        (folder / name).write_bytes(data)
    seal = dict(files)[MEMORY_SEAL]
    (folder / f"{MEMORY_SEAL}.tmp").write_bytes(seal)
    os.replace(folder / f"{MEMORY_SEAL}.tmp", folder / MEMORY_SEAL)


def _exchange(send: bytes | None, dst: int | None, src: int | None, group: Any) -> bytes | None:
    """Send ``send`` to ``dst`` and receive from ``src`` at once (either may be ``None``)."""
    ops = []
    length = torch.tensor([len(send) if send is not None else 0], dtype=torch.int64)
    incoming = torch.zeros(1, dtype=torch.int64)
    if dst is not None:
        ops.append(dist.isend(length, dst, group=group))
    if src is not None:
        ops.append(dist.irecv(incoming, src, group=group))
    for op in ops:
        op.wait()
    ops = []
    buffer = torch.empty(int(incoming.item()), dtype=torch.uint8)
    if dst is not None and send:
        ops.append(dist.isend(torch.frombuffer(bytearray(send), dtype=torch.uint8), dst, group=group))
    if src is not None and buffer.numel():
        ops.append(dist.irecv(buffer, src, group=group))
    for op in ops:
        op.wait()
    return bytes(buffer.numpy()) if src is not None else None


def send_slot(slot: Path, dst: int, group: Any) -> None:
    """Send a sealed slot's files to rank ``dst`` (which calls :func:`receive_slot`)."""
    _exchange(pickle.dumps(_files(slot)), dst, None, group)


def receive_slot(folder: Path, src: int, group: Any) -> None:
    """Receive the slot rank ``src`` sends (:func:`send_slot`) into ``folder``, sealed last."""
    data = _exchange(None, None, src, group)
    _write(folder, pickle.loads(data or b""))


class PeerCopy:
    """The peer copy of one rank (see the module doc): made on every rank at once (a collective:
    it creates the gloo group), when the run has two nodes or more."""

    def __init__(self, tier: Path, rank: int, world: int, ranks_per_node: int, timeout_s: float) -> None:
        self.tier = tier
        self.rank = rank
        self.peer = (rank + ranks_per_node) % world
        self.source = (rank - ranks_per_node) % world
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.replicated_step: int | None = None
        """The newest step of this rank's slots the peer holds."""

    def copy(self, slot: Path | None, serial: int, step: int) -> None:
        """Send this rank's sealed ``slot`` to the peer and receive the source's of the same step
        (fault point ``memory.mid_replica``: the slot sent, before the source's is written).
        ``slot`` ``None``: this rank's slot of the step could not be sealed; the exchange still
        happens (the peer is not left waiting) and the peer keeps nothing of it."""
        received = _exchange(pickle.dumps(_files(slot) if slot is not None else None), self.peer, self.source,
                             self.group)
        fault_point("memory.mid_replica")
        files = pickle.loads(received or b"")
        if files is None:  # the source's slot of this step was not sealed
            return
        _write(replica_folder(self.tier, self.source, serial), files)
        self.replicated_step = step

    def close(self) -> None:
        try:
            dist.destroy_process_group(self.group)
        except (ValueError, RuntimeError):  # the default group is gone already
            pass


def remove_replicas(tier: Path) -> None:
    """Delete every replica this node holds (``fit`` ended normally)."""
    for folder in tier.glob("replica_of_rank*"):
        shutil.rmtree(folder, ignore_errors=True)
