"""areal-lightning: the checkpoint system of a distributed RL/LLM trainer, for PyTorch Lightning.

- :class:`HFSaverCallback` exports HuggingFace checkpoints on epoch / step / seconds triggers.
- :class:`SaverConfig`, :class:`RecoverConfig`, :class:`ExperimentConfig` and
  :func:`load_config` read and validate Hydra-style YAML configs;
  :func:`callbacks_from_config` builds the enabled callbacks from one.
"""

from areal_lightning.callbacks import HFSaverCallback, callbacks_from_config
from areal_lightning.config import ConfigError, ExperimentConfig, RecoverConfig, SaverConfig, load_config
from areal_lightning.freq import FreqController
from areal_lightning.layout import TrialLayout, export_name, parse_export_name

__version__ = "0.1.0"

__all__ = [
    "HFSaverCallback",
    "callbacks_from_config",
    "ConfigError",
    "ExperimentConfig",
    "RecoverConfig",
    "SaverConfig",
    "load_config",
    "FreqController",
    "TrialLayout",
    "export_name",
    "parse_export_name",
    "__version__",
]
