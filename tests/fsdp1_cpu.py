"""Test-only helper: Lightning's ``FSDPStrategy`` (torch FSDP1) on CPU / gloo.

Lightning refuses ``strategy="fsdp"`` with ``accelerator="cpu"`` only for the exact type
``FSDPStrategy``; torch FSDP1 itself trains on CPU when given ``device_id=cpu``. This
subclass passes that ``device_id``, so the real FSDP1 code paths (flat parameters,
``ShardedTensor`` sharded state dicts, FSDP1 optimizer state, state-dict collectives) run in
CI. Not part of the public API: on GPUs users write ``strategy="fsdp"``.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

# The namespace of the script's Trainer ($AREAL_NAMESPACE: lightning.pytorch or pytorch_lightning).
_fsdp = importlib.import_module(os.environ.get("AREAL_NAMESPACE", "lightning.pytorch") + ".strategies.fsdp")
FSDPStrategy = _fsdp.FSDPStrategy
_setup_activation_checkpointing = _fsdp._setup_activation_checkpointing


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` whose FSDP1 wrapper runs on CPU (``device_id=torch.device("cpu")``)."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = FullyShardedDataParallel(
            module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs,
        )
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model
