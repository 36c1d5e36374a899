"""Every path of the on-disk layout (SPEC §4), and parsing of export folder names.

::

    {fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}/
    ├── {name}/epoch{E}epochstep{S}globalstep{G}/   # HF exports (0-based E, S, G)
    ├── {name}/recover_checkpoint/                  # DCP recover checkpoint
    └── recover_info/                               # JSON metadata

Temporary folders are hidden siblings named ``.tmp-{final}-{token}``; a folder being
replaced is first renamed to ``.old-{final}-{token}``, one being deleted to
``.trash-{final}-{token}``. Neither ever matches an export name.
Model names are single folder names; ``recover_info`` and names starting with ``.`` are
reserved (:data:`RESERVED_NAMES`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_lightning.errors import ConfigError
from areal_lightning.objectstore import is_remote, join

__all__ = ["TrialLayout", "ExportName", "export_name", "parse_export_name", "child"]

_EXPORT_RE = re.compile(r"^epoch(\d+)epochstep(\d+)globalstep(\d+)$")


def child(base: Any, *parts: str) -> Any:
    """``base`` joined with ``parts``: a ``Path`` for a local base, a ``str`` URI for an
    object-store one (``Path`` would fold its ``//``)."""
    if is_remote(base):
        return join(str(base), *parts)
    return Path(base).joinpath(*parts)


# -- names of the trial folder -----------------------------------------------------------
RECOVER_CHECKPOINT = "recover_checkpoint"
"""``{name}/recover_checkpoint/``: the DCP directory of the last committed recover checkpoint."""
RECOVER_INFO = "recover_info"
"""``recover_info/``: the JSON metadata describing exactly that checkpoint."""
STEP_INFO = "step_info.json"
SAVER_INFO = "saver_info.json"
EVALUATOR_INFO = "evaluator_info.json"
STATS_LOGGER_INFO = "stats_logger_info.json"
DATALOADER_INFO = "dataloader_info.json"
CHECKPOINT_INFO = "checkpoint_info.json"
"""Written last into a new ``recover_info``: its presence marks that folder complete."""
INFO_FILES = (STEP_INFO, SAVER_INFO, EVALUATOR_INFO, STATS_LOGGER_INFO, DATALOADER_INFO, CHECKPOINT_INFO)
"""The files of ``recover_info/``, in the order they are written."""
LOCK_FILE = ".lock"
"""``{trial}/.lock``: the ``flock`` of the run writing the trial (holds its pid)."""
RECOVER_HF = "recover_hf"
"""``recover_hf/{digest}/``: config and tokenizer files of the module's HF models, for ``convert``."""
RESERVED_NAMES = (RECOVER_INFO, RECOVER_HF)

# -- names of the atomic-directory protocol (commit/atomic.py) ---------------------------
TMP_PREFIX = ".tmp-"
"""``.tmp-{final}-{token}``: a folder (or file) being written, renamed to ``{final}`` once complete."""
OLD_PREFIX = ".old-"
"""``.old-{final}-{token}``: the folder ``{final}`` held before the commit of ``token`` replaced it."""
TRASH_PREFIX = ".trash-"
"""``.trash-{final}-{token}``: a folder being deleted (renamed away first)."""
LEFTOVER_PREFIXES = (TMP_PREFIX, OLD_PREFIX, TRASH_PREFIX)
SHARED_CHECK_PREFIX = ".shared-check-"
"""A file rank 0 writes into the trial folder at setup (and removes) so that every rank
can prove it sees the same storage (:func:`areal_lightning.collective.check_shared_storage`)."""

# -- names inside checkpoint folders -----------------------------------------------------
COMMIT_MARKER = ".metadata"
"""The file whose presence marks a DCP directory as complete (DCP writes it last, atomically)."""

# -- the memory tier (a node-local tmpfs folder per trial) ---------------------------------
MEMORY_SEAL = "SEALED.json"
"""In a memory-tier slot (``{tier}/rank{r}/slot{k}/``, a rank-local DCP checkpoint): written
last, after ``.metadata``; the slot holds a complete state only while it exists."""


def memory_slot(tier: Path, rank: int, slot: int) -> Path:
    """The folder of one slot of one rank in the memory tier folder ``tier``."""
    return tier / f"rank{rank}" / f"slot{slot}"

HF_METADATA_TMP = ".hf-metadata"
"""Inside an export's temporary folder: where ``save_pretrained`` writes config files first."""
HF_DCP_SHARDS = "sharded"
"""Inside an export's temporary folder: the per-rank shards of a ``sharded_method="dcp"`` export."""
HF_WEIGHTS = "model.safetensors"
"""The weights file of an unsharded HF export (``save_pretrained``'s name)."""
HF_INDEX = "model.safetensors.index.json"
"""The index of a sharded HF export (``save_pretrained``'s name)."""


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
            raise ConfigError(label, f"must be >= 0, got {v}")
    return f"epoch{epoch}epochstep{epoch_step}globalstep{global_step}"


def parse_export_name(name: str) -> ExportName | None:
    """Parse an export folder name; ``None`` for anything else (tmp, trash, user folders)."""
    m = _EXPORT_RE.match(name)
    if m is None:
        return None
    e, s, g = (int(x) for x in m.groups())
    return ExportName(global_step=g, epoch=e, epoch_step=s)


def new_token() -> str:
    """A fresh token naming one commit's temporary folders."""
    return uuid.uuid4().hex[:12]


def sibling(final: Path, prefix: str, token: str) -> Path:
    """The hidden sibling ``{prefix}{final.name}-{token}`` of ``final``."""
    return final.parent / f"{prefix}{final.name}-{token}"


def tmp_sibling(final: Path, prefix: str = TMP_PREFIX) -> Path:
    """A unique hidden sibling of ``final`` for writing before the atomic rename."""
    return sibling(final, prefix, new_token())


def leftover_of(name: str) -> tuple[str, str, str] | None:
    """``(prefix, final name, token)`` of a temporary / old / trash sibling's name, else ``None``."""
    for prefix in LEFTOVER_PREFIXES:
        if name.startswith(prefix):
            final, sep, token = name[len(prefix):].rpartition("-")
            if sep and final and token:
                return prefix, final, token
    return None


def is_export_tmp_name(name: str) -> bool:
    """True for the temporary or trash sibling of an HF export (``.tmp-epoch…-token``).

    Only these are cleaned by the exporter: the recover checkpoint's own temporary folders
    (``.tmp-recover_checkpoint-…``) live in the same model folder and must not be touched.
    """
    parts = leftover_of(name)
    return parts is not None and len(parts[2]) == 12 and parse_export_name(parts[1]) is not None


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
    def remote(self) -> bool:
        """The fileroot is an object-store URI: every path of this layout is then a ``str`` URI."""
        return is_remote(self.fileroot)

    @property
    def trial_dir(self) -> Path:
        """The trial folder (a ``str`` URI when the fileroot is one)."""
        return child(self.fileroot, "checkpoints", self.user, self.experiment_name, self.trial_name)

    def model_dir(self, name: str = "default") -> Path:
        """Folder of one model's exports (``default``, ``critic``, ...)."""
        return child(self.trial_dir, name)

    def export_dir(self, name: str, epoch: int, epoch_step: int, global_step: int) -> Path:
        """Folder of one HF export."""
        return child(self.model_dir(name), export_name(epoch, epoch_step, global_step))

    def recover_checkpoint_dir(self, name: str = "default") -> Path:
        """The DCP recover checkpoint of one model."""
        return child(self.model_dir(name), RECOVER_CHECKPOINT)

    @property
    def recover_info_dir(self) -> Path:
        """The ``recover_info/`` metadata folder."""
        return child(self.trial_dir, RECOVER_INFO)

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
