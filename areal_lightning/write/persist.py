"""Write: a recover checkpoint of the shared tier, copied from every rank's sealed memory-tier slot.

Each rank's slot is a rank-local DCP checkpoint of its whole state (:mod:`areal_lightning.write.slot`).
The shared checkpoint of the same step is the one a collective save would write: one data file
per rank, ``__{rank}_0.distcp``, and one ``.metadata``. So instead of staging the state a second
time, every rank copies bytes from its slot:

* every rank gathers every rank's slot ``.metadata`` (item tables with each item's CRC32C);
* :func:`plan` (the same result on every rank): rank 0's items all; from each other rank, the
  chunks only it holds (sharded tensors) and the replicated tensors whose bytes differ from
  rank 0's (their CRC32C differ), these under ``areal_per_rank/{world}/{rank}/{key}`` as a
  collective save stores them (:mod:`areal_lightning.write.replicas`); an item equal to rank
  0's is not copied again; the skeleton is rank 0's;
* every rank copies its items into its data file (in slot order, fsynced), all agree, and rank
  0 writes the merged ``.metadata`` (every item's CRC32C carried over: nothing is hashed again)
  and runs ``then`` (the commit).
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from areal_lightning._fault import fault_point
from areal_lightning._torch_internals import DATA_SUFFIX
from areal_lightning.collective import CheckpointGroup
from areal_lightning.write.checksum import Written, item_checksum, truncated
from areal_lightning.write.dcp_format import SKELETON_KEY
from areal_lightning.write.dcp_reader import reader_of
from areal_lightning.write.direct import metadata_object, write_metadata
from areal_lightning.write.durable import fsync_dir
from areal_lightning.write.replicas import PREFIX

__all__ = ["Plan", "plan", "persist", "resume_view", "merged_view"]

_COPY = 16 << 20


@dataclass
class Plan:
    """What each rank copies from its slot and the merged ``.metadata``."""

    metadata: Metadata
    copies: list[list[tuple[str, int, int]]] = field(default_factory=list)
    """Per rank, in order: ``(slot data file, offset, length)`` appended to its shared data file."""
    per_rank: list[str] = field(default_factory=list)
    """Keys stored per rank (their bytes differ across ranks)."""
    origin: dict[MetadataIndex, tuple[int, Any]] = field(default_factory=dict)
    """Each item of :attr:`metadata`: the rank whose slot holds it, and its record there."""


def _key(index: MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    return index.fqn, tuple(index.offset) if index.offset is not None else None


def plan(metas: list[Metadata]) -> Plan:
    """The shared checkpoint of every rank's slot ``metas`` (see the module doc)."""
    world = len(metas)
    merged_sd = dict(metas[0].state_dict_metadata)
    storage: dict[MetadataIndex, Any] = {}
    copies: list[list[tuple[str, int, int]]] = [[] for _ in range(world)]
    ends = [0] * world
    per_rank: list[str] = []
    origin: dict[MetadataIndex, tuple[int, Any]] = {}

    def place(rank: int, index: MetadataIndex, info: Any) -> None:
        origin[index] = (rank, info)
        new = copy.copy(info)
        new.relative_path, new.offset = f"__{rank}_0{DATA_SUFFIX}", ends[rank]
        copies[rank].append((info.relative_path, info.offset, info.length))
        ends[rank] += info.length
        storage[index] = new

    ordered = [sorted(m.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)) for m in metas]
    mine0 = {_key(index): item_checksum(info) for index, info in ordered[0]}
    for index, info in ordered[0]:
        place(0, index, info)
    for rank in range(1, world):
        entries = metas[rank].state_dict_metadata
        for index, info in ordered[rank]:
            if index.fqn == SKELETON_KEY:
                continue  # rank 0's describes the checkpoint
            key = _key(index)
            if key in mine0:
                want = item_checksum(info)
                if want is not None and want == mine0[key]:
                    continue  # equal to rank 0's: stored once
                usual = index.fqn
                per_key = f"{PREFIX}{world}/{rank}/{usual}"
                merged_sd[per_key] = entries[usual]
                per_rank.append(usual)
                place(rank, MetadataIndex(per_key, index.offset, index.index), info)
                continue
            md = entries[index.fqn]
            have = merged_sd.get(index.fqn)
            if isinstance(md, TensorStorageMetadata):  # a chunk only this rank holds: the union of the chunks
                chunks = [c for c in md.chunks if tuple(c.offsets) == key[1]]
                if isinstance(have, TensorStorageMetadata):
                    merged_sd[index.fqn] = TensorStorageMetadata(have.properties, have.size, [*have.chunks, *chunks])
                else:
                    merged_sd[index.fqn] = TensorStorageMetadata(md.properties, md.size, chunks)
            elif have is None:
                merged_sd[index.fqn] = md
            place(rank, index, info)
    metadata = Metadata(state_dict_metadata=merged_sd, planner_data=metas[0].planner_data, storage_data=storage,
                        version=metas[0].version)
    return Plan(metadata, copies, sorted(set(per_rank)), origin)


def _copy_items(slot: Path, out: Path | str, items: list[tuple[str, int, int]],
                storage_options: Mapping[str, Any] | None = None) -> int:
    """Append each slot item's bytes to the file ``out`` (fsynced), or upload them as the object
    ``out`` (a URI: one streamed upload, aborted on a failure); returns bytes written."""
    if isinstance(out, str):
        from areal_lightning.write.objectstore_fs import ObjectFileSystem

        fs = ObjectFileSystem(storage_options or {})
        with fs.create_stream(fs.init_path(out), "wb") as dest:
            return _append(slot, dest, items)
    with open(out, "wb") as dest:
        total = _append(slot, dest, items)
        dest.flush()
        os.fsync(dest.fileno())
    return total


def _append(slot: Path, dest: Any, items: list[tuple[str, int, int]]) -> int:
    total = 0
    sources: dict[str, Any] = {}
    try:
        for name, offset, length in items:
            src = sources.get(name)
            if src is None:
                src = sources[name] = open(slot / name, "rb", buffering=0)
            src.seek(offset)
            left = length
            while left:
                data = src.read(min(left, _COPY))
                if not data:
                    raise truncated(slot / name, name, offset, length, offset + length - left)
                dest.write(data)
                left -= len(data)
            total += length
    finally:
        for src in sources.values():
            src.close()
    return total


def _gathered(slot: Path, ranks: CheckpointGroup, what: str, *, background: bool = False,
              error: BaseException | None = None) -> tuple[int, list[Metadata], Plan]:
    """Collective: this rank, every rank's slot ``.metadata`` (a failure to read one, or
    ``error``, is raised on every rank) and their :func:`plan`."""
    mine: Metadata | None = None
    try:
        if error is None:
            mine = reader_of(slot).read_metadata()
    except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
        error = exc
    metas = ranks.agree(error, what, mine, background=background)
    return (dist.get_rank() if ranks.active() else 0), metas, plan(metas)


def persist(slot: Path, out: Path | str, ranks: CheckpointGroup, then: Callable[[Written], None] | None,
            storage_options: Mapping[str, Any] | None = None, error: BaseException | None = None) -> Written:
    """Collective (every rank, on the background group of ``ranks``): write the shared checkpoint
    folder ``out`` (existing, empty; or an object-store prefix, a URI, with ``storage_options``)
    from every rank's sealed ``slot``; rank 0 writes ``.metadata`` and runs ``then(written)``. A
    failure on any rank is raised on every rank before anything is committed (fault point
    ``memory.mid_persist``: this rank's data file written, before the agreement); ``error``: this
    rank's slot could not be sealed (raised on every rank at the first agreement)."""
    rank, metas, merged = _gathered(slot, ranks, f"persisting the memory tier's slot {slot}", background=True,
                                    error=error)
    error: BaseException | None = None
    written = Written()
    name = f"__{rank}_0{DATA_SUFFIX}"
    try:
        target = f"{out.rstrip('/')}/{name}" if isinstance(out, str) else out / name
        written.nbytes = _copy_items(slot, target, merged.copies[rank], storage_options)
        written.items = len(merged.copies[rank])
        fault_point("memory.mid_persist")
    except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
        error = exc
    ranks.agree(error, f"persisting the memory tier's slot {slot} into {out}", background=True)
    if rank == 0:
        if isinstance(out, str):
            metadata_object(out, merged.metadata, written, storage_options or {})
        else:
            fsync_dir(out)
            write_metadata(out, merged.metadata, written)
        if then is not None:
            then(written)
    return written


def resume_view(slot: Path, view: Path, ranks: CheckpointGroup) -> tuple[Path, frozenset[str]]:
    """Collective: this rank's view of the shared checkpoint every rank's sealed ``slot`` makes
    (:func:`plan`), as a folder ``view`` a load reads: the items this rank holds read from its
    own slot (its data file linked in), its own copies of per-rank tensors under their per-rank
    keys (so the load gives them back to this rank, as from a shared checkpoint), and what only
    rank 0 holds (its skeleton, e.g. a ZeRO optimizer's consolidated state) received from rank 0.
    So every rank resumes what it would resume from the shared tier's checkpoint of that step.
    Returns the folder and the names of its files that are this rank's slot files (hard links:
    the bytes the caller checked), not those received or copied."""
    rank, metas, merged = _gathered(slot, ranks, f"memory tier: the slots of the step to resume ({slot})")
    error: BaseException | None = None
    own = {_key(index): info for index, info in metas[rank].storage_data.items()}
    # what only rank 0 holds (and its skeleton): the other ranks get it from rank 0
    wanted = {_key(index) for index, (owner, info) in merged.origin.items()
              if owner == 0 and rank != 0 and (index.fqn == SKELETON_KEY or _key(index) not in own)}
    needs = ranks.agree(None, "memory tier: what each rank needs from rank 0", sorted(wanted, key=str))
    payload: dict[Any, bytes] | None = None
    if rank == 0:
        asked = {key for keys in needs for key in keys}
        payload = {}
        try:
            for index, (owner, info) in merged.origin.items():
                if owner == 0 and _key(index) in asked:
                    with open(slot / info.relative_path, "rb") as file:
                        file.seek(info.offset)
                        payload[_key(index)] = file.read(info.length)
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
    sent = ranks.share(error, "memory tier: rank 0's items for the other ranks", payload)  # a broadcast
    view.mkdir(parents=True, exist_ok=True)
    storage: dict[MetadataIndex, Any] = {}
    linked: dict[str, str] = {}
    fetched = view / f"from_rank0{DATA_SUFFIX}"
    with open(fetched, "wb") as out:
        pos = 0
        for index, info in merged.metadata.storage_data.items():
            owner, source = merged.origin[index]
            key = _key(index)
            if key in wanted:  # rank 0's bytes, received
                data = sent[key]
                out.write(data)
                new = copy.copy(source)
                new.relative_path, new.offset = fetched.name, pos
                pos += len(data)
            elif owner == rank or (owner == 0 and key in own and item_checksum(own[key]) == item_checksum(source)):
                source = source if owner == rank else own[key]  # the same bytes, in this rank's slot
                new = copy.copy(source)
                new.relative_path = linked.setdefault(source.relative_path, f"own_{len(linked)}{DATA_SUFFIX}")
            else:
                new = info  # another rank's (or rank 0's per-rank) item: this rank does not read it
            storage[index] = new
    same: set[str] = set()
    for source, name in linked.items():
        target = view / name
        target.unlink(missing_ok=True)
        try:
            os.link(slot / source, target)
            same.add(name)
        except OSError:  # another file system: a copy
            shutil.copyfile(slot / source, target)
    view_md = Metadata(state_dict_metadata=merged.metadata.state_dict_metadata, planner_data=merged.metadata.planner_data,
                       storage_data=storage, version=merged.metadata.version)
    write_metadata(view, view_md, Written(), points=(None, None))
    return view, frozenset(same)


def merged_view(slots: list[Path], view: Path) -> Path:
    """Offline (one process): the shared checkpoint that every rank's sealed slot of one step
    makes (``slots[r]``: rank ``r``'s), as a folder ``view`` a load reads: the merged
    ``.metadata`` (:func:`plan`) and each rank's slot files linked in (symbolic links: nothing is
    copied). For ``convert`` and ``inspect`` of a memory-tier step."""
    metas = [reader_of(slot).read_metadata() for slot in slots]
    merged = plan(metas)
    view.mkdir(parents=True, exist_ok=True)
    storage: dict[MetadataIndex, Any] = {}
    for index in merged.metadata.storage_data:
        owner, source = merged.origin[index]
        new = copy.copy(source)
        new.relative_path = f"rank{owner}_{source.relative_path}"
        link = view / new.relative_path
        if not link.is_symlink():
            link.symlink_to((slots[owner] / source.relative_path).resolve())
        storage[index] = new
    write_metadata(view, Metadata(state_dict_metadata=merged.metadata.state_dict_metadata,
                                  planner_data=merged.metadata.planner_data, storage_data=storage,
                                  version=merged.metadata.version), Written(), points=(None, None))
    return view
