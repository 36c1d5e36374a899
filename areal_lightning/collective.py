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
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal_lightning.config import ConfigError
from areal_lightning.errors import RankFailure
from areal_lightning.layout import SHARED_CHECK_PREFIX

log = logging.getLogger(__name__)

__all__ = ["CheckpointGroup", "DEFAULT_TIMEOUT_S", "RankFailure", "check_shared_storage", "validate_timeout"]

DEFAULT_TIMEOUT_S = 900.0
"""Seconds a checkpoint collective waits for the other ranks (it must exceed the time the
slowest rank takes to write its files of one save)."""


def validate_timeout(value: Any, field: str = "collective_timeout") -> float:
    """``value`` as seconds (> 0), else :class:`~areal_lightning.config.ConfigError` naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(field, f"expected a positive number of seconds, got {value!r}")
    return float(value)


class CheckpointGroup:
    """The dedicated gloo group of the checkpoint path (created lazily, collectively)."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout = validate_timeout(timeout)
        self._group: dist.ProcessGroup | None = None
        self._background: dist.ProcessGroup | None = None
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

    def _create(self) -> None:
        """Both groups, always together and in this order, so every rank names them alike
        whichever it uses first; again after the default process group was recreated."""
        if self._group is None or self._world is not dist.group.WORLD:
            self._world = dist.group.WORLD
            timeout = datetime.timedelta(seconds=self.timeout)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
            self._background = dist.new_group(backend="gloo", timeout=timeout)

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

    def agree(self, error: BaseException | None, what: str, payload: Any = None) -> list[Any]:
        """Exchange ``error`` (this rank's failure or ``None``) and ``payload`` with every rank.

        Returns every rank's payload when no rank failed; raises on every rank otherwise.
        Without an active multi-rank process group it raises ``error`` or returns ``[payload]``."""
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
            dist.all_gather_object(reports, mine, group=self.group)
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
        """Forget the groups (they are destroyed with the default process group)."""
        self._group = self._background = None


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
