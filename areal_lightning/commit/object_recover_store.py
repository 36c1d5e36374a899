"""The recover checkpoint of a trial on an object store (``fileroot: s3://...``).

The same contract as :class:`~areal_lightning.commit.recover_store.RecoverStore`, committed
with the marker strategy of :mod:`areal_lightning.commit.generations` (object stores have
no rename)::

    {trial}/{name}/recover_checkpoint/{gen}/   # DCP files of save gen (every rank's shard)
    {trial}/recover_info/{gen}/*.json          # its recover_info, written by rank 0
    {trial}/recover_info/{gen}/COMMITTED.json  # written last: save gen exists from here on

``gen`` is ``{global_step}-{random}``, never reused. A save writes its DCP files, then rank 0
(after DCP returned, in the background for async saves) checks that DCP's ``.metadata`` is
there, uploads the ``recover_info`` files and creates the marker (conditional create, never
overwritten). The newest committed generation is the checkpoint; once the new marker is
there the older generations are deleted (marker first), together with every uncommitted
generation and the incomplete multipart uploads under the two prefixes. A SIGKILL or a
failed upload at any instant leaves the previous committed generation the newest.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

from areal_lightning.commit.generations import Generations, check_written
from areal_lightning.commit.lease import ObjectLease
from areal_lightning.commit.manifest import check_files
from areal_lightning.commit.recover_store import RecoverCommit, RecoverStore, check_info
from areal_lightning.errors import CheckpointCorruptError, start_fresh
from areal_lightning.layout import CHECKPOINT_INFO, INFO_FILES, TrialLayout
from areal_lightning.objectstore import probe, retries, strip
from areal_lightning.write.checksum import ALGORITHM, Written

__all__ = ["ObjectRecoverStore", "ObjectRecoverCommit"]

log = logging.getLogger(__name__)


class ObjectRecoverStore:
    """Paths, commit, cleanup and validation of a trial's recover checkpoint on an object store
    (a :class:`~areal_lightning.commit.recover_store.RecoverStorage`)."""

    claim_label = "object-store check"

    def __init__(self, layout: TrialLayout, name: str = "default",
                 storage_options: Mapping[str, Any] | None = None, lease_s: float = 60.0) -> None:
        self.layout = layout
        self.lease_s = lease_s
        self._lease: ObjectLease | None = None
        self.storage_options = dict(storage_options or {})
        self.ckpt_dir: str = layout.recover_checkpoint_dir(name)
        self.info_dir: str = layout.recover_info_dir
        self.data = Generations(self.ckpt_dir, self.storage_options)
        self.infos = Generations(self.info_dir, self.storage_options)
        self._current: str | None = None  # the generation read_info described

    # -- the trial ----------------------------------------------------------------------

    def claim(self, rank: int) -> None:
        """Every rank can write, read and delete under the trial prefix."""
        probe(self.layout.trial_dir, self.storage_options, rank)

    def check_shared(self, ranks: Any, lead: bool) -> None:
        """Collective, once every rank's access is checked (a bucket is shared by construction):
        rank 0 takes the trial's lease (:class:`~areal_lightning.commit.lease.ObjectLease`: a
        second live run is refused, a crashed run's rerun waits at most one lease); its failure
        is raised on every rank."""
        error: BaseException | None = None
        if lead:
            try:
                self._lease = ObjectLease(self.layout.trial_dir, self.storage_options, self.lease_s)
                self._lease.acquire()
            except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
                error = exc
        ranks.agree(error, "RecoverCallback setup (trial lease)")

    def release(self) -> None:
        """Give the trial's lease back (idempotent)."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def new_generation(self, global_step: int) -> str:
        """A unique name for one save (rank 0); refused if this run lost the trial's lease."""
        if self._lease is not None:
            self._lease.check()
        return RecoverStore.new_generation(global_step)

    def retries(self) -> int | None:
        """Requests retried so far in this process."""
        return retries()

    def record_hf_models(self, entries: Any) -> dict[str, Any] | None:
        """Not recorded on object stores (``convert --to hf`` reads a downloaded trial)."""
        return None

    def tmp_ckpt_dir(self, gen: str) -> str:
        """Where the DCP files of save ``gen`` are written (its generation's prefix)."""
        return self.data.uri(gen)

    # -- writing ---------------------------------------------------------------------------

    def target(self, gen: str, info: dict[str, dict[str, Any]],
               on_committed: Callable[[Written], None] | None = None) -> "ObjectRecoverCommit":
        """The commit target of save ``gen``: DCP writes into ``recover_checkpoint/{gen}/``."""
        return ObjectRecoverCommit(self, gen, info, on_committed)

    def clean_stale(self) -> None:
        """Nothing before a save: what interrupted saves left is removed after each commit."""

    def commit(self, gen: str, info: dict[str, dict[str, Any]], files: dict[str, dict[str, int]]) -> None:
        """Publish save ``gen`` (rank 0, after DCP returned): its ``recover_info``, then its
        marker, then the cleanup of everything else under the two prefixes."""
        check_written(self.data, gen)
        checkpoint_info = dict(info[CHECKPOINT_INFO])
        checkpoint_info.update(generation=gen, checksum=ALGORITHM, files=files)
        fs = self.infos.fs
        for name in INFO_FILES:
            content = checkpoint_info if name == CHECKPOINT_INFO else info[name]
            fs.pipe_file(strip(fs, self.infos.uri(gen, name)),
                         (json.dumps(content, indent=2, sort_keys=True) + "\n").encode())
        self.infos.commit(gen, {"global_step": checkpoint_info.get("global_step")})
        self.infos.clean({gen})
        self.data.clean({gen})

    # -- reading ---------------------------------------------------------------------------

    def repair(self) -> str | None:
        """Nothing to repair: a generation is committed by one object or not at all."""
        return None

    def exists(self) -> bool:
        """True when a committed generation exists (a recover checkpoint is expected)."""
        return self.infos.newest() is not None

    def info_deleted(self) -> bool:
        """A committed generation of the checkpoint's data without a committed ``recover_info``:
        the user deleted it."""
        return self.infos.newest() is None and self.data.newest() is not None

    def read_info(self) -> dict[str, dict[str, Any]]:
        """The ``recover_info`` of the newest committed generation, validated."""
        newest = self.infos.newest()
        if newest is None:
            raise CheckpointCorruptError(f"{self.info_dir} holds no committed generation")
        gen, marker = newest
        fs = self.infos.fs
        info: dict[str, dict[str, Any]] = {}
        for name in INFO_FILES:
            uri = self.infos.uri(gen, name)
            try:
                data = json.loads(fs.cat_file(strip(fs, uri)))
            except FileNotFoundError:
                raise CheckpointCorruptError(f"{uri} is missing from the committed generation {gen}; "
                                             f"{start_fresh(self.info_dir)}.") from None
            except ValueError as exc:
                raise CheckpointCorruptError(f"{uri} is not valid JSON ({exc}); {start_fresh(self.info_dir)}.") \
                    from exc
            if not isinstance(data, dict):
                raise CheckpointCorruptError(f"{uri} holds {type(data).__name__}, expected a JSON object; "
                                             f"{start_fresh(self.info_dir)}.")
            info[name] = data
        info[CHECKPOINT_INFO].setdefault("commit_time", marker.get("commit_time"))
        self._current = gen
        return check_info(info, self.infos.uri(gen))

    def info_file(self, name: str) -> str:
        """Where the ``recover_info`` file ``name`` of the checkpoint read last is."""
        return self.infos.uri(self._current or "?", name)

    def checkpoint_path(self) -> str:
        """The DCP prefix of the checkpoint :meth:`read_info` described."""
        if self._current is None:
            self.read_info()
        return self.data.uri(self._current)

    def verify(self, checkpoint_info: dict[str, Any], data: bool | None = True) -> int:
        """Check the checkpoint's objects against ``checkpoint_info`` (presence, sizes,
        ``.metadata``'s CRC32C; with ``data=True`` every item's CRC32C); return bytes read."""
        gen = checkpoint_info.get("generation") or self._current
        hint = f"the recover checkpoint is damaged; restore the object or {start_fresh(self.info_dir)}"
        return check_files(self.data.uri(gen), checkpoint_info["files"], self.infos.uri(gen, CHECKPOINT_INFO), hint,
                           data=bool(data), storage_options=self.storage_options)


class ObjectRecoverCommit(RecoverCommit):
    """The :class:`~areal_lightning.commit.atomic.CommitTarget` of one recover save on an
    object store: DCP writes into :attr:`tmp` (``recover_checkpoint/{gen}/``); :meth:`finalize`
    is :meth:`ObjectRecoverStore.commit` (``recover_info``, then the marker)."""

    def create(self) -> str:  # type: ignore[override]
        """Nothing to create on an object store."""
        return self.tmp
