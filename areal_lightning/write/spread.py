"""Write: a collective save of replicated and of sharded tensors, spread over the ranks without DCP's planning.

Under DDP every rank holds the whole state as plain tensors. DCP plans such a save collectively
every time: each rank makes a write item per tensor, the plans are gathered, de-duplicated
and sent back, and rank 0 pickles the whole ``Metadata`` (2,048 tensors on 2 ranks: about
0.15 s a save, against 0.015 s for the same save on one rank; measured). Nothing here needs
planning: the agreement every collective save already makes (each rank's failure, and each
tensor's fingerprint, :mod:`areal_lightning.write.replicas`) tells every rank every tensor's
dtype and shape and whether it is equal on every rank. From that, every rank computes the same
:func:`plan`:

* a tensor equal on every rank is written once, by the rank with the fewest bytes so far (in
  rank 0's order), so the ranks share the writing as DCP's de-duplication shares it;
* a tensor that differs is written by every rank: rank 0 under its key, the others under
  their per-rank keys (``areal_per_rank/{world}/{rank}/{key}``, as :mod:`replicas` stores them);
* rank 0 writes the skeleton.

Each rank writes its part into its own files ``__{rank}_{i}.distcp``
(:func:`~areal_lightning.write.direct.write_files`, by a
:class:`~areal_lightning.write.direct.ByteLayout` of its part made once while the plan holds);
then all agree, each sending its items' CRC32Cs (and, until rank 0 has it, its part's
layout key), and rank 0 writes the merged ``.metadata``
(:meth:`~areal_lightning.write.direct.ByteLayout.merged`, from its second save on by its
pickle template). The checkpoint is the one DCP would have written: the same files, keys and
records, readable by DCP's loader and by ours.

Sharded tensors (FSDP2's ``DTensor`` s of ``Shard`` placements, FSDP1's ``ShardedTensor`` s of
one local shard) go the same way: each rank writes its own chunk of each
(:class:`~areal_lightning.write.direct.LocalShards`), and rank 0's ``.metadata`` lists every
rank's chunk of it, as DCP's does.

A save goes this way only when every rank offers it (a save to a local folder of plain or
such sharded tensors, sync or by the thread executor: :class:`Tokens`) and every rank has the
same replicated keys; else DCP plans it as before.
"""

from __future__ import annotations

import math
from array import array
from typing import Any, Mapping, Sequence

import torch

from areal_lightning.write.direct import ONE_PASS_WRITE, ByteLayout
from areal_lightning.write.replicas import PREFIX

__all__ = ["Plan", "plan", "Tokens"]

_DTYPES = {str(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)}
"""``str(dtype) -> dtype`` (a fingerprint names its tensor's dtype as a string)."""


class Tokens:
    """A rank's offer of a spread save: ``(serial, thread_count, ONE_PASS_WRITE)``, where the
    serial changes when the rank's layout signature does (so an unchanged plan is recognised
    on every rank from the agreement alone), or ``None`` where this save cannot be spread."""

    def __init__(self) -> None:
        self._signature: tuple[Any, ...] | None = None
        self._serial = 0

    def __call__(self, signature: tuple[Any, ...] | None, thread_count: int) -> tuple[int, int, bool] | None:
        """The offer of a save whose tensors have layout ``signature``
        (:func:`~areal_lightning.write.direct.signature`; ``None``: no offer)."""
        if signature is None:
            return None
        if signature is not self._signature and signature != self._signature:
            self._serial += 1
            self._signature = signature
        return self._serial, thread_count, ONE_PASS_WRITE


class Plan:
    """This rank's part of a spread save, kept while every rank's offer and the differing keys stay."""

    def __init__(self, token: Any, layout: ByteLayout, positions: list[int], thread_counts: list[int]) -> None:
        self.token = token
        self.layout = layout
        """This rank's files (``rank=`` this rank)."""
        self.positions = positions
        """The places among this rank's tensors (in its signature's order) of its part's, in the part's order."""
        self.thread_counts = thread_counts
        self.confirmed = False
        """Whether rank 0 has every rank's layout key (set once an agreement carrying them succeeded)."""
        self._merged: ByteLayout | None = None
        self._parts: list[ByteLayout] = []

    def report(self) -> tuple[array, tuple[Any, ...] | None]:
        """What this rank sends after writing its files: its items' CRC32Cs, and its layout key
        and chunks until :attr:`confirmed`."""
        return self.layout.checksums(), None if self.confirmed else (self.layout.key, self.layout.chunks)

    def merged(self, reports: Sequence[tuple[array, tuple[Any, ...] | None]]) -> ByteLayout:
        """Rank 0: the whole save's layout, every rank's CRC32Cs on its records (``reports``:
        every rank's :meth:`report`). The other ranks' parts are made here from their keys and
        chunks, as those ranks made them (the same key, chunks, thread count and writer: the
        same placement)."""
        if self._merged is None:
            self._parts = [self.layout] + [ByteLayout(made[0], self.thread_counts[rank], rank=rank, chunks=made[1])
                                           for rank, (_, made) in enumerate(reports) if rank]
            self._merged = ByteLayout.merged(self._parts)
        for part, (crcs, _) in zip(self._parts[1:], reports[1:]):
            part.set_checksums(crcs)
        return self._merged


def plan(gathered: Sequence[tuple[Mapping[str, tuple], Any]], differ: Sequence[str], rank: int,
         signature: tuple[Any, ...] | None, thread_count: int, last: Plan | None,
         chunks: tuple[Any, ...] | None = None) -> Plan | None:
    """This rank's :class:`Plan` of a collective save (see the module doc), or ``None`` (on
    every rank alike) when it cannot be spread. ``gathered``: every rank's ``(fingerprints,
    offer)`` from the save's agreement; ``differ``: the keys whose fingerprints differ;
    ``signature``: this rank's tensors' layout signature (``None`` where it made no offer);
    ``chunks``: per entry of it, ``None`` or the ``(global size, offsets)`` of this rank's
    chunk of a sharded tensor (:class:`~areal_lightning.write.direct.LocalShards`: each held
    by this rank alone, written by it); ``last``: the plan of the last save, returned as it
    is when nothing it depends on changed."""
    offers = tuple(offer for _, offer in gathered)
    if signature is None or any(offer is None or offer[2] != ONE_PASS_WRITE for offer in offers):
        return None  # also a rank whose writer places items otherwise (rank 0 makes every rank's layout)
    prints = [fingerprints for fingerprints, _ in gathered]
    first = prints[0]
    whole = len(signature) if chunks is None else sum(chunk is None for chunk in chunks)
    if any(other.keys() != first.keys() for other in prints[1:]) or len(first) != whole:
        return None  # a replicated key some rank lacks: DCP plans it
    world, differs = len(gathered), set(differ)
    token = (offers, tuple(differ), rank, world)  # a process whose rank changed (a group made anew) plans anew
    if last is not None and last.token == token:
        return last
    loads = [0] * world
    owner: dict[str, int] = {}
    for fqn, (dtype, shape, _) in first.items():
        if fqn not in differs:
            least = loads.index(min(loads))
            owner[fqn] = least
            loads[least] += math.prod(shape) * _DTYPES[dtype].itemsize
    entries, positions, parts = [], [], []
    for position, entry in enumerate(signature):
        fqn = entry[0]
        chunk = chunks[position] if chunks is not None else None
        if chunk is not None:
            pass  # this rank's own chunk of a sharded tensor
        elif fqn in differs:
            if rank:
                entry = (f"{PREFIX}{world}/{rank}/{fqn}", *entry[1:])
        elif owner[fqn] != rank:
            continue
        entries.append(entry)
        positions.append(position)
        parts.append(chunk)
    layout = ByteLayout(tuple(entries), thread_count, rank=rank,
                        chunks=tuple(parts) if any(chunk is not None for chunk in parts) else None)
    return Plan(token, layout, positions, [offer[1] for offer in offers])
