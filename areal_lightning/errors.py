"""Every error areal-lightning raises on purpose, under one base class.

::

    AreaLightningError
    ├── ConfigError            (also a ValueError)   a setting is invalid; names the field and the allowed values
    │   └── ConfigTypeError    (also a TypeError)    ... a setting of the wrong type (where a TypeError was raised)
    ├── CheckpointCorruptError (also a RuntimeError) a checkpoint on disk is incomplete, altered or foreign
    ├── CheckpointWriteError   (also a RuntimeError) a save (or its background job) failed; names the path
    │   └── RankFailure                              another rank failed or did not arrive in time
    ├── RecoverMismatchError   (also a RuntimeError) the recover checkpoint belongs to a different run
    │                                                or does not fit this run's data or loaders
    ├── StorageError           (also a RuntimeError) an object store refused or failed an operation;
    │                                                names the bucket and the operation
    ├── TrialLockedError       (also a RuntimeError) another process is training the same trial
    ├── UsageError             (also a RuntimeError) a call at a time or place it cannot work
    ├── UnsupportedModelError  (also a TypeError)    a model (or a layer of it) this operation cannot handle
    ├── CheckpointNotFoundError (also a FileNotFoundError) no checkpoint at the path given
    ├── PathOccupiedError      (also a FileExistsError) something else is where a checkpoint would be written
    ├── IncompatibleVersionError (also a RuntimeError) the installed Lightning or torch lacks what this version uses
    └── InspectUsageError      (also a ValueError)   a path given to a command holds no trial (exit code 2)

``except AreaLightningError`` catches all of them; the second base keeps the built-in type
each one had before (``pytest.raises(ValueError)`` still matches a ``ConfigError``).
"""

from __future__ import annotations

__all__ = [
    "AreaLightningError",
    "ConfigError",
    "ConfigTypeError",
    "CheckpointCorruptError",
    "CheckpointWriteError",
    "RankFailure",
    "RecoverMismatchError",
    "StorageError",
    "TrialLockedError",
    "InspectUsageError",
    "UsageError",
    "UnsupportedModelError",
    "CheckpointNotFoundError",
    "PathOccupiedError",
    "IncompatibleVersionError",
    "start_fresh",
]


class AreaLightningError(Exception):
    """Base class of every error areal-lightning raises on purpose."""


class ConfigError(AreaLightningError, ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value of the wrong type (``map_location``, ``model_attr``): a
    :class:`ConfigError` that is also the ``TypeError`` these raised before."""


class CheckpointCorruptError(AreaLightningError, RuntimeError):
    """A checkpoint directory is incomplete, unreadable or not in this engine's format."""


class CheckpointWriteError(AreaLightningError, RuntimeError):
    """A checkpoint save (or background job) failed; the message names its path."""


class RankFailure(CheckpointWriteError):
    """Another rank failed, or did not arrive within ``collective_timeout``, at a checkpoint
    agreement; the message names the rank and its error, or the timeout."""


class RecoverMismatchError(AreaLightningError, RuntimeError):
    """The recover checkpoint was written by a run that differs from this one (world size,
    strategy, experiment, trial); the message explains what differs and what to do."""


class MemorySpaceError(AreaLightningError, OSError):
    """The memory tier's tmpfs has too little free space for its slots (the message gives the
    numbers: ranks on the node, slots, bytes per rank, replicas, and what is free)."""


class StorageError(AreaLightningError, RuntimeError):
    """An object store refused or failed an operation; names the bucket and the operation."""


class TrialLockedError(AreaLightningError, RuntimeError):
    """Another process holds the trial's lock: two runs must not write the same trial."""


class UsageError(AreaLightningError, RuntimeError):
    """A call made where it cannot work (``RecoverCallback.save`` outside ``fit``, a second save
    while one is in flight where only one may be); the message says where it belongs."""


class UnsupportedModelError(AreaLightningError, TypeError):
    """The model (or a layer of it) is of a kind this operation cannot handle; the message names
    the attribute, the type found and what is supported."""


class CheckpointNotFoundError(AreaLightningError, FileNotFoundError):
    """No checkpoint at the path given (a missing folder, a prefix with no committed generation)."""


class PathOccupiedError(AreaLightningError, FileExistsError):
    """A file, or a folder that is not a checkpoint, is where a checkpoint would be written; nothing
    was written or removed."""


class IncompatibleVersionError(AreaLightningError, RuntimeError):
    """The installed Lightning or torch lacks an attribute this version of areal-lightning relies
    on (each is pinned by a test); the message names it and what to do instead."""


class InspectUsageError(AreaLightningError, ValueError):
    """The path given to ``inspect`` (``convert``, ``download``) does not exist or holds no trial
    (exit code 2)."""


def start_fresh(info_dir: object = None, sentence: bool = False) -> str:
    """The remedy every resume error ends with: delete the trial's ``recover_info/`` (the
    checkpoint beside it is then not resumed, and the next save replaces it)."""
    text = f"delete {info_dir if info_dir is not None else 'recover_info/'} to start fresh"
    return text[0].upper() + text[1:] if sentence else text
