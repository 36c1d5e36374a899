"""Every path of the on-disk layout (SPEC §4), and parsing of export folder names.

::

    {fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}/
    ├── {name}/epoch{E}epochstep{S}globalstep{G}/   # HF exports (0-based E, S, G)
    ├── {name}/recover_checkpoint/                  # DCP recover checkpoint
    └── recover_info/                               # JSON metadata

Temporary folders are hidden siblings named ``.tmp-{final}-{token}``; folders being
deleted are first renamed to ``.trash-{final}-{token}``. Neither ever matches an export name.
Model names are single folder names; ``recover_info`` and names starting with ``.`` are
reserved (:data:`RESERVED_NAMES`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TrialLayout", "ExportName", "export_name", "parse_export_name"]

_EXPORT_RE = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
SHARED_CHECK_PREFIX = ".shared-check-"
"""A file rank 0 writes into the trial folder at setup (and removes) so that every rank
can prove it sees the same storage (:func:`areal_lightning.collective.check_shared_storage`)."""
RESERVED_NAMES = ("recover_info",)
COMMIT_MARKER = ".metadata"
"""The file whose presence marks a DCP directory as complete (DCP writes it last, atomically)."""


@dataclass(frozen=True, order=True)
class ExportName:
    """The 0-based indices in ``epoch{E}epochstep{S}globalstep{G}``; orders by global step."""

    global_step: int
    epoch: int
    epoch_step: int

    def __str__(self) -> str:
        return export_name(self.epoch, self.epoch_step, self.global_step)


def export_name(epoch: int, epoch_step: int, global_step: int) -> str:
    """``epoch{E}epochstep{S}globalstep{G}`` for 0-based indices (all must be >= 0)."""
    for label, v in (("epoch", epoch), ("epoch_step", epoch_step), ("global_step", global_step)):
        if v < 0:
            raise ValueError(f"{label} must be >= 0, got {v}")
    return f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"


def parse_export_name(name: str) -> ExportName | None:
    """Parse an export folder name; ``None`` for anything else (tmp, trash, user folders)."""
    m = _EXPORT_RE.match(name)
    if m is None:
        return None
    e, s, g = (int(x) for x in m.groups())
    return ExportName(global_step=g, epoch=e, epoch_step=s)


def tmp_sibling(final: Path, prefix: str = TMP_PREFIX) -> Path:
    """A unique hidden sibling of ``final`` for writing before the atomic rename."""
    return final.parent / f"{prefix}{final.name}-{uuid.uuid4().hex[:12]}"


def is_export_tmp_name(name: str) -> bool:
    """True for the temporary or trash sibling of an HF export (``.tmp-epoch…-token``).

    Only these are cleaned by the exporter: the recover checkpoint's own temporary folders
    (``.tmp-recover_checkpoint-…``) live in the same model folder and must not be touched.
    """
    for prefix in (TMP_PREFIX, TRASH_PREFIX):
        if name.startswith(prefix):
            final, sep, token = name[len(prefix):].rpartition("-")
            return bool(sep) and len(token) == 12 and parse_export_name(final) is not None
    return False


@dataclass(frozen=True)
class TrialLayout:
    """Paths of one trial: ``{fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}``.

    Example:
        >>> TrialLayout(Path("/r"), "u", "exp", "t").export_dir("default", 0, 99, 99).name
        'epoch0epochstep99globalstep99'
    """

    fileroot: Path
    user: str
    experiment_name: str
    trial_name: str

    @property
    def trial_dir(self) -> Path:
        """The trial folder."""
        return Path(self.fileroot) / "checkpoints" / self.user / self.experiment_name / self.trial_name

    def model_dir(self, name: str = "default") -> Path:
        """Folder of one model's exports (``default``, ``critic``, ...)."""
        return self.trial_dir / name

    def export_dir(self, name: str, epoch: int, epoch_step: int, global_step: int) -> Path:
        """Folder of one HF export."""
        return self.model_dir(name) / export_name(epoch, epoch_step, global_step)

    def recover_checkpoint_dir(self, name: str = "default") -> Path:
        """The DCP recover checkpoint of one model."""
        return self.model_dir(name) / "recover_checkpoint"

    @property
    def recover_info_dir(self) -> Path:
        """The ``recover_info/`` metadata folder."""
        return self.trial_dir / "recover_info"

    def list_exports(self, name: str = "default") -> list[tuple[ExportName, Path]]:
        """Completed exports of model ``name``, oldest first (by global step)."""
        root = self.model_dir(name)
        if not root.is_dir():
            return []
        found = []
        for child in root.iterdir():
            parsed = parse_export_name(child.name)
            if parsed is not None and child.is_dir():
                found.append((parsed, child))
        return sorted(found)
