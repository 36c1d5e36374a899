"""Commit: the node-local memory tier -- each rank's newest states in slots on tmpfs, sealed.

``{root}/{user}/{experiment}/{trial}/{name}/rank{r}/slot{k}/`` (``root``: ``/dev/shm/areal-lightning``
by default) holds one rank-local recover checkpoint per slot (:mod:`areal_lightning.write.slot`:
the same content and format as this rank's part of a recover checkpoint), then ``SEALED.json``,
written last: the step, a serial number, the world size, the CRC32C of ``.metadata`` (which
holds every item's CRC32C) and the ``recover_info`` of the save. Files on tmpfs outlive the
process that wrote them, SIGKILL included, with no keeper process.

Writing (:meth:`MemoryTier.write`, every rank at the save point): the next slot is the oldest
one that is not the newest sealed one (nor, with peer copies, the newest one every peer holds),
so a sealed state is never overwritten before a newer one is sealed; it is unsealed first (its
seal removed), then the state is copied into its mapped file (host tensors: a ``memmove``,
each chunk checksummed while in cache; CUDA tensors: queued on a side stream into the slot's
page-locked pages: :mod:`areal_lightning.write.slot`), and training goes on. A background
thread then (after the device copy landed and was checksummed) writes ``.metadata`` and the
seal, while the next step's forward and backward run; :meth:`MemoryTier.wait_sealed`, after
them and before the next optimizer update, waits for it. So a crash loses at most the step in flight: a step's optimizer step never
completes before the previous step is sealed. No step is skipped: a slot still being read
(copied to the shared tier or to the peer) is waited for, and the wait is reported as the
stall.

The shared tier from the slots (:meth:`MemoryTier.persist`, collective, in a background
thread once the slot is sealed): :func:`~areal_lightning.write.persist.persist` copies every
rank's slot into the shared checkpoint's folder; the slot is not written again before that.

Resuming (:meth:`MemoryTier.choose`, collective): every rank reports the steps it sealed; the
newest step sealed by every rank (with the run's world size), not older than the shared tier's
checkpoint, is verified by every rank (the seal, ``.metadata``'s CRC32C, every item's CRC32C);
a step some rank cannot restore is skipped (the next older one is tried, then the shared
tier), and the log names what was skipped and why. Each rank loads its view of the shared
checkpoint that step makes (:func:`~areal_lightning.write.persist.resume_view`). A replicated
strategy loads into new tensors, so the load itself is the check (every item hashed as it is
read, the slot read once; the ranks agree on its outcome before Lightning restores anything);
a sharded one loads into the live model's shards, so its slot is checked first, by a CRC32C
pass, and loaded after the choice. Every slot but the chosen one is unsealed: the run goes on
from the chosen step, or from the shared tier.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from areal_lightning._fault import fault_point
from areal_lightning.collective import CheckpointGroup
from areal_lightning.commit.manifest import verify_mapped
from areal_lightning.config import MEMORY_ROOT, MemoryConfig
from areal_lightning.errors import CheckpointCorruptError, CheckpointWriteError, MemorySpaceError
from areal_lightning.layout import COMMIT_MARKER, MEMORY_SEAL, memory_slot
from areal_lightning.telemetry import folder_bytes
from areal_lightning.write.checksum import Written, file_crc32c
from areal_lightning.write.dcp_format import SKELETON_KEY, flatten
from areal_lightning.write.direct import ByteLayout, LocalShards, Signatures, skeleton_bytes
from areal_lightning.commit.peer import PeerCopy, receive_slot, send_slot
from areal_lightning.write.persist import persist as persist_slot
from areal_lightning.write.persist import resume_view
from areal_lightning.stage.host import bind_thread_to, cuda_device
from areal_lightning.write.slot import COPY_THREADS, PendingCopy, SlotFile

__all__ = ["MemoryTier", "Seal", "Chosen", "tier_folder", "local_nbytes", "SEAL_FORMAT",
           "is_tier_folder", "newest_complete_step", "verify_slot"]

log = logging.getLogger(__name__)

SEAL_FORMAT = 1


def tier_folder(root: str | None, user: str, experiment: str, trial: str, name: str) -> Path:
    """The memory tier folder of one trial's model ``name`` under ``root`` (``None``: the default on /dev/shm)."""
    return Path(root if root is not None else MEMORY_ROOT) / user / experiment / trial / name


@dataclass
class Seal:
    """A sealed slot of this rank (what ``SEALED.json`` says)."""

    slot: int
    path: Path
    global_step: int
    serial: int
    world_size: int
    lineage: int | None
    """The global step of this run's newest shared save (started or resumed from) when the slot
    was written, ``None`` when there was none."""
    metadata_crc32c: int
    info: dict[str, Any] = field(repr=False)


@dataclass
class Chosen:
    """The step a resume takes from the memory tier: this rank's slot and rank 0's ``recover_info``."""

    seal: Seal
    info: dict[str, Any]
    nbytes: int
    check_s: float
    path: Path | None = None
    """The folder this rank loads (:func:`~areal_lightning.write.persist.resume_view`)."""
    checked_files: frozenset[str] = frozenset()
    """The data files of ``path`` that are this rank's slot files (checked here before the choice)."""
    loaded: Any = None
    """With a ``load`` (see :meth:`MemoryTier.choose`): what it returned for ``path``, every item
    hashed as it was read (then ``checked_files`` is empty: nothing is read again)."""


def _read_seal(folder: Path, slot: int) -> Seal | None:
    try:
        doc = json.loads((folder / MEMORY_SEAL).read_text())
        if doc.get("format") != SEAL_FORMAT:
            return None
        return Seal(slot, folder, int(doc["global_step"]), int(doc["serial"]), int(doc["world_size"]),
                    doc.get("lineage"), int(doc["metadata_crc32c"]), doc["info"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def local_nbytes(state: Any) -> int:
    """Bytes of this rank's part of every tensor in a nested state (a sharded tensor's local shard)."""
    total = 0

    def walk(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj.local_tensor() if hasattr(obj, "local_tensor") \
                else obj
            total += local.numel() * local.element_size()
        elif isinstance(obj, Mapping):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(state)
    return total


def verify_slot(seal: Seal, items: bool = True) -> tuple[str | None, int]:
    """Check a sealed slot: ``.metadata``'s CRC32C against the seal, then (``items``) every
    item's CRC32C. Returns (``None`` or why it cannot be restored, bytes read)."""
    try:
        if file_crc32c(seal.path / COMMIT_MARKER) != seal.metadata_crc32c:
            return f"{seal.path / COMMIT_MARKER} fails its CRC32C check", 0
        return None, verify_mapped(seal.path, "the slot is damaged") if items else 0
    except (OSError, CheckpointCorruptError) as exc:
        return str(exc), 0


def _join(pending: dict[int, tuple[int, Future]]) -> None:
    """Wait for every background job of ``pending`` (their failures are kept by the jobs), then forget them."""
    for _, future in list(pending.values()):
        try:
            future.result()
        except BaseException:  # noqa: BLE001 - kept by the job, raised by the caller
            pass
    pending.clear()


def _failure_of(wait: Callable[[], None]) -> BaseException | None:
    """What ``wait()`` raised (``None``: it returned)."""
    try:
        wait()
    except BaseException as exc:  # noqa: BLE001 - handed to a collective that raises it on every rank
        return exc
    return None


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _unseal(folder: Path) -> None:
    for name in (MEMORY_SEAL, COMMIT_MARKER):
        (folder / name).unlink(missing_ok=True)


def is_tier_folder(path: Path) -> bool:
    """Whether ``path`` is a trial's memory-tier folder (``rank{r}/slot{k}/`` below it)."""
    return path.is_dir() and any(path.glob(f"rank*/slot*/{MEMORY_SEAL}"))


def newest_complete_step(folder: Path) -> tuple[int, list[Seal]] | None:
    """Offline: the newest step of the tier ``folder`` that every rank sealed (the world size as
    the seals say), with each rank's seal; ``None``: no such step."""
    held: dict[int, dict[int, Seal]] = {}
    world = None
    for seal_file in folder.glob(f"rank*/slot*/{MEMORY_SEAL}"):
        rank, slot = seal_file.parent.parent.name[len("rank"):], seal_file.parent.name[len("slot"):]
        if not (rank.isdigit() and slot.isdigit()):
            continue
        seal = _read_seal(seal_file.parent, int(slot))
        if seal is None:
            continue
        world = seal.world_size
        held.setdefault(int(rank), {})[seal.global_step] = seal
    if world is None or sorted(held) != list(range(world)):
        return None
    common = set.intersection(*(set(steps) for steps in held.values()))
    if not common:
        return None
    step = max(common)
    return step, [held[rank][step] for rank in range(world)]


class MemoryTier:
    """One rank's part of the memory tier of a trial (see the module doc).

    Args:
        config: the validated ``recover.memory`` section.
        folder: the trial's tier folder (:func:`tier_folder`).
        rank: this process's global rank.
        ranks_per_node: ranks sharing this node's tmpfs (for the free-space check).
    """

    def __init__(self, config: MemoryConfig, folder: Path, rank: int, ranks_per_node: int = 1,
                 world_size: int = 1, timeout_s: float = 900.0) -> None:
        self.config = config
        self.folder = folder
        self.rank = rank
        self.ranks_per_node = max(1, ranks_per_node)
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.peers = config.replicas > 0 and world_size // self.ranks_per_node >= 2
        """Whether each slot is also copied to a rank of another node (``replicas=1``, 2+ nodes)."""
        self._peer: PeerCopy | None = None
        self._replicator: ThreadPoolExecutor | None = None
        self._replicating: dict[int, tuple[int, Future]] = {}  # slot -> (serial, its copy to the peer)
        self._replicated: int | None = None  # the slot of the newest step every rank's peer holds: kept
        self._files: dict[int, SlotFile] = {}
        self._paths: dict[str, Any] = {}  # flatten's memo: the dotted paths of the state dicts, kept while they hold
        self._signatures = Signatures()  # each write's layout signature, checked in one call while it holds
        self._local_shards = LocalShards()  # sharded tensors (FSDP) as their local chunks
        self._shard_signatures = Signatures()  # the signature of those local chunks' flat dict
        self._sealed: dict[int, int] = {}  # slot -> its sealed serial (this process's view)
        self._serial = 0
        self._newest: int | None = None  # the slot of the newest sealed state (never the next one written)
        self._last_step: int | None = None
        self._checked: tuple[Any, ...] | None = None  # the layout whose free space was checked
        self._thread: ThreadPoolExecutor | None = None
        self._persister: ThreadPoolExecutor | None = None
        self._reading: dict[int, tuple[int, Future]] = {}  # slot -> (serial, the shared-tier save reading it)
        self._persist_failure: BaseException | None = None
        self._last_slot: int | None = None  # the slot of the last write
        self._failure: BaseException | None = None
        self._engine: Any = None  # a rank-local DCPEngine for states DCP must plan (see write())
        self.last_copy_s = 0.0
        """Seconds the last :meth:`write` held training besides the stall (flatten, the
        copy into the slot with the host tensors' checksums; a state DCP plans, see
        :meth:`write`: also ``.metadata`` and the seal)."""
        self.last_stall_s = 0.0
        """Seconds the last :meth:`write` waited for a slot still being read."""
        self.last_wait_s = 0.0
        """Seconds the last :meth:`wait_sealed` held training (the copy landing, its checksums, the seal)."""
        self.pinned: bool | None = None
        """CUDA: whether the last device copy went to page-locked slot pages (``None``: none made)."""
        self._stream: Any = None  # CUDA: the copy stream
        self._sealer: ThreadPoolExecutor | None = None
        self._sealing: Future | None = None  # the background checksums and seal of the last write

    @property
    def wrote(self) -> bool:
        """Whether this run wrote a slot (every rank alike: they write at the same steps)."""
        return self._last_slot is not None

    @property
    def rank_folder(self) -> Path:
        return self.folder / f"rank{self.rank}"

    @property
    def view_folder(self) -> Path:
        """Where a resume puts this rank's view of the chosen step (removed by the next write)."""
        return self.rank_folder / "resume"

    def slot_folder(self, slot: int) -> Path:
        return memory_slot(self.folder, self.rank, slot)

    def due(self, global_step: int) -> bool:
        """Whether the save point after ``global_step`` optimizer steps writes a slot."""
        return global_step > 0 and global_step % self.config.freq_steps == 0 and global_step != self._last_step

    # -- what this rank holds -------------------------------------------------------------

    def _slot_numbers(self) -> list[int]:
        """The slots of this rank that exist on disk (of this configuration's ``slots``)."""
        found = []
        for path in self.rank_folder.glob("slot*") if self.rank_folder.is_dir() else ():
            number = path.name[len("slot"):]
            if number.isdigit() and int(number) < self.config.slots:
                found.append(int(number))
        return sorted(found)

    def held(self) -> list[Seal]:
        """This rank's sealed slots, newest first (by serial)."""
        seals = [seal for k in self._slot_numbers() if (seal := _read_seal(self.slot_folder(k), k)) is not None]
        return sorted(seals, key=lambda s: s.serial, reverse=True)

    # -- resume -----------------------------------------------------------------------------

    def choose(self, ranks: CheckpointGroup, world_size: int, shared_step: int | None,
               fresh_start: bool = False, load: Callable[[Path], Any] | None = None) -> Chosen | None:
        """Collective: the newest step every rank sealed and can restore, if not older than the
        shared tier's ``shared_step`` (``None``: the shared tier has no checkpoint); every other
        slot of this rank is unsealed (see the module doc). Logs what was skipped and why.
        ``fresh_start``: the user deleted the shared tier's ``recover_info`` (the documented
        fresh start): slots that follow a shared save are not taken.

        Every item of a step is checked before it is chosen. Without ``load`` (a sharded
        strategy, whose load writes into the live model's shards) by a CRC32C pass over this
        rank's slot, then the caller loads it. With ``load`` (a load into new tensors: nothing
        live changes until Lightning restores from its result) by ``load(view)`` itself, which
        hashes every item as it reads it: the slot is read once, and what it returned is
        :attr:`Chosen.loaded`; a damaged item fails that load and the ranks agree on the next
        step as after a failed check."""
        start = time.perf_counter()
        by_step = self._by_step()
        own = {step: (seal.world_size, seal.lineage) for step, seal in by_step.items()}
        copies = self.replicas_held()  # {source rank: {step: seal}}: the peer copies this node holds
        report = {"own": own, "copies": {src: {step: (seal.world_size, seal.lineage) for step, seal in held.items()}
                                         for src, held in copies.items()}}
        everyone = ranks.agree(None, "memory tier: the steps each rank holds", report) if world_size > 1 else [report]
        skipped: list[str] = []
        steps = sorted(set().union(*(set(r["own"]) | {step for held in r["copies"].values() for step in held}
                                     for r in everyone)), reverse=True)
        chosen: Chosen | None = None
        loaded: Any = None
        for step in steps:
            if shared_step is not None and step < shared_step:
                break
            # who lacks the step, and which rank holds a peer copy of its slot
            holders = {r: next((h for h, held in enumerate(everyone) if step in held["copies"].get(r, {})), None)
                       for r, held in enumerate(everyone) if step not in held["own"]}
            missing = [r for r, h in holders.items() if h is None]
            if missing:
                skipped.append(f"step {step}: not sealed by rank(s) {', '.join(map(str, missing[:8]))} (nor a peer copy)")
                continue
            records = [held["own"][step] if step in held["own"] else everyone[holders[r]]["copies"][r][step]
                       for r, held in enumerate(everyone)]
            worlds = {world for world, _ in records}
            if worlds != {world_size}:
                skipped.append(f"step {step}: written by {sorted(worlds)} rank(s), this run has {world_size}")
                continue
            lineage = records[0][1]
            if fresh_start and lineage is not None:
                skipped.append(f"step {step}: it follows the shared save of global step {lineage}, whose "
                               "recover_info is gone (deleted: a fresh start)")
                continue
            if holders:  # a lost node's ranks get their slots back from the peers holding them
                self._restore(step, holders, copies, ranks)
                by_step = self._by_step()
            seal = by_step.get(step)
            reason, nbytes = verify_slot(seal, items=load is None) if seal is not None \
                else ("its slot was not restored", 0)
            info = seal.info if self.rank == 0 and seal is not None else None
            answers = ranks.agree(None, "memory tier: the slots check", (reason, info)) if world_size > 1 \
                else [(reason, info)]
            bad = [f"rank {r}: {why}" for r, (why, _) in enumerate(answers) if why is not None]
            if not bad and load is not None:
                assert seal is not None
                loaded, bad = self._load(seal, load, ranks, world_size)
            if bad:
                loaded = None  # another rank's load failed: not held while the next step loads
                skipped.append(f"step {step}: {'; '.join(bad[:4])}")
                continue
            assert seal is not None
            chosen = Chosen(seal, answers[0][1], nbytes, time.perf_counter() - start)
            if load is not None:  # read once, by the load (nbytes: the check's own reads, none)
                chosen.path, chosen.loaded = self.view_folder, loaded
            break
        if chosen is not None and load is None:  # what this rank loads: the shared checkpoint's view of this step
            shutil.rmtree(self.view_folder, ignore_errors=True)
            chosen.path, chosen.checked_files = resume_view(chosen.seal.path, self.view_folder, ranks)
        if skipped and self.rank == 0:
            log.warning("RecoverCallback: memory tier %s: skipped %s; %s", self.folder, " | ".join(skipped),
                        f"resuming from its step {chosen.seal.global_step}" if chosen is not None
                        else "using the shared tier" if shared_step is not None
                        else "the shared tier has no checkpoint either: starting from the beginning")
        self._keep_only(chosen.seal if chosen is not None else None)
        return chosen

    def _load(self, seal: Seal, load: Callable[[Path], Any], ranks: CheckpointGroup,
              world_size: int) -> tuple[Any, list[str]]:
        """Collective, for :meth:`choose`: ``load`` of this step's view (every rank's slot of
        ``seal``'s step, :func:`resume_view`), every item hashed as it is read. Returns what it
        returned and, for every rank whose read found a damaged or unreadable item, why; another
        failure is raised on every rank."""
        shutil.rmtree(self.view_folder, ignore_errors=True)
        view, _ = resume_view(seal.path, self.view_folder, ranks)
        loaded, reason, error = None, None, None
        try:
            loaded = load(view)
        except (OSError, CheckpointCorruptError) as exc:
            reason = str(exc)
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
        reasons = ranks.agree(error, "memory tier: the slots read", reason) if world_size > 1 else [reason]
        if error is not None:
            raise error
        return loaded, [f"rank {r}: {why}" for r, why in enumerate(reasons) if why is not None]

    def _by_step(self) -> dict[int, Seal]:
        """This rank's sealed slots by step (of duplicates, none written but a copied folder could
        hold them, the newest serial)."""
        by_step: dict[int, Seal] = {}
        for seal in reversed(self.held()):
            by_step[seal.global_step] = seal
        return by_step

    def replicas_held(self) -> dict[int, dict[int, Seal]]:
        """The peer copies this node holds: ``{source rank: {step: seal}}``."""
        out: dict[int, dict[int, Seal]] = {}
        for seal_file in self.folder.glob(f"replica_of_rank*/slot*/{MEMORY_SEAL}") if self.folder.is_dir() else ():
            source, slot = seal_file.parent.parent.name[len("replica_of_rank"):], seal_file.parent.name[len("slot"):]
            seal = _read_seal(seal_file.parent, int(slot)) if source.isdigit() and slot.isdigit() else None
            if seal is not None:
                out.setdefault(int(source), {})[seal.global_step] = seal
        return out

    def _restore(self, step: int, holders: dict[int, int], copies: dict[int, dict[int, Seal]],
                 ranks: CheckpointGroup) -> None:
        """Collective: each rank in ``holders`` (lacking ``step``) receives its slot of it from
        the rank holding its peer copy, into one of its own slots, sealed last."""
        group = ranks.group if ranks.active() else None
        for target, holder in sorted(holders.items()):
            if self.rank == holder:
                send_slot(copies[target][step].path, target, group)
            elif self.rank == target:
                receive_slot(self.slot_folder(0), holder, group)
                log.warning("RecoverCallback: memory tier: rank %d's slot of global step %d restored from the "
                                "peer copy held by rank %d", target, step, holder)

    def discard(self) -> None:
        """Unseal every slot (this fit does not continue from the memory tier: a fresh start, or
        an explicit ``ckpt_path``): a later crash must not resume a state of another run."""
        self._keep_only(None)

    def _keep_only(self, seal: Seal | None) -> None:
        """Unseal every slot but ``seal``'s; the next write goes to another slot."""
        for k in self._slot_numbers():
            if seal is None or k != seal.slot:
                _unseal(self.slot_folder(k))
        for held in self.replicas_held().values():  # peer copies of steps this run will train again
            for step, copy in held.items():
                if seal is None or step > seal.global_step:
                    _unseal(copy.path)
        self._newest = seal.slot if seal is not None else None
        self._replicated = None
        self._sealed = {seal.slot: seal.serial} if seal is not None else {}
        self._serial = seal.serial if seal is not None else 0
        self._last_step = seal.global_step if seal is not None else None

    # -- write ------------------------------------------------------------------------------

    def write(self, checkpoint: Mapping[str, Any], *, global_step: int, world_size: int, lineage: int | None,
              info: dict[str, Any], late: Callable[[torch.Tensor], bool] | None = None) -> None:
        """Copy this rank's state into the next slot, to be sealed in the background (see the
        module doc); raises a failure of an earlier background part (a seal, a peer copy). Call
        :meth:`wait_sealed` before the next optimizer step (CUDA: before the tensors ``late``
        names, parameters and optimizer states, change; the others may change once this
        returns). Sharded tensors (FSDP) are copied as their local chunks
        (:class:`~areal_lightning.write.direct.LocalShards`); a state that is neither (a
        ``ShardedTensor`` of several local shards, a quantized tensor) is written by DCP and
        sealed here, in this thread."""
        self.wait_sealed()
        start = time.perf_counter()
        if self._last_step is not None and self._last_slot is None:  # the first write after a resume
            shutil.rmtree(self.view_folder, ignore_errors=True)
        slot = self._next_slot()
        self._raise_failure()
        self.last_stall_s = time.perf_counter() - start
        folder = self.slot_folder(slot)
        folder.mkdir(parents=True, exist_ok=True)
        _unseal(folder)
        self._sealed.pop(slot, None)
        flat = flatten(checkpoint, self._paths)
        skeleton: Any = flat.pop(SKELETON_KEY)  # a copy of the state's non-tensor parts: pickled in the background
        signatures, chunks = self._signatures, None
        key = signatures(flat, pinned=False)
        if key is None:  # sharded tensors (FSDP): their local chunks, placed as DCP places a rank-local save's
            shards = self._local_shards(flat)
            if shards is not None:
                signatures, (flat, chunks) = self._shard_signatures, shards
                key = signatures(flat, pinned=False)
        written = Written()
        pending: PendingCopy | None = None
        if key is None:  # DCP plans and writes the slot (rank-local, in this thread)
            self._drop_file(slot)
            self._dcp_engine().save(checkpoint, folder)
            written = self._engine.last_written or written
            finish = None
        else:
            file = self._files.get(slot)
            if file is None or file.key != key or file.layout.chunks != chunks:
                self._drop_file(slot)
                layout = ByteLayout(key, 1, chunks=chunks)
                skeleton = skeleton_bytes(skeleton)  # its size is part of the space check
                self._check_space(key, sum(item.nbytes for item in layout.files[0]) + len(skeleton))
                file = self._files[slot] = SlotFile(folder, layout)
            # host tensors: copied and checksummed; CUDA tensors: queued on the copy stream
            pending = file.copy(flat, self._hasher(), COPY_THREADS, stream=self._cuda_stream(), late=late,
                                plain=signatures.plain)
            finish = file
        self._serial += 1
        seal = {"format": SEAL_FORMAT, "serial": self._serial, "global_step": global_step, "world_size": world_size,
                "rank": self.rank, "lineage": lineage, "time": time.time(), "info": info}
        if pending is not None:  # sealed in the background once the copy landed
            if pending.device and not pending.pinned and self.pinned is None:
                log.warning("RecoverCallback: memory tier: CUDA could not page-lock the slot's pages in %s "
                            "(cudaHostRegister refused; Linux refuses to lock a writable mapping of a file on a disk "
                            "file system, a tmpfs one it locks): each save point copies the GPU state synchronously. "
                            "Put recover.memory.root on a tmpfs (the default, /dev/shm)", folder)
            if pending.device:
                self.pinned = pending.pinned
            self._sealing = self._seal_pool().submit(self._seal_after, pending, slot, finish, skeleton, written, seal)
        else:
            self._finish(slot, finish, skeleton, written, seal)  # sealed before training goes on
        self._last_step = global_step
        self.last_copy_s = time.perf_counter() - start - self.last_stall_s
        self._last_slot = slot
        if self.peers:
            self._replicate(slot, self._serial, global_step)

    def _seal_after(self, pending: PendingCopy, slot: int, file: SlotFile, skeleton: Any, written: Written,
                    seal: dict[str, Any]) -> None:
        """In the background: once the copy of :meth:`write` landed, its checksums, the
        ``skeleton`` pickled (where :meth:`write` left it an object: :func:`flatten`'s copy of
        the non-tensor parts), ``.metadata`` and the seal."""
        try:
            pending.wait(self._hasher())  # CUDA: the copies landed, their checksums
            if not isinstance(skeleton, bytes):
                skeleton = skeleton_bytes(skeleton)
            self._finish(slot, file, skeleton, written, seal)
        except BaseException as exc:  # noqa: BLE001 - raised by wait_sealed / the next write
            self._failure = exc
            raise

    def wait_sealed(self, raise_failure: bool = True) -> float | None:
        """Until the last :meth:`write`'s slot is sealed (CUDA: its device copy landed; the
        parameters and optimizer states may change); raises its failure (else the next
        :meth:`write` or :meth:`wait` does). Returns the seconds waited (also in
        :attr:`last_wait_s`), ``None`` when nothing was pending."""
        sealing, self._sealing = self._sealing, None
        if sealing is None:
            if raise_failure:
                self._raise_failure()
            return None
        start = time.perf_counter()
        try:
            sealing.result()
        except BaseException:  # noqa: BLE001 - kept in _failure
            pass
        self.last_wait_s = time.perf_counter() - start
        if raise_failure:
            self._raise_failure()
        return self.last_wait_s

    def _after_seal(self) -> Callable[[], None]:
        """For a background job reading the slot of the last write: a wait until it is sealed
        (raising when it could not be)."""
        sealing = self._sealing

        def wait() -> None:
            if sealing is not None:
                sealing.result()

        return wait

    def _replicate(self, slot: int, serial: int, step: int) -> None:
        """The copy of the sealed slot to the peer (and the source's to this node), in the
        background, in step order; the slot is not written again before it is sent."""
        if self._peer is None:  # every rank at its first write: the group is made collectively
            self._peer = PeerCopy(self.folder, self.rank, self.world_size, self.ranks_per_node, self.timeout_s)
            self._replicator = ThreadPoolExecutor(1, thread_name_prefix="areal-memory-peer")
        sealed = self._after_seal()

        def job() -> None:
            try:
                error = _failure_of(sealed)  # a slot not sealed: the peers still exchange (none waits), then raise
                assert self._peer is not None
                self._peer.copy(self.slot_folder(slot) if error is None else None, serial, step)
                # Every rank's peer holds this step: each rank keeps its own slot of it until a
                # newer step is so held (a lost node's ranks and the others then share a step).
                dist.barrier(group=self._peer.group)
                if error is not None:
                    raise error
                self._replicated, self._peer.replicated_step = slot, step
            except BaseException as exc:  # noqa: BLE001 - raised by the next write / wait
                self._failure = exc
                raise

        assert self._replicator is not None
        self._replicating[slot] = (serial, self._replicator.submit(job))

    @property
    def replica_lag(self) -> int | None:
        """Steps this rank sealed that its peer does not hold yet (``None``: no peer copy)."""
        if not self.peers or self._last_step is None:
            return None
        done = self._peer.replicated_step if self._peer is not None else None
        return self._last_step - done if done is not None else self._last_step

    def persist(self, out: Path | str, ranks: CheckpointGroup, then: Callable[[Written], None] | None,
                storage_options: Mapping[str, Any] | None = None) -> None:
        """Collective: write the shared tier's checkpoint folder ``out`` (or object-store prefix,
        with ``storage_options``) from the (sealed) slot of the last :meth:`write` (every rank's),
        in the background
        (:func:`~areal_lightning.write.persist.persist`; rank 0 commits with ``then``). The slot
        is not written again until it is copied; a failure is raised by :meth:`wait_persist`."""
        slot = self._last_slot
        if slot is None:
            raise CheckpointWriteError("the memory tier has no slot to persist (none written by this run)")
        serial = self._serial
        sealed = self._after_seal()

        def job() -> None:
            try:
                start = time.perf_counter()  # a slot not sealed: a failure of persist's first agreement (every rank's)
                written = persist_slot(self.slot_folder(slot), out, ranks, then, storage_options,
                                       error=_failure_of(sealed))
                log.info("RecoverCallback: rank %d copied %.1f MB of its memory-tier slot %d into the shared tier's "
                         "%s in %.2fs", self.rank, written.nbytes / 1e6, slot, out, time.perf_counter() - start)
            except BaseException as exc:  # noqa: BLE001 - raised by wait_persist
                self._persist_failure = exc
                raise

        if self._persister is None:
            self._persister = ThreadPoolExecutor(1, thread_name_prefix="areal-memory-persist")
        self._reading[slot] = (serial, self._persister.submit(job))

    def wait_persist(self) -> None:
        """Until the shared-tier saves from the memory tier are committed; raises their failure."""
        _join(self._reading)
        if self._persist_failure is not None:
            failure, self._persist_failure = self._persist_failure, None
            raise CheckpointWriteError(f"shared-tier save from the memory tier ({self.rank_folder}) failed: "
                                       f"{failure!r}") from failure

    def _finish(self, slot: int, file: SlotFile | None, skeleton: bytes, written: Written,
                seal: dict[str, Any]) -> None:
        folder = self.slot_folder(slot)
        if file is not None:
            file.finish(skeleton, written)
        fault_point("memory.before_seal")
        seal["metadata_crc32c"] = file_crc32c(folder / COMMIT_MARKER)
        tmp = folder / f"{MEMORY_SEAL}.tmp"
        tmp.write_text(json.dumps(seal))
        os.replace(tmp, folder / MEMORY_SEAL)
        self._sealed[slot] = seal["serial"]
        self._newest = slot
        fault_point("memory.after_seal")

    def _next_slot(self) -> int:
        """The slot written next: one neither being read (copied to the shared tier or to the
        peer) nor holding the newest sealed state, nor, with peer copies, the newest state every
        peer holds (unsealed ones first, then the oldest); when there is none, wait for the
        oldest read to finish (the stall)."""
        while True:
            for pending in (self._reading, self._replicating):
                for k, (_, future) in list(pending.items()):
                    if future.done():
                        del pending[k]
            taken = set(self._reading) | set(self._replicating) | {self._newest, self._replicated}
            for k in range(self.config.slots):  # an unsealed slot first
                if k not in taken and k not in self._sealed:
                    return k
            free = [k for k in self._sealed if k not in taken]
            if free:
                return min(free, key=lambda k: self._sealed[k])
            waits = [(serial, future) for serial, future in
                     (*self._reading.values(), *self._replicating.values())]
            if not waits:  # the peer copy failed: its failure is raised by write()
                self._raise_failure()
                self._replicated = None
                continue
            try:
                min(waits, key=lambda w: w[0])[1].result()
            except BaseException:  # noqa: BLE001 - kept in _failure / _persist_failure, raised later
                pass

    def check_space(self, shard: int) -> None:
        """Before training: the node's tmpfs must hold every local rank's slots (and replicas) of
        a state of ``shard`` bytes (this rank's tensors now: optimizer states made at the first
        step are checked by its write); raises :class:`MemorySpaceError` with the numbers."""
        self._check_space(None, shard)

    def _check_space(self, key: tuple[Any, ...] | None, shard: int) -> None:
        """The first write of a layout: the node's tmpfs must hold every local rank's slots (and
        replicas); raises :class:`MemorySpaceError` with the numbers, before writing anything."""
        if key is not None and self._checked == key:
            return
        self._checked = key
        need = self.ranks_per_node * self.config.slots * shard * (1 + self.config.replicas)
        mine = folder_bytes(self.folder)  # files other ranks rename meanwhile are skipped
        stat = os.statvfs(_existing(self.folder))
        free = stat.f_bavail * stat.f_frsize + mine
        if free < need:
            raise MemorySpaceError(
                f"recover.memory: {self.folder} has {free / 1e9:.2f} GB free (this trial's slots included), the "
                f"memory tier needs {need / 1e9:.2f} GB: {self.ranks_per_node} rank(s) on this node x "
                f"{self.config.slots} slots x {shard / 1e9:.3f} GB per rank's state x (1 + {self.config.replicas} "
                f"replicas). Free space on that file system (df -h {_existing(self.folder)}), "
                f"lower recover.memory.slots, or set recover.memory.root to a larger tmpfs")

    def _dcp_engine(self) -> Any:
        if self._engine is None:
            from areal_lightning.write.dcp import DCPEngine

            self._engine = DCPEngine(thread_count=1, collective=False)
        return self._engine

    def _drop_file(self, slot: int) -> None:
        file = self._files.pop(slot, None)
        if file is not None:
            file.close()

    def _cuda_stream(self) -> Any:
        """CUDA: the side stream device copies into the slots run on (``None`` without CUDA)."""
        if self._stream is None and cuda_device() is not None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _seal_pool(self) -> ThreadPoolExecutor:
        """The thread sealing the slots in the background (on the caller's GPU)."""
        if self._sealer is None:
            self._sealer = ThreadPoolExecutor(1, thread_name_prefix="areal-memory-seal", initializer=bind_thread_to,
                                              initargs=(cuda_device(),))
        return self._sealer

    def _hasher(self) -> ThreadPoolExecutor:
        """The threads copying and checksumming a share of a slot's items beside the caller."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max(1, COPY_THREADS - 1), thread_name_prefix="areal-memory-copy")
        return self._thread

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise CheckpointWriteError(f"memory tier slot in {self.rank_folder} failed: {failure!r}") from failure

    # -- end --------------------------------------------------------------------------------

    def wait(self) -> None:
        """Until the last slot is sealed and every peer copy started is done; raises a background failure."""
        self.wait_sealed()
        _join(self._replicating)
        self._raise_failure()

    def close(self) -> None:
        """Wait for the background parts (their failures are logged), drop the mappings; the slots stay."""
        for wait in (self.wait, self.wait_persist):
            try:
                wait()
            except BaseException as exc:  # noqa: BLE001 - close runs after errors too
                log.error("RecoverCallback: %s", exc)
        for slot in list(self._files):
            self._drop_file(slot)
        for pool in (self._thread, self._persister, self._replicator, self._sealer):
            if pool is not None:
                pool.shutdown(wait=True)
        self._thread = self._persister = self._replicator = self._sealer = None
        if self._peer is not None:
            self._peer.close()
            self._peer = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def remove(self) -> None:
        """Delete this rank's slots (``fit`` ended normally), then the tier's folders left empty."""
        self.close()
        shutil.rmtree(self.rank_folder, ignore_errors=True)
        try:  # the copies this node holds of other ranks (the node's other ranks remove them too)
            sources = list(self.folder.glob("replica_of_rank*"))
        except FileNotFoundError:  # another rank of this node removed the folder already
            sources = []
        for source in sources:
            shutil.rmtree(source, ignore_errors=True)
        for parent in (self.folder, *list(self.folder.parents)[:3]):
            try:
                parent.rmdir()
            except OSError:
                break
