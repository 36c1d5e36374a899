"""Rank agreement for the checkpoint path: dedicated gloo groups with their own timeout.

Every collective the plugin runs itself (the agreement below, DCP's planning and commit
exchanges, HF export agreement) goes over a :class:`CheckpointGroup`: two gloo groups
created together by all ranks, one for the training thread and one for background threads
(two threads never share a group), with ``timeout`` seconds of their own (default
:data:`DEFAULT_TIMEOUT_S`), so a checkpoint never waits on the training process group's
30-minute default. The DCP engine and each ``HFSaverCallback`` have one ``CheckpointGroup``.

:meth:`CheckpointGroup.agree` is how a rank-local failure becomes an error on every rank:
each rank reports ``None`` or its error (and an optional small payload); if any rank failed,
every rank raises -- the failing rank its own error, the others
:class:`~areal_lightning.errors.RankFailure` (a ``CheckpointWriteError``) naming the failed rank and its error.
A rank that never arrives (killed, stuck) makes the others raise once ``timeout`` has
passed, naming the timeout.

**Ending the groups.** A gloo group is a C++ object with two worker threads and a socket
loop thread of its own; ``destroy_process_group`` only unregisters it, and its threads end
when the last Python reference to it goes. A group still referenced when the interpreter
exits is freed during finalization, and a gloo worker thread that then needs the GIL (to
drop a tensor that Python created) makes Python end that thread from inside a C++
destructor: ``terminate called without an active exception`` (SIGABRT) after a run that
finished. So :meth:`CheckpointGroup.close` unregisters and drops its groups (the teardown
of every owner calls it), and :func:`end_checkpoint_groups`, registered with :mod:`atexit`
when the first group is made, ends those of runs that never reached their teardown
(exceptions, ``Preempted``, ``sys.exit``) while the interpreter is still whole.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import threading
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_lightning.config import ConfigError
from areal_lightning.errors import RankFailure
from areal_lightning.layout import SHARED_CHECK_PREFIX

log = logging.getLogger(__name__)

__all__ = ["CheckpointGroup", "DEFAULT_TIMEOUT_S", "RankFailure", "check_shared_storage", "end_checkpoint_groups",
           "validate_timeout"]

DEFAULT_TIMEOUT_S = 900.0
"""Seconds a checkpoint collective waits for the other ranks (it must exceed the time the
slowest rank takes to write its files of one save)."""


def validate_timeout(value: Any, field: str = "collective_timeout") -> float:
    """``value`` as seconds (> 0), else :class:`~areal_lightning.config.ConfigError` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(field, f"expected a positive number of seconds, got {value!r}")
    return float(value)


_LIVE: "weakref.WeakSet[CheckpointGroup]" = weakref.WeakSet()
"""Every :class:`CheckpointGroup` holding process groups now (ended by the exit hook)."""
_TRACK_LOCK = threading.Lock()
_exit_hook_registered = False


def _track(ranks: "CheckpointGroup") -> None:
    """Remember ``ranks`` for :func:`end_checkpoint_groups`; register that with atexit once."""
    global _exit_hook_registered
    with _TRACK_LOCK:
        _LIVE.add(ranks)
        if not _exit_hook_registered:
            atexit.register(end_checkpoint_groups)
            _exit_hook_registered = True


def end_checkpoint_groups() -> int:
    """Close every :class:`CheckpointGroup` still holding process groups; returns how many.

    Registered with :mod:`atexit` when the first group is created, so a run that never
    reached its teardown (an exception, ``Preempted``, ``sys.exit`` in user code) still ends
    its gloo threads before the interpreter finalizes (see the module doc)."""
    live = list(_LIVE)
    for ranks in live:
        ranks.close()
    return len(live)


def _end_group(group: dist.ProcessGroup | None) -> None:
    """Unregister ``group`` from torch.distributed if it still is registered (a rank-local
    step for gloo); the caller then drops its reference, which ends its threads."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": the world was destroyed (or re-made) before
        pass


class CheckpointGroup:
    """The dedicated gloo group of the checkpoint path (created lazily, collectively)."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout = validate_timeout(timeout)
        self._group: dist.ProcessGroup | None = None
        self._background: dist.ProcessGroup | None = None
        self._local: dist.ProcessGroup | None = None
        self._world: Any = None  # the default group the two were created in

    def configure(self, timeout: float) -> None:
        """Set the timeout before the group exists (a later change cannot apply: warns)."""
        timeout = validate_timeout(timeout)
        if (self._group is not None or self._background is not None) and timeout != self.timeout:
            log.warning("checkpoint group already created with collective_timeout=%gs; %gs ignored",
                        self.timeout, timeout)
            return
        self.timeout = timeout

    @staticmethod
    def active() -> bool:
        """Whether a process group of more than one rank is initialized."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _current(self) -> None:
        """Drop the groups of an earlier default group (destroyed and made again)."""
        if self._world is not dist.group.WORLD:
            self.close()
            self._world = dist.group.WORLD

    def _create(self) -> None:
        """Both groups, always together and in this order, so every rank names them alike
        whichever it uses first; again after the default process group was recreated."""
        self._current()
        if self._group is None:
            timeout = datetime.timedelta(seconds=self.timeout)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
            self._background = dist.new_group(backend="gloo", timeout=timeout)
            _track(self)

    @property
    def group(self) -> dist.ProcessGroup:
        """The gloo group over all ranks for collectives on the training thread (agreements,
        sync saves); the first use is collective."""
        self._create()
        assert self._group is not None
        return self._group

    @property
    def background_group(self) -> dist.ProcessGroup:
        """A second gloo group over all ranks, for collectives in background threads (async
        saves): two threads must never run collectives on one group at once."""
        self._create()
        assert self._background is not None
        return self._background

    @property
    def local_group(self) -> dist.ProcessGroup:
        """A gloo group of this rank alone (made without involving the others), for the
        rank-local DCP calls that still want a CPU process group."""
        self._current()
        if self._local is None:
            self._local = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
            _track(self)
        return self._local

    def agree(self, error: BaseException | None, what: str, payload: Any = None, *,
              background: bool = False) -> list[Any]:
        """Exchange ``error`` (this rank's failure or ``None``) and ``payload`` with every rank.

        Returns every rank's payload when no rank failed; raises on every rank otherwise.
        Without an active multi-rank process group it raises ``error`` or returns ``[payload]``.
        ``background``: on :attr:`background_group` (from a background thread)."""
        if not self.active():
            if error is not None:
                raise error
            return [payload]
        mine = (None if error is None else f"{type(error).__name__}: {error}"[:2000], payload)
        try:
            pickle.dumps(mine)
        except Exception as exc:  # noqa: BLE001 - reported as this rank's failure, on every rank
            error = error or exc
            mine = (f"{what}: cannot send this rank's report: {exc!r}"[:2000], None)
        reports: list[Any] = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(reports, mine, group=self.background_group if background else self.group)
        except Exception as exc:  # a rank died or hangs: gloo's timeout
            if error is not None:
                raise error from exc
            raise RankFailure(
                f"{what}: not every rank reached the checkpoint agreement within collective_timeout="
                f"{self.timeout:g}s (another rank failed, was killed or hangs): {exc}") from exc
        if error is not None:
            raise error
        failed = [(rank, msg) for rank, (msg, _) in enumerate(reports) if msg is not None]
        if failed:
            rank, msg = failed[0]
            raise RankFailure(f"{what} failed on rank {rank}: {msg}")
        return [value for _, value in reports]

    def share(self, error: BaseException | None, what: str, payload: Any = None, *, source: int = 0) -> Any:
        """Rank ``source``'s ``payload`` on every rank, once every rank agreed that none failed
        (:meth:`agree` of ``error``, nothing else sent): one broadcast, the other ranks send
        nothing (where ``agree`` would gather every rank's payload). Without an active
        multi-rank process group: ``payload`` (or ``error`` raised)."""
        self.agree(error, what)
        if not self.active():
            return payload
        box = [payload if dist.get_rank() == source else None]
        try:
            dist.broadcast_object_list(box, src=source, group=self.group)
        except Exception as exc:  # a rank died or hangs: gloo's timeout
            raise RankFailure(f"{what}: rank {source}'s data did not reach every rank within collective_timeout="
                              f"{self.timeout:g}s (another rank failed, was killed or hangs): {exc}") from exc
        return box[0]

    def any(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` is set on any rank (one all-reduce of one integer on the gloo group;
        without an active multi-rank process group: ``flag``)."""
        if not self.active():
            return flag
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        try:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:  # a rank died or hangs: gloo's timeout
            raise RankFailure(f"{what}: not every rank arrived within collective_timeout={self.timeout:g}s "
                              f"(another rank failed, was killed or hangs): {exc}") from exc
        return bool(value.item())

    def close(self) -> None:
        """End the groups: unregister them and drop them, which joins their gloo threads
        (idempotent; a later use creates new ones, collectively). Every rank's owner calls
        it in its teardown, after the last collective on them; a rank still waiting in one
        then fails at once instead of at the timeout."""
        groups = (self._group, self._background, self._local)
        self._group = self._background = self._local = self._world = None
        _LIVE.discard(self)
        for group in groups:
            _end_group(group)
        del groups  # the last references: each group's destructor joins its threads here

    @property
    def holds_groups(self) -> bool:
        """Whether any process group of this object is alive (not yet closed)."""
        return any(g is not None for g in (self._group, self._background, self._local))


def check_shared_storage(ranks: CheckpointGroup, folder: Path, lead: bool) -> None:
    """Raise on every rank unless every rank sees a file rank 0 just wrote into ``folder``.

    Checkpoints are one directory written by all ranks; a ``fileroot`` that is a
    node-local path on each node would silently split every checkpoint across nodes."""
    if not ranks.active():
        return
    name, error = None, None
    if lead:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            name = f"{SHARED_CHECK_PREFIX}{uuid.uuid4().hex}"
            (folder / name).write_text(str(os.getpid()))
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
    name = ranks.agree(error, "shared storage check", name)[0]
    try:
        seen = (folder / name).is_file()
        error = None if seen else RuntimeError(
            f"rank {dist.get_rank()} cannot see {name} in {folder}, which rank 0 wrote into its trial folder a "
            "moment ago: every rank must see the same fileroot (one shared file system; a node-local path on "
            "each node would split every checkpoint between the nodes)")
        ranks.agree(error, f"shared storage check of {folder}")
    finally:
        if lead:
            (folder / name).unlink(missing_ok=True)
