"""Capture: what an HF export of a recover checkpoint needs besides the weights.

A recover checkpoint holds the LightningModule's state dict; ``areal-lightning convert --to hf``
makes the HF folder an ``HFSaverCallback`` would have written at that step from it. For that,
each save records, per ``PreTrainedModel`` of the module (which ones: the Lightning glue's
``hf_models_of`` in :mod:`areal_lightning.lightning.recover_state`), in
``checkpoint_info.json``'s ``hf_models``: the attribute, the model class, the state-dict prefix,
``max_shard_size``, and a folder ``{trial}/recover_hf/{digest}/`` with ``config.json``,
``generation_config.json`` and the tokenizer files. The folder is named by the digest of its
files, so it is written once per trial unless the config or the tokenizer change (and a
resumed run finds it written).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from areal_lightning.capture.compiled import plain_name

__all__ = ["HFModelEntry", "MODEL_FILE", "recorded_model", "is_pretrained", "state_prefix"]

MODEL_FILE = "areal_model.json"
"""In a ``recover_hf/{digest}/`` folder: the model class (and the fields an export needs)."""


@dataclass
class HFModelEntry:
    """One ``PreTrainedModel`` of the module: its export name, attribute and state-dict prefix."""

    name: str
    attr: str | None
    model: Any
    tokenizer: Any
    prefix: str
    max_shard_size: int | str


def is_pretrained(model: Any) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel``: that class is among its class's
    bases. Read from the bases, not by ``isinstance``, whose import of the class would load
    transformers' modeling code (half a second, at the first recover save of a run without an
    HF model)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.split(".")[0] == "transformers"
               for cls in type(model).__mro__)


def state_prefix(module: torch.nn.Module, model: Any) -> str | None:
    """The state-dict prefix of ``model`` inside ``module`` (``model.``), ``None`` if not inside."""
    for name, sub in module.named_modules():
        if sub is model:
            return plain_name(name) + "." if name else ""
    return None


def recorded_model(folder: Path) -> tuple[type, torch.dtype]:
    """The model class and parameter dtype recorded in ``folder`` (``areal_model.json``)."""
    import importlib

    recorded = json.loads((Path(folder) / MODEL_FILE).read_text())
    module, _, name = recorded["class"].rpartition(".")
    cls: Any = importlib.import_module(module)
    for part in name.split("."):
        cls = getattr(cls, part)
    return cls, getattr(torch, recorded["dtype"])
