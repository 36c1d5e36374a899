"""Fault-injection points for the checkpoint path (testing and ``areal-lightning certify``).

Enabled only by the environment variable ``AREAL_LIGHTNING_FAULT``; otherwise each
:func:`fault_point` call is one dictionary lookup. The variable holds comma-separated
``point[:action][@N]`` entries:

- ``point`` is one of :data:`POINTS`, or ``*`` for every point;
- ``action`` is ``raise`` (default: raise :class:`InjectedFault`), ``kill`` (SIGKILL this
  process, as a power cut or the OOM killer would; from any thread, e.g. the background
  writer of an async save), ``hang`` (block this thread forever, as a stuck rank would) or
  ``trace`` (only record that the point was reached);
- ``@N`` fires at the N-th time this process reaches the point (default: every time).

When ``AREAL_LIGHTNING_FAULT_TRACE`` names a file, every ``trace`` hit and every ``raise``
or ``kill`` about to happen is appended to it as one tab-separated line
``point pid hit action`` (written and closed before the action, so a supervisor such as
``areal-lightning certify`` sees a kill line before or as the process dies). Points fire
in every process that reaches them (each process counts its own hits): under DDP, rank 0
alone writes ``recover_info/``, swaps the recover checkpoint and exports HF folders.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

from areal_lightning.errors import AreaLightningError, ConfigError

ENV_VAR = "AREAL_LIGHTNING_FAULT"
TRACE_ENV_VAR = "AREAL_LIGHTNING_FAULT_TRACE"

#: Every fault point of the package, in the order a save reaches them, with where it is.
POINTS: dict[str, str] = {
    # DCP write (write/dcp.py): recover checkpoints and DCPCheckpointIO saves
    "engine.before_staging": "DCPEngine.save: before the state is flattened and staged",
    "engine.after_staging": "DCP writer set up on this rank (async: in the background, host copy taken)",
    "engine.after_shard_file": "after each .distcp shard file is written and fsynced (writer threads; "
                               "async: background thread)",
    "engine.before_commit": "all shard files written, before DCP's .metadata (the commit marker)",
    "engine.after_commit": ".metadata renamed into place and the folder fsynced",
    # recover_info + swap (commit/recover_store.py), rank 0 only, after DCP returned
    "recover.info.after_file": "after each JSON file of the new recover_info is durable (6 per save)",
    "recover.info.before_checkpoint_info": "new recover_info written except checkpoint_info.json",
    "commit.json.before_replace": "a JSON temp file is fsynced, before its rename over the final name",
    "recover.swap.begin": "new checkpoint + recover_info complete beside the old ones, before the first rename",
    "recover.swap.old_checkpoint_moved": "old recover_checkpoint/ renamed aside",
    "recover.swap.new_checkpoint_in_place": "new recover_checkpoint/ renamed into place",
    "recover.swap.old_info_moved": "old recover_info/ renamed aside",
    "recover.swap.new_info_in_place": "new recover_info/ renamed into place (the old pair not yet deleted)",
    # HF export (write/hf.py, hf_export.py, commit/retention.py) and the atomic-directory commit (commit/atomic.py),
    # rank 0 only
    "hf.after_weights": "safetensors + config written into the .tmp- folder",
    "hf.before_publish": "tokenizer written, before the folder is published",
    "commit.before_rename": "AtomicDir.finalize (HF exports, DCPCheckpointIO saves): .tmp- folder durable, "
                             "before its rename to the final name",
    "commit.publish.old_removed": "AtomicDir.finalize: an existing folder of that name (a re-export after a "
                                  "resume, an overwritten checkpoint) was moved aside to .old-, before the rename",
    "commit.after_rename": "AtomicDir.finalize: renamed to the final name and the parent fsynced",
    "hf.prune": "max_keep: before an old export is deleted",
    "commit.remove_dir.begin": "remove_dir: before the folder is renamed to .trash-",
    "commit.remove_renamed": "remove_dir: renamed to .trash-, before the trash is deleted",
    "commit.remove_dir.done": "remove_dir: the trash folder is deleted",
    # the memory tier (write/slot.py, commit/memory_tier.py): every rank, at its memory-tier steps
    "memory.mid_copy": "half of the rank's tensors copied into the slot's mapped file (training thread)",
    "memory.before_metadata": "the slot's tensors copied and checksummed and its skeleton written, before its "
                              ".metadata (the seal's background thread, during the next step; the training "
                              "thread for sharded states, which DCP plans)",
    "memory.before_seal": "the slot's .metadata written, before SEALED.json (the seal's background thread; the "
                          "training thread for sharded states)",
    "memory.after_seal": "SEALED.json renamed into place: the slot holds the step (the seal's background thread; "
                         "the training thread for sharded states)",
    "memory.mid_replica": "a peer copy: this rank's slot sent to its peer on the next node, before the copy it "
                          "received is written (background thread)",
    "memory.mid_persist": "a shared-tier save from the memory tier: this rank's data file copied from its slot, "
                          "before every rank agrees and rank 0 writes .metadata and commits (background thread)",
    # object stores (write/objectstore_fs.py): a DCP file's multipart upload is under way (every rank)
    "objectstore.mid_upload": "the first part of a data file's multipart upload is sent; the object is not "
                              "complete (writer threads; async: background thread)",
    # object stores (commit/generations.py): a generation is committed by its marker object, rank 0 only
    "objectstore.before_marker": "every file of a generation uploaded (DCP data, .metadata, recover_info), "
                                 "before its COMMITTED.json marker",
    "objectstore.after_marker": "the marker of the new generation written (the older ones not yet deleted)",
    "objectstore.marker_deleted": "an older generation's marker deleted, before its files are",
}

_hits: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


class InjectedFault(AreaLightningError, RuntimeError):
    """Raised at a fault point named in ``AREAL_LIGHTNING_FAULT`` with action ``raise``."""


def fault_enabled() -> bool:
    """True when ``AREAL_LIGHTNING_FAULT`` is set (for code that would do extra work per point)."""
    return bool(os.environ.get(ENV_VAR))


def _trace(name: str, hit: int, action: str) -> None:
    path = os.environ.get(TRACE_ENV_VAR)
    if not path:
        return
    line = f"{name}\t{os.getpid()}\t{hit}\t{action}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write on an O_APPEND file: lines of several processes do not mix
    finally:
        os.close(fd)


def fault_point(name: str) -> None:
    """Fail here if ``AREAL_LIGHTNING_FAULT`` names this point; do nothing otherwise."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    with _lock:  # writer threads of one save reach the same point concurrently
        _hits[name] += 1
        hit = _hits[name]
    for entry in spec.split(","):
        entry, _, nth = entry.strip().partition("@")
        point, _, action = entry.partition(":")
        if point not in (name, "*") or (nth and hit != int(nth)):
            continue
        if action == "trace":
            _trace(name, hit, "trace")
            continue
        if action in ("", "raise"):
            _trace(name, hit, "raise")
            raise InjectedFault(f"fault injected at {name!r} ({ENV_VAR}={spec!r})")
        if action == "kill":
            _trace(name, hit, "kill")
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "hang":
            _trace(name, hit, "hang")
            while True:  # a stuck rank (hung storage, a deadlock): only a signal ends it
                time.sleep(60)
        raise ConfigError(ENV_VAR, f"unknown action {action!r} for point {name!r}; allowed: raise, kill, hang, trace")


def reset_fault_counts() -> None:
    """Forget how often each point was reached (for in-process tests using ``@N``)."""
    with _lock:
        _hits.clear()
