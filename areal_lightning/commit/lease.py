"""Commit: the trial lock on an object store, a lease.

A bucket has no ``flock`` and no process death to release one, so a run holds its trial by a
lease object it renews::

    {trial}/.lease/{n:010d}.json   # {"holder", "token", "renewed" (epoch seconds), "lease_s"}

The holder is the newest ``n``. A run takes the trial by creating ``n + 1`` with the store's
conditional create (only one of two racing runs can); while it trains, a background thread
rewrites its object every third of the lease. At a normal end the object is deleted. A run that
finds a lease not yet expired waits, watching it: renewed meanwhile, its holder is alive and
the run is refused (:class:`~areal_lightning.errors.TrialLockedError` naming the holder); not
renewed until it expires, its holder is gone (SIGKILL, a lost node) and the run takes over. So
a second run is refused within a third of the lease, and a restart after a crash starts
within one lease. Times are the runs' wall clocks (``time.time()``): the nodes' clocks must
agree to well within the lease (NTP does).

A holder that could not renew for a whole lease (a paused process) may have lost the trial to
another run: :meth:`ObjectLease.check` raises before it writes again.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from areal_lightning.errors import TrialLockedError
from areal_lightning.objectstore import filesystem, join, strip, write_exclusive

__all__ = ["ObjectLease", "LEASE_DIR"]

log = logging.getLogger(__name__)

LEASE_DIR = ".lease"


class ObjectLease:
    """The lease of the trial prefix ``trial`` (see the module doc); ``lease_s`` seconds."""

    def __init__(self, trial: str, storage_options: Mapping[str, Any] | None, lease_s: float) -> None:
        self.trial = trial
        self.prefix = join(trial, LEASE_DIR)
        self.storage_options = dict(storage_options or {})
        self.lease_s = float(lease_s)
        self.token = uuid.uuid4().hex
        self.holder = f"{socket.gethostname()} pid {os.getpid()}"
        self.number: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost: str | None = None

    def _fs(self) -> Any:
        return filesystem(self.prefix, self.storage_options)

    def _uri(self, n: int) -> str:
        return join(self.prefix, f"{n:010d}.json")

    def _newest(self) -> tuple[int, dict[str, Any] | None]:
        """``(n, lease)`` of the newest lease object (``(0, None)``: none)."""
        fs = self._fs()
        fs.invalidate_cache(strip(fs, self.prefix))
        try:
            names = [p.rsplit("/", 1)[-1] for p in fs.ls(strip(fs, self.prefix), detail=False)]
        except FileNotFoundError:
            names = []
        numbers = sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())
        for n in reversed(numbers):
            try:
                return n, json.loads(fs.cat_file(strip(fs, self._uri(n))))
            except FileNotFoundError:  # released (deleted) meanwhile: the next older one
                continue
            except ValueError:  # unreadable: counts as expired
                return n, {"renewed": 0.0, "lease_s": 0.0, "holder": "?"}
        return (numbers[-1] if numbers else 0), None

    def _write(self, n: int, create: bool) -> None:
        body = json.dumps({"holder": self.holder, "token": self.token, "renewed": time.time(),
                           "lease_s": self.lease_s}).encode()
        if create:
            write_exclusive(self._uri(n), body, self.storage_options)
        else:
            fs = self._fs()
            fs.pipe_file(strip(fs, self._uri(n)), body)

    def acquire(self) -> None:
        """Take the trial, waiting at most one lease for a silent holder; raise
        :class:`TrialLockedError` if the holder renews meanwhile (it is alive)."""
        seen: tuple[int, float] | None = None
        told = False
        while True:
            n, lease = self._newest()
            now = time.time()
            expired = lease is None or now > float(lease.get("renewed", 0)) + float(lease.get("lease_s", 0))
            if expired:
                try:
                    self._write(n + 1, create=True)
                except FileExistsError:  # another run took it first: look again
                    continue
                self.number = n + 1
                self._cleanup(n + 1)
                self._thread = threading.Thread(target=self._renew, name="areal-trial-lease", daemon=True)
                self._thread.start()
                if lease is not None:  # a run that ended without releasing it (killed, its node lost)
                    log.info("RecoverCallback: %s: took over the expired lease of %s", self.prefix, lease_holder(lease))
                return
            mark = (n, float(lease.get("renewed", 0)))  # type: ignore[union-attr]
            if seen is not None and mark != seen:
                raise TrialLockedError(
                    f"{self.trial} is being trained by another run ({lease_holder(lease)}, which "
                    f"renews its lease every {float(lease.get('lease_s', 0)) / 3:.0f}s); two runs must not write the "  # type: ignore[union-attr]
                    "same trial. Stop the other run or use another trial_name.")
            seen = mark
            left = float(lease.get("renewed", 0)) + float(lease.get("lease_s", 0)) - now  # type: ignore[union-attr]
            if not told:
                log.warning("RecoverCallback: %s is held by %s: waiting up to %.0fs for its lease to expire (a "
                            "crashed run's) or to be renewed (a live run's: then this run stops)",
                            self.trial, lease_holder(lease), left)
                told = True
            time.sleep(max(0.05, min(left + 0.05, self.lease_s / 6)))

    def _cleanup(self, mine: int) -> None:
        """Delete the older lease objects (best effort)."""
        fs = self._fs()
        try:
            names = fs.ls(strip(fs, self.prefix), detail=False)
        except FileNotFoundError:
            return
        for path in names:
            name = path.rsplit("/", 1)[-1]
            if name.endswith(".json") and name[:-5].isdigit() and int(name[:-5]) < mine:
                try:
                    fs.rm_file(path)
                except (FileNotFoundError, OSError):
                    pass

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                if not self.renew():
                    return
            except Exception as exc:  # noqa: BLE001 - a failed renewal is retried; an expired one is checked
                log.warning("RecoverCallback: %s: renewing the trial lease failed (%r); retrying", self.prefix, exc)

    def renew(self) -> bool:
        """Rewrite this run's lease object now; ``False`` (and :meth:`check` raises from then on)
        when another run took the trial over."""
        assert self.number is not None
        n, lease = self._newest()
        if n != self.number or lease is None or lease.get("token") != self.token:
            self._lost = f"the lease was taken over by {lease_holder(lease)}"
            log.error("RecoverCallback: %s: %s; this run no longer holds the trial", self.prefix, self._lost)
            return False
        self._write(self.number, create=False)
        return True

    def check(self) -> None:
        """Raise :class:`TrialLockedError` if this run lost the trial (see the module doc)."""
        if self._lost is not None:
            raise TrialLockedError(f"{self.trial}: {self._lost} (this run could not renew its "
                                   f"lease for {self.lease_s:.0f}s); it stops writing the trial")

    def release(self) -> None:
        """Stop renewing and delete the lease object (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.lease_s)
            self._thread = None
        if self.number is not None and self._lost is None:
            try:
                fs = self._fs()
                fs.rm_file(strip(fs, self._uri(self.number)))
            except Exception as exc:  # noqa: BLE001 - it expires by itself
                log.warning("RecoverCallback: %s: could not delete the trial lease (%r); it expires in %.0fs",
                            self.prefix, exc, self.lease_s)
        self.number = None


def lease_holder(lease: Mapping[str, Any] | None) -> str:
    """Who holds ``lease``, for messages."""
    return str(lease.get("holder", "?")) if lease else "nobody"
