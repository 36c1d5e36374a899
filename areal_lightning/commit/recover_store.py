"""The single, crash-safe recover checkpoint of a trial and its ``recover_info/`` metadata.

On disk (SPEC §4)::

    {trial}/{name}/recover_checkpoint/   # DCP directory of the last committed checkpoint
    {trial}/recover_info/*.json          # describes exactly that checkpoint

A save writes the new DCP directory and the new ``recover_info`` beside the current ones
(``.tmp-recover_checkpoint-{gen}``, ``.tmp-recover_info-{gen}``; ``checkpoint_info.json``,
holding the manifest of every file (:mod:`areal_lightning.commit.manifest`), is renamed in
last), then swaps them in by
four renames: two :class:`~areal_lightning.commit.atomic.AtomicDir` commits with the
generation as their token, run after the DCP save returned. A crash at any instant leaves
either the old pair, or a complete new pair that :meth:`RecoverStore.repair` rolls forward
on the next start. The folder names
carry the generation, so the swap is never confused with another save. Disk use is one
checkpoint plus, while a save is being written, the new one.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Callable, Protocol

from areal_lightning._fault import fault_point
from areal_lightning.commit.atomic import (
    AtomicDir,
    CommitPoints,
    CommitTarget,
    atomic_write_json,
    clean_leftovers,
    write_json,
)
from areal_lightning.collective import CheckpointGroup, check_shared_storage
from areal_lightning.commit.hf_meta import HFMetaRecorder
from areal_lightning.commit.manifest import check_files, metadata_checksum
from areal_lightning.errors import CheckpointCorruptError, TrialLockedError, start_fresh
from areal_lightning.layout import (
    CHECKPOINT_INFO,
    COMMIT_MARKER,
    INFO_FILES,
    LOCK_FILE,
    OLD_PREFIX,
    STEP_INFO,
    TMP_PREFIX,
    TrialLayout,
)
from areal_lightning.write.checksum import ALGORITHM, Written
from areal_lightning.write.durable import fsync_dir

__all__ = ["TrialLock", "RecoverStorage", "RecoverStore", "RecoverCommit", "INFO_FILES", "FORMAT_VERSION", "check_info"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_CKPT_POINTS = CommitPoints(None, lambda: fault_point("recover.swap.old_checkpoint_moved"),
                            lambda: fault_point("recover.swap.new_checkpoint_in_place"))
_INFO_POINTS = CommitPoints(None, lambda: fault_point("recover.swap.old_info_moved"),
                            lambda: fault_point("recover.swap.new_info_in_place"))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{path} is missing; recover_info/ is incomplete. {start_fresh(path.parent, sentence=True)}."
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{path} is not valid JSON ({exc}); {start_fresh(path.parent)}."
        ) from exc
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{path} holds {type(data).__name__}, expected a JSON object; "
                                     f"{start_fresh(path.parent)}.")
    return data


_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""``flock`` errors of file systems without locks (some NFS and FUSE mounts)."""


class TrialLock:
    """An exclusive ``flock`` on ``{trial}/.lock`` while a run writes the trial.

    Two processes training the same trial (an overlapping restart, a requeued job whose
    predecessor still runs) would delete each other's temporary folders and swap
    checkpoints under each other; the second one is refused instead. The OS releases
    the lock when the holder dies, SIGKILL included.
    """

    def __init__(self, trial_dir: Path) -> None:
        self.path = trial_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`TrialLockedError` naming the process that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise TrialLockedError(
                f"{self.path.parent} is being trained by another process (pid {holder}); two runs must not "
                "write the same trial. Stop the other run or use another trial_name.") from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_FLOCK:
                raise
            log.warning("%s: this file system does not support flock (%s); the trial is not protected against "
                        "a second run training it at the same time", self.path, exc)
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class RecoverStorage(Protocol):
    """What a recover session needs of a trial's recover store: :class:`RecoverStore` (a file
    system, committed by renames) and
    :class:`~areal_lightning.commit.object_recover_store.ObjectRecoverStore` (an object store,
    committed by a marker) implement it alike."""

    layout: TrialLayout
    ckpt_dir: Any
    info_dir: Any
    storage_options: dict[str, Any]
    claim_label: str  # what claim() checks, in messages

    def claim(self, rank: int) -> None:
        """At setup, on every rank: take the trial for this run, or raise why it cannot be used."""
        ...

    def check_shared(self, ranks: CheckpointGroup, lead: bool) -> None:
        """At setup, collective: raise on every rank unless every rank sees the same storage."""
        ...

    def release(self) -> None:
        """Give the trial back (idempotent)."""
        ...

    def retries(self) -> int | None:
        """Requests retried so far (transient object-store errors), ``None`` where none can be."""
        ...

    def clean_stale(self) -> None:
        """Remove what interrupted saves left (rank 0, no save in flight)."""
        ...

    def new_generation(self, global_step: int) -> str:
        """A unique name for one save."""
        ...

    def record_hf_models(self, entries: Callable[[], list[Any]]) -> dict[str, Any] | None:
        """``checkpoint_info.json``'s ``hf_models`` for a save now (rank 0), of the models
        ``entries()`` gives; ``None``: not recorded (``entries`` not called)."""
        ...

    def target(self, gen: str, info: dict[str, dict[str, Any]],
               on_committed: Callable[[Written], None] | None = None) -> CommitTarget:
        """The commit target of save ``gen``."""
        ...

    def exists(self) -> bool:
        """Whether a committed recover checkpoint exists."""
        ...

    def info_deleted(self) -> bool:
        """Whether a committed checkpoint's data is there without its ``recover_info`` (the
        documented fresh start: the user deleted it)."""
        ...

    def read_info(self) -> dict[str, dict[str, Any]]:
        """The committed ``recover_info`` files."""
        ...

    def verify(self, checkpoint_info: dict[str, Any], data: bool | None = True) -> int:
        """Check the committed checkpoint against its manifest."""
        ...

    def checkpoint_path(self) -> Any:
        """The committed checkpoint's folder (a URI on an object store)."""
        ...

    def repair(self) -> str | None:
        """Finish or undo an interrupted commit."""
        ...


class RecoverStore:
    """Paths, commit protocol, repair and validation of one trial's recover checkpoint on a
    file system (a :class:`RecoverStorage`)."""

    claim_label = "trial lock"

    def __init__(self, layout: TrialLayout, name: str = "default") -> None:
        self.layout = layout
        self.ckpt_dir = layout.recover_checkpoint_dir(name)
        self.info_dir = layout.recover_info_dir
        self.storage_options: dict[str, Any] = {}
        self._lock: TrialLock | None = None
        self._hf_meta: HFMetaRecorder | None = None

    # -- the trial ----------------------------------------------------------------------

    def claim(self, rank: int) -> None:
        """Rank 0 takes the trial lock (:class:`TrialLock`); what was recorded of the HF models
        is looked at afresh in this fit."""
        self._hf_meta = None
        if rank == 0:
            self._lock = TrialLock(self.layout.trial_dir)
            self._lock.acquire()

    def check_shared(self, ranks: CheckpointGroup, lead: bool) -> None:
        """Every rank sees the file rank 0 writes into the trial folder (a node-local fileroot
        would split each checkpoint across nodes)."""
        check_shared_storage(ranks, self.layout.trial_dir, lead)

    def release(self) -> None:
        """Release the trial lock (idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def retries(self) -> int | None:
        """A file system retries nothing."""
        return None

    def record_hf_models(self, entries: Callable[[], list[Any]]) -> dict[str, Any] | None:
        """Write the ``recover_hf/{digest}/`` folders ``convert --to hf`` needs (once per trial)
        and describe them (:class:`~areal_lightning.commit.hf_meta.HFMetaRecorder`)."""
        if self._hf_meta is None:
            self._hf_meta = HFMetaRecorder(self.layout.trial_dir)
        return self._hf_meta.record(entries())

    # -- writing ---------------------------------------------------------------------------

    @staticmethod
    def new_generation(global_step: int) -> str:
        """A unique name for one save (the token of its two :class:`AtomicDir` commits)."""
        return f"{global_step}-{uuid.uuid4().hex[:8]}"

    def commits(self, gen: str) -> tuple[AtomicDir, AtomicDir]:
        """The two commits of save ``gen``: the DCP directory, then its ``recover_info``."""
        return (AtomicDir(self.ckpt_dir, gen, fsync=False, points=_CKPT_POINTS),
                AtomicDir(self.info_dir, gen, fsync=False, points=_INFO_POINTS))

    def tmp_ckpt_dir(self, gen: str) -> Path:
        """Where the DCP files of save ``gen`` are written."""
        return self.commits(gen)[0].tmp

    def tmp_info_dir(self, gen: str) -> Path:
        """Where the ``recover_info`` of save ``gen`` is written before the swap."""
        return self.commits(gen)[1].tmp

    def target(self, gen: str, info: dict[str, dict[str, Any]],
               on_committed: Callable[[Written], None] | None = None) -> "RecoverCommit":
        """The :class:`~areal_lightning.commit.atomic.CommitTarget` of save ``gen``
        (the argument of ``DCPCheckpointIO.write``): the DCP files go to
        :meth:`tmp_ckpt_dir`, and its ``finalize`` is :meth:`commit` (then
        ``on_committed(written)``)."""
        return RecoverCommit(self, gen, info, on_committed)

    def clean_stale(self) -> None:
        """Remove leftovers of interrupted saves (call when no save is in flight)."""
        for final in (self.ckpt_dir, self.info_dir):
            clean_leftovers(final.parent, lambda name, final=final: _is_leftover_of(name, final.name))

    def commit(self, gen: str, info: dict[str, dict[str, Any]], files: dict[str, dict[str, int]]) -> None:
        """Publish the committed DCP directory of save ``gen`` with its ``recover_info``.

        Runs once the DCP save has returned (for an async save, in the background), on
        rank 0, and touches metadata only: ``info`` maps each of :data:`INFO_FILES` to its
        content; ``files`` (the manifest the DCP writer built, see
        :mod:`areal_lightning.commit.manifest`) and the commit time are added to
        ``checkpoint_info.json`` here. No checkpoint file is read.
        """
        tmp_ckpt = self.tmp_ckpt_dir(gen)
        if not (tmp_ckpt / COMMIT_MARKER).is_file():
            raise CheckpointCorruptError(
                f"{tmp_ckpt} has no {COMMIT_MARKER} at commit time (was it removed by another process?); "
                "the previous recover checkpoint stays in place")
        checkpoint_info = dict(info[CHECKPOINT_INFO])
        checkpoint_info.update(
            generation=gen,
            checksum=ALGORITHM,
            files=files,
            commit_time=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
        )
        tmp_info = self.commits(gen)[1].create()
        # The folder is invisible until its rename: the other files are written in place
        # (each fsynced), one folder fsync makes them durable, and checkpoint_info.json, whose
        # presence marks the folder complete (pending_swap), is renamed in last.
        for name in INFO_FILES:
            if name == CHECKPOINT_INFO:
                continue
            write_json(tmp_info / name, info[name])
            fault_point("recover.info.after_file")
        fsync_dir(tmp_info)  # the files above are durable before checkpoint_info.json can be
        fault_point("recover.info.before_checkpoint_info")
        atomic_write_json(tmp_info / CHECKPOINT_INFO, checkpoint_info)  # fsyncs tmp_info after the rename
        fault_point("recover.info.after_file")
        fault_point("recover.swap.begin")
        self._finish_swap(gen)

    def _finish_swap(self, gen: str) -> None:
        """Idempotently move the new pair of ``gen`` into place (also used by :meth:`repair`):
        the DCP folder's commit, then the recover_info's, then the replaced pair is deleted."""
        commits = self.commits(gen)
        for commit in commits:
            commit.finalize(remove_old=False)
        for commit in commits:
            commit.remove_old()

    # -- reading ---------------------------------------------------------------------------

    def pending_swap(self) -> str | None:
        """The generation of a swap a crash interrupted, which :meth:`repair` finishes (read-only).

        A complete ``.tmp-recover_info-{gen}`` (its ``checkpoint_info.json`` exists) is
        written only after the new DCP directory is committed, so finishing the swap is
        always safe. It counts only when the swap had begun (the old checkpoint or info was
        moved aside, or the new checkpoint is already in place); after a crash before that
        the old pair stays, and a deleted ``recover_info/`` still means a fresh start.
        """
        parent = self.info_dir.parent
        if not parent.is_dir():
            return None
        tmp_info = f"{TMP_PREFIX}{self.info_dir.name}-"
        complete = {}
        for c in parent.iterdir():
            step, _, _token = c.name[len(tmp_info):].partition("-")
            if c.name.startswith(tmp_info) and step.isdigit() and (c / CHECKPOINT_INFO).is_file():
                complete[int(step)] = c.name[len(tmp_info):]
        if not complete:
            return None
        gen = complete[max(complete)]
        ckpt, info = self.commits(gen)
        began = ckpt.old.exists() or info.old.exists() or (not ckpt.tmp.exists() and self._in_place_is(gen))
        return gen if began else None

    def repair(self) -> str | None:
        """Finish the swap a crash interrupted (see :meth:`pending_swap`); return its generation.

        Leftovers of interrupted saves are removed by :meth:`clean_stale` at the next save.
        """
        gen = self.pending_swap()
        if gen is None:
            return None
        log.warning("recover: finishing the checkpoint swap of save %s that was interrupted", gen)
        self._finish_swap(gen)
        return gen

    def _in_place_is(self, gen: str) -> bool:
        """Does ``recover_checkpoint/`` hold the checkpoint described by the temporary info of ``gen``?"""
        try:
            want = json.loads((self.tmp_info_dir(gen) / CHECKPOINT_INFO).read_text())["files"][COMMIT_MARKER]
            return (self.ckpt_dir / COMMIT_MARKER).stat().st_size == want["size"] and \
                metadata_checksum(self.ckpt_dir, want)
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def exists(self) -> bool:
        """True when ``recover_info/`` exists (a recover checkpoint is expected)."""
        return self.info_dir.is_dir()

    def info_deleted(self) -> bool:
        """``recover_checkpoint/`` without ``recover_info/`` (after :meth:`repair`): the user deleted it."""
        return not self.info_dir.is_dir() and self.ckpt_dir.is_dir()

    def info_file(self, name: str) -> Path:
        """Where the ``recover_info`` file ``name`` is."""
        return self.info_dir / name

    def checkpoint_path(self) -> Path:
        """The DCP directory of the committed recover checkpoint."""
        return self.ckpt_dir

    def read_info(self) -> dict[str, dict[str, Any]]:
        """All ``recover_info`` files, validated for syntax and mutual consistency."""
        return check_info({name: _read_json(self.info_dir / name) for name in INFO_FILES}, self.info_dir)

    def verify(self, checkpoint_info: dict[str, Any], data: bool | None = True) -> int:
        """Check the checkpoint's files against ``checkpoint_info``; return bytes read.

        Raises :class:`CheckpointCorruptError` naming the first missing, truncated or
        altered file (a partial checkpoint is never loaded). ``data=True`` reads every data
        file (the offline check); ``False`` checks presence, sizes and ``.metadata``'s
        checksum; ``None`` is what a resume needs: that, and the full pass only for
        checkpoints of earlier versions, whose items carry no checksum the load could verify
        (see :func:`~areal_lightning.commit.manifest.check_files`).
        """
        if not self.ckpt_dir.is_dir():
            raise CheckpointCorruptError(
                f"{self.ckpt_dir} is missing although {self.info_dir} describes a checkpoint after "
                f"{checkpoint_info['global_step']} steps; {start_fresh(self.info_dir)}."
            )
        hint = f"the recover checkpoint is damaged; restore the file or {start_fresh(self.info_dir)}"
        return check_files(self.ckpt_dir, checkpoint_info["files"], self.info_dir / CHECKPOINT_INFO, hint, data=data)


def check_info(info: dict[str, dict[str, Any]], info_dir: Any) -> dict[str, dict[str, Any]]:
    """Validate the ``recover_info`` files ``info`` (read from ``info_dir``, a folder or an
    object-store prefix) for syntax and mutual consistency; return them."""
    ckpt, step = info[CHECKPOINT_INFO], info[STEP_INFO]
    path = f"{info_dir}/{CHECKPOINT_INFO}"
    if ckpt.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{path}: format_version {ckpt.get('format_version')!r} is not {FORMAT_VERSION}, "
            "the version this areal-lightning reads; resume with the version that wrote it, "
            f"or {start_fresh(info_dir)}."
        )
    for key, types in (("global_step", int), ("files", dict), ("world_size", int), ("strategy", str),
                       ("experiment_name", str), ("trial_name", str)):
        if not isinstance(ckpt.get(key), types):
            raise CheckpointCorruptError(
                f"{path}: {key!r} is missing or not a {types.__name__}; {start_fresh(info_dir)}.")
    step_path = f"{info_dir}/{STEP_INFO}"
    for key in ("epoch", "epoch_step", "global_step"):
        if not isinstance(step.get(key), int):
            raise CheckpointCorruptError(
                f"{step_path}: {key!r} is missing or not an integer; {start_fresh(info_dir)}.")
    if step.get("global_step") != ckpt["global_step"] - 1:
        raise CheckpointCorruptError(
            f"{step_path} says global step {step.get('global_step')!r} but "
            f"{path} describes a checkpoint after {ckpt['global_step']} steps: recover_info/ does not "
            f"describe the checkpoint that is there. {start_fresh(info_dir, sentence=True)}."
        )
    return info


def _is_leftover_of(name: str, final: str) -> bool:
    """A ``.tmp-`` / ``.old-`` sibling of the recover folder ``final`` (any generation)."""
    return name.startswith((f"{TMP_PREFIX}{final}-", f"{OLD_PREFIX}{final}-"))


class RecoverCommit:
    """The :class:`~areal_lightning.commit.atomic.CommitTarget` of one recover save: the DCP
    files are written to :attr:`tmp`; :meth:`finalize` writes ``recover_info`` and swaps
    the pair in (:meth:`RecoverStore.commit`) with the manifest of what the save wrote."""

    def __init__(self, store: Any, gen: str, info: dict[str, dict[str, Any]],
                 on_committed: Callable[[Written], None] | None = None) -> None:
        self.store, self.gen, self.info = store, gen, info
        self.on_committed = on_committed
        self.final = store.ckpt_dir
        self.tmp = store.tmp_ckpt_dir(gen)

    def create(self) -> Path:
        """Create the temporary DCP folder of this save."""
        return self.store.commits(self.gen)[0].create()

    def finalize(self, written: Written | None = None) -> None:
        """Write ``recover_info`` and swap the new pair in (rank 0, after the DCP save returned
        ``written``, its manifest included)."""
        if written is None or written.files is None:
            raise CheckpointCorruptError(f"{self.tmp}: the DCP save returned no manifest; the previous recover "
                                         "checkpoint stays in place")
        self.store.commit(self.gen, self.info, written.files)
        if self.on_committed is not None:
            self.on_committed(written)

    def discard(self) -> None:
        """Leave the leftovers to :meth:`RecoverStore.clean_stale` at the next save."""
