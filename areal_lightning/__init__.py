"""areal-lightning: the checkpoint system of a distributed RL/LLM trainer, for PyTorch Lightning.

- :class:`HFSaverCallback` exports HuggingFace checkpoints on epoch / step / seconds triggers.
- :class:`RecoverCallback` saves the full training state and resumes a restarted run exactly.
- :class:`DCPCheckpointIO` is a Lightning ``CheckpointIO`` writing sharded
  ``torch.distributed.checkpoint`` directories, synchronously or asynchronously.
- :class:`AreaLightningError` is the base of every error raised on purpose
  (:class:`ConfigError`, :class:`CheckpointCorruptError`, :class:`CheckpointWriteError`,
  :class:`RankFailure`, :class:`RecoverMismatchError`, :class:`StorageError`, :class:`TrialLockedError`,
  :class:`UsageError`, :class:`UnsupportedModelError`, :class:`CheckpointNotFoundError`,
  :class:`PathOccupiedError`, :class:`IncompatibleVersionError`, :class:`InspectUsageError`,
  :class:`MemorySpaceError`; see
  :mod:`areal_lightning.errors`).
- :class:`SaverConfig`, :class:`RecoverConfig` (its :class:`MemoryConfig`), :class:`ExperimentConfig` and
  :func:`load_config` read and validate Hydra-style YAML configs;
  :func:`callbacks_from_config` builds the enabled callbacks from one.
- :func:`convert` writes a recover checkpoint as an HF folder or one Lightning checkpoint file.

Names are imported lazily, so ``areal-lightning run`` starts without importing Lightning.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from areal_lightning.version import __version__

# Like Lightning does for its own logger: show our INFO lines (saves, resumes) unless the
# application configured logging itself.
_logger = logging.getLogger(__name__)
if not _logger.handlers and not logging.getLogger().handlers:
    _logger.setLevel(logging.INFO)
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

_EXPORTS = {
    "HFSaverCallback": "areal_lightning.lightning",
    "RecoverCallback": "areal_lightning.lightning",
    "StepInfo": "areal_lightning.trigger.step",
    "callbacks_from_config": "areal_lightning.lightning",
    "DCPCheckpointIO": "areal_lightning.lightning.checkpoint_io",
    "StagingWaitCallback": "areal_lightning.lightning.checkpoint_io",
    "ConfigError": "areal_lightning.errors",
    "ConfigTypeError": "areal_lightning.errors",
    "ExperimentConfig": "areal_lightning.config",
    "RecoverConfig": "areal_lightning.config",
    "MemoryConfig": "areal_lightning.config",
    "SaverConfig": "areal_lightning.config",
    "load_config": "areal_lightning.config",
    "FreqController": "areal_lightning.trigger.freq",
    "TrialLayout": "areal_lightning.layout",
    "export_name": "areal_lightning.layout",
    "parse_export_name": "areal_lightning.layout",
    "CheckpointCorruptError": "areal_lightning.errors",
    "CheckpointWriteError": "areal_lightning.errors",
    "RankFailure": "areal_lightning.errors",
    "RecoverMismatchError": "areal_lightning.errors",
    "TrialLockedError": "areal_lightning.errors",
    "StorageError": "areal_lightning.errors",
    "UsageError": "areal_lightning.errors",
    "UnsupportedModelError": "areal_lightning.errors",
    "CheckpointNotFoundError": "areal_lightning.errors",
    "PathOccupiedError": "areal_lightning.errors",
    "IncompatibleVersionError": "areal_lightning.errors",
    "InspectUsageError": "areal_lightning.errors",
    "MemorySpaceError": "areal_lightning.errors",
    "download_export": "areal_lightning.tools.download",
    "convert": "areal_lightning.tools.convert",
    "AreaLightningError": "areal_lightning.errors",
    "Preempted": "areal_lightning.trigger.preempt",
    "PREEMPTED_EXIT_CODE": "areal_lightning.trigger.preempt",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from areal_lightning.config import (
        ExperimentConfig,
        MemoryConfig,
        RecoverConfig,
        SaverConfig,
        load_config,
    )
    from areal_lightning.errors import (
        AreaLightningError,
        CheckpointCorruptError,
        CheckpointNotFoundError,
        CheckpointWriteError,
        ConfigError,
        ConfigTypeError,
        IncompatibleVersionError,
        InspectUsageError,
        MemorySpaceError,
        PathOccupiedError,
        RankFailure,
        RecoverMismatchError,
        StorageError,
        TrialLockedError,
        UnsupportedModelError,
        UsageError,
    )
    from areal_lightning.layout import TrialLayout, export_name, parse_export_name
    from areal_lightning.lightning import (
        HFSaverCallback,
        RecoverCallback,
        callbacks_from_config,
    )
    from areal_lightning.lightning.checkpoint_io import (
        DCPCheckpointIO,
        StagingWaitCallback,
    )
    from areal_lightning.trigger.freq import FreqController
    from areal_lightning.trigger.preempt import PREEMPTED_EXIT_CODE, Preempted
    from areal_lightning.tools.convert import convert
    from areal_lightning.tools.download import download_export
    from areal_lightning.trigger.step import StepInfo
