"""The single, crash-safe recover checkpoint of a trial and its ``recover_info/`` metadata.

On disk (SPEC §4)::

    {trial}/{name}/recover_checkpoint/   # DCP directory of the last committed checkpoint
    {trial}/recover_info/*.json          # describes exactly that checkpoint

A save writes the new DCP directory and the new ``recover_info`` beside the current ones
(``.tmp-recover_checkpoint-{gen}``, ``.tmp-recover_info-{gen}``; ``checkpoint_info.json``,
holding size and CRC32 of every file, is written last and fsynced), then swaps them in by
four renames. A crash at any instant leaves either the old pair, or a complete new pair
that :meth:`RecoverStore.repair` rolls forward on the next start. The folder names
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
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

from areal_lightning._fault import fault_point
from areal_lightning.commit.atomic import atomic_write_json, fsync_dir
from areal_lightning.errors import CheckpointCorruptError
from areal_lightning.layout import COMMIT_MARKER, TrialLayout

__all__ = ["TrialLock", "RecoverStore", "RecoverMismatchError", "INFO_FILES", "FORMAT_VERSION", "file_checksums", "file_checksums_of"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
INFO_FILES = (
    "step_info.json", "saver_info.json", "evaluator_info.json", "stats_logger_info.json", "dataloader_info.json",
    "checkpoint_info.json",  # last: its presence marks a complete recover_info
)
_TMP_CKPT = ".tmp-recover_checkpoint-"
_OLD_CKPT = ".old-recover_checkpoint-"
_TMP_INFO = ".tmp-recover_info-"
_OLD_INFO = ".old-recover_info-"
_CHUNK = 8 << 20


class RecoverMismatchError(RuntimeError):
    """The recover checkpoint was written by a run that differs from this one (world size,
    strategy, experiment, trial); the message explains what differs and what to do."""


def file_checksums_of(path: Path) -> dict[str, int]:
    """``{"size", "crc32"}`` of one file."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": crc}


def file_checksums(root: Path) -> dict[str, dict[str, int]]:
    """``{relative path: {"size", "crc32"}}`` of every file below ``root``."""
    return {str(p.relative_to(root)): file_checksums_of(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{path} is missing; recover_info/ is incomplete. Delete {path.parent} to start fresh."
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{path} is not valid JSON ({exc}); delete {path.parent} to start fresh."
        ) from exc
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{path} holds {type(data).__name__}, expected a JSON object; "
                                     f"delete {path.parent} to start fresh.")
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
        self.path = trial_dir / ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ``RuntimeError`` naming the process that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(
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


class RecoverStore:
    """Paths, commit protocol, repair and validation of one trial's recover checkpoint."""

    def __init__(self, layout: TrialLayout, name: str = "default") -> None:
        self.layout = layout
        self.ckpt_dir = layout.recover_checkpoint_dir(name)
        self.info_dir = layout.recover_info_dir

    # -- writing ---------------------------------------------------------------------------

    @staticmethod
    def new_generation(global_step: int) -> str:
        """A unique name for one save."""
        return f"{global_step}-{uuid.uuid4().hex[:8]}"

    def tmp_ckpt_dir(self, gen: str) -> Path:
        """Where the DCP files of save ``gen`` are written."""
        return self.ckpt_dir.parent / f"{_TMP_CKPT}{gen}"

    def tmp_info_dir(self, gen: str) -> Path:
        """Where the ``recover_info`` of save ``gen`` is written before the swap."""
        return self.info_dir.parent / f"{_TMP_INFO}{gen}"

    def clean_stale(self) -> None:
        """Remove leftovers of interrupted saves (call when no save is in flight)."""
        for parent, prefixes in ((self.ckpt_dir.parent, (_TMP_CKPT, _OLD_CKPT)),
                                 (self.info_dir.parent, (_TMP_INFO, _OLD_INFO))):
            if parent.is_dir():
                for child in parent.iterdir():
                    if child.name.startswith(prefixes):
                        shutil.rmtree(child, ignore_errors=True)

    def commit(self, gen: str, info: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
        """Publish the committed DCP directory of save ``gen`` with its ``recover_info``.

        ``info`` maps each of :data:`INFO_FILES` to its content; the file list with sizes
        and checksums and the commit time are added to ``checkpoint_info.json`` here.
        Returns that file list.
        """
        tmp_ckpt = self.tmp_ckpt_dir(gen)
        if not (tmp_ckpt / COMMIT_MARKER).is_file():
            raise CheckpointCorruptError(
                f"{tmp_ckpt} has no {COMMIT_MARKER} at commit time (was it removed by another process?); "
                "the previous recover checkpoint stays in place")
        checkpoint_info = dict(info["checkpoint_info.json"])
        checkpoint_info.update(
            generation=gen,
            files=file_checksums(tmp_ckpt),
            commit_time=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
        )
        tmp_info = self.tmp_info_dir(gen)
        tmp_info.mkdir(parents=True, exist_ok=True)
        for name in INFO_FILES:
            content = checkpoint_info if name == "checkpoint_info.json" else info[name]
            if name == "checkpoint_info.json":
                fault_point("recover.info.before_checkpoint_info")
            atomic_write_json(tmp_info / name, content)
            fault_point("recover.info.after_file")
        fsync_dir(tmp_info)
        fault_point("recover.swap.begin")
        self._finish_swap(gen)
        return checkpoint_info["files"]

    def _finish_swap(self, gen: str) -> None:
        """Idempotently move the new pair of ``gen`` into place (also used by :meth:`repair`).

        The new DCP folder is either still at its temporary name or already in place (a
        crash after that rename); the recover_info follows it.
        """
        tmp_ckpt, tmp_info = self.tmp_ckpt_dir(gen), self.tmp_info_dir(gen)
        old_ckpt = self.ckpt_dir.parent / f"{_OLD_CKPT}{gen}"
        old_info = self.info_dir.parent / f"{_OLD_INFO}{gen}"
        if tmp_ckpt.exists():
            if self.ckpt_dir.exists():
                os.rename(self.ckpt_dir, old_ckpt)
                fault_point("recover.swap.old_checkpoint_moved")
            os.rename(tmp_ckpt, self.ckpt_dir)
            fsync_dir(self.ckpt_dir.parent)
            fault_point("recover.swap.new_checkpoint_in_place")
        if tmp_info.exists():
            if self.info_dir.exists():
                os.rename(self.info_dir, old_info)
                fault_point("recover.swap.old_info_moved")
            os.rename(tmp_info, self.info_dir)
            fsync_dir(self.info_dir.parent)
            fault_point("recover.swap.new_info_in_place")
        shutil.rmtree(old_ckpt, ignore_errors=True)
        shutil.rmtree(old_info, ignore_errors=True)

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
        complete = {}
        for c in parent.iterdir():
            step, _, _token = c.name[len(_TMP_INFO):].partition("-")
            if c.name.startswith(_TMP_INFO) and step.isdigit() and (c / "checkpoint_info.json").is_file():
                complete[int(step)] = c.name[len(_TMP_INFO):]
        if not complete:
            return None
        gen = complete[max(complete)]
        began = ((self.ckpt_dir.parent / f"{_OLD_CKPT}{gen}").exists()
                 or (self.info_dir.parent / f"{_OLD_INFO}{gen}").exists()
                 or (not self.tmp_ckpt_dir(gen).exists() and self._in_place_is(gen)))
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
            want = json.loads((self.tmp_info_dir(gen) / "checkpoint_info.json").read_text())["files"][COMMIT_MARKER]
            have = file_checksums_of(self.ckpt_dir / COMMIT_MARKER)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return have == want

    def exists(self) -> bool:
        """True when ``recover_info/`` exists (a recover checkpoint is expected)."""
        return self.info_dir.is_dir()

    def read_info(self) -> dict[str, dict[str, Any]]:
        """All ``recover_info`` files, validated for syntax and mutual consistency."""
        info = {name: _read_json(self.info_dir / name) for name in INFO_FILES}
        ckpt, step = info["checkpoint_info.json"], info["step_info.json"]
        path = self.info_dir / "checkpoint_info.json"
        if ckpt.get("format_version") != FORMAT_VERSION:
            raise CheckpointCorruptError(
                f"{path}: format_version {ckpt.get('format_version')!r} is not {FORMAT_VERSION}, "
                "the version this areal-lightning reads; resume with the version that wrote it, "
                f"or delete {self.info_dir} to start fresh."
            )
        for key, types in (("global_step", int), ("files", dict), ("world_size", int), ("strategy", str),
                           ("experiment_name", str), ("trial_name", str)):
            if not isinstance(ckpt.get(key), types):
                raise CheckpointCorruptError(
                    f"{path}: {key!r} is missing or not a {types.__name__}; delete {self.info_dir} to start fresh.")
        step_path = self.info_dir / "step_info.json"
        for key in ("epoch", "epoch_step", "global_step"):
            if not isinstance(step.get(key), int):
                raise CheckpointCorruptError(
                    f"{step_path}: {key!r} is missing or not an integer; delete {self.info_dir} to start fresh.")
        if step.get("global_step") != ckpt["global_step"] - 1:
            raise CheckpointCorruptError(
                f"{self.info_dir / 'step_info.json'} says global step {step.get('global_step')!r} but "
                f"{path} describes a checkpoint after {ckpt['global_step']} steps: recover_info/ does not "
                f"describe the checkpoint that is there. Delete {self.info_dir} to start fresh."
            )
        return info

    def verify(self, checkpoint_info: dict[str, Any], crc: bool = True) -> int:
        """Check every file of the checkpoint against ``checkpoint_info``; return bytes checked.

        Raises :class:`CheckpointCorruptError` naming the first missing, truncated or
        altered file (a partial checkpoint is never loaded). ``crc=False`` checks presence
        and sizes only (no read of the data).
        """
        if not self.ckpt_dir.is_dir():
            raise CheckpointCorruptError(
                f"{self.ckpt_dir} is missing although {self.info_dir} describes a checkpoint after "
                f"{checkpoint_info['global_step']} steps; delete {self.info_dir} to start fresh."
            )
        expected: dict[str, dict[str, int]] = checkpoint_info["files"]
        if COMMIT_MARKER not in expected:
            raise CheckpointCorruptError(f"{self.info_dir / 'checkpoint_info.json'} lists no {COMMIT_MARKER}")
        total = 0
        for rel, want in sorted(expected.items()):
            path = self.ckpt_dir / rel
            hint = f"the recover checkpoint is damaged; restore the file or delete {self.info_dir} to start fresh"
            if not isinstance(want, dict) or not isinstance(want.get("size"), int) or (
                    crc and not isinstance(want.get("crc32"), int)):
                raise CheckpointCorruptError(f"{self.info_dir / 'checkpoint_info.json'}: bad entry for {rel!r}: {want!r}")
            if not path.is_file():
                raise CheckpointCorruptError(f"{path} is missing: {hint}.")
            size = path.stat().st_size
            if size != want["size"]:
                raise CheckpointCorruptError(f"{path} has {size} bytes, expected {want['size']} (truncated?): {hint}.")
            if crc and file_checksums_of(path)["crc32"] != want["crc32"]:
                raise CheckpointCorruptError(f"{path} fails its CRC32 check (content altered): {hint}.")
            total += size
        return total
