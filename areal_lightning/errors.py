"""Errors of the checkpoint path that more than one stage raises."""

from __future__ import annotations

__all__ = ["CheckpointCorruptError", "CheckpointWriteError", "RankFailure"]


class CheckpointCorruptError(RuntimeError):
    """A checkpoint directory is incomplete, unreadable or not in this engine's format."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint save (or background job) failed; the message names its path."""


class RankFailure(CheckpointWriteError):
    """Another rank failed, or did not arrive within ``collective_timeout``, at a checkpoint
    agreement; the message names the rank and its error, or the timeout."""
