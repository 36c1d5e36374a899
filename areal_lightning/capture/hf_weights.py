"""Capture: the HF export weights of a ``PreTrainedModel`` under any strategy.

* :func:`export_state_dict`: the keys ``save_pretrained`` writes (tied aliases removed).
* :func:`gather_to_host`: FSDP2 / tensor parallel (``DTensor``): a streamed full gather to
  rank 0's host memory, one tensor at a time (collective).
* :func:`fsdp1_root` / :func:`fsdp1_state`: FSDP1 (``FullyShardedDataParallel``): torch's
  ``get_model_state_dict``, full (rank 0) or sharded (every rank) (collective).
* :func:`meta_twin`: a parameter-less twin of the model for background ``save_pretrained``.
* :func:`split_for_dcp`: which tensors DCP's HF consolidation can write.
"""

from __future__ import annotations

import collections
import copy
import itertools
import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from areal_lightning._torch_internals import HF_INSTANCE_STATE, WRAPPER_SEGMENTS
from areal_lightning.errors import CheckpointWriteError, ConfigError

__all__ = ["is_sharded", "export_state_dict", "gather_to_host", "fsdp1_root", "fsdp1_state", "meta_twin", "split_for_dcp"]

log = logging.getLogger(__name__)

# Dtypes DCP's safetensors consolidation handles (it sizes elements with torch.finfo).
_CONSOLIDATABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)



def is_sharded(model: torch.nn.Module) -> bool:
    """True when any parameter or buffer of ``model`` is a ``DTensor`` (FSDP2, tensor parallel)."""
    return any(isinstance(t, DTensor) for t in itertools.chain(model.parameters(), model.buffers()))


# --------------------------------------------------------------------------------------
# What to write


def export_state_dict(model: torch.nn.Module, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """``model.state_dict()`` (or ``state``, keyed like it) without tied aliases: exactly the
    keys ``save_pretrained`` writes.

    Aliases are found from the module tree (the same parameter object under several names,
    e.g. GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``), not from tensor storage:
    state-dict entries of sharded or gathered tensors no longer share storage. Which alias
    is kept is decided by transformers' own ``remove_tied_weights_from_state_dict``, so the
    export reloads (and re-ties) like a ``save_pretrained`` one.
    """
    state = model.state_dict() if state is None else state
    groups: dict[int, list[str]] = collections.defaultdict(list)
    named = itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if name in state:
            groups[id(tensor)].append(name)
    aliased = [names for names in groups.values() if len(names) > 1]
    if not aliased:
        return state
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    proxies: dict[str, torch.Tensor] = {}
    for names in aliased:
        proxy = torch.zeros(1)  # one small tensor per group: the aliases share its storage
        for name in names:
            proxies[name] = proxy
    kept = remove_tied_weights_from_state_dict(dict(proxies), model)
    for name in set(proxies) - set(kept):
        del state[name]
    return state


@torch.no_grad()
def gather_to_host(state_dict: Mapping[str, torch.Tensor], dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Streamed full gather: the full tensors on rank ``dst``'s host, ``None`` on the other ranks.

    Collective (call it on every rank, on the training thread): each ``DTensor`` is
    gathered with ``full_tensor()`` one at a time, so at most one full parameter exists on
    a device at once; rank ``dst`` keeps a host copy, the others drop it. The returned
    tensors never alias live weights (safe to write in the background while training runs).
    """
    out: dict[str, torch.Tensor] | None = {} if dist.get_rank() == dst else None
    for name, tensor in state_dict.items():
        if isinstance(tensor, DTensor):
            full = tensor.full_tensor()
            # A replicated DTensor's full tensor can be its local tensor itself.
            aliased = full.untyped_storage().data_ptr() == tensor.to_local().untyped_storage().data_ptr()
        else:
            full, aliased = tensor, True
        if out is not None:
            out[name] = full.detach().to("cpu", copy=aliased)
        del full
    return out


def fsdp1_root(module: Any) -> torch.nn.Module | None:
    """``module`` if it is a torch FSDP1 ``FullyShardedDataParallel`` root (Lightning's
    ``FSDPStrategy`` wraps the whole LightningModule in one), else ``None``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return module if isinstance(module, FullyShardedDataParallel) else None



def _prefix_in(root: torch.nn.Module, model: torch.nn.Module) -> str:
    """The state-dict prefix of ``model`` inside ``root`` (wrapper names removed), e.g. ``"model."``."""
    for name, module in root.named_modules():
        if module is model:
            clean = ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)
            return f"{clean}." if clean else ""
    raise ConfigError("model_attr", f"{type(model).__name__} is not a submodule of the FSDP-wrapped "
                      f"{type(root).__name__}")


@torch.no_grad()
def fsdp1_state(root: torch.nn.Module, model: Any, *, full: bool, trainable_only: bool = False) -> dict[str, Any] | None:
    """The export weights of ``model`` (a submodule of the FSDP1 ``root``), keyed like
    ``model.state_dict()``, without tied aliases. Collective: every rank must call it.

    ``full=True``: torch's ``get_model_state_dict(full_state_dict=True)``: FSDP1 unshards one
    wrapped unit at a time (the root's own parameters stay unsharded while its children are
    visited); on GPUs (``cpu_offload=True``) each full tensor moves to rank 0's host memory
    and the other ranks drop it. Returns the full tensors on rank 0 (never aliasing live
    weights) and ``None`` elsewhere.
    ``full=False``: this rank's ``ShardedTensor`` shards (FSDP1's sharded state dict), for
    the ``"dcp"`` method. ``trainable_only``: without frozen parameters (e.g. a LoRA adapter's
    export: the frozen base is neither gathered nor returned)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    # cpu_offload (which makes FSDP1 keep the full tensors on rank 0 only) only for weights on
    # an accelerator: FSDP1's offload of CPU parameters reads freed memory (a segfault seen
    # with torch 2.13 on CPU/gloo), and on CPU the full tensors are host memory anyway.
    compute = getattr(root, "compute_device", None)  # FSDP1's device (parameters may be offloaded to CPU)
    on_device = compute.type != "cpu" if compute is not None else any(p.device.type != "cpu" for p in root.parameters())
    options = StateDictOptions(full_state_dict=full, cpu_offload=full and on_device, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(root, options=options)
    if full and dist.get_rank() != 0:
        return None
    prefix = _prefix_in(root, model)
    own = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    if not own:
        raise CheckpointWriteError(f"FSDP1 state dict: no entry under {prefix!r} (keys such as {next(iter(state), None)!r})")
    if full:
        live = {t.untyped_storage().data_ptr() for t in itertools.chain(root.parameters(), root.buffers()) if t.numel()}
        for key, value in own.items():
            if isinstance(value, torch.Tensor) and value.numel() and value.untyped_storage().data_ptr() in live:
                own[key] = value.clone()  # e.g. NO_SHARD on CPU: the full tensor is the live one
    return export_state_dict(model, own)


def model_class(model: Any) -> type:
    """The class of a ``PreTrainedModel`` (its own class when FSDP2 ``fully_shard`` made it ``FSDP<Class>``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def model_dtype(model: Any) -> torch.dtype:
    """The dtype of a model's floating-point parameters (torch's default where it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def meta_twin(model: Any) -> Any:
    """A parameter-less twin of a ``PreTrainedModel`` (same class, config, generation config
    and dtype; parameters on the ``meta`` device) for ``save_pretrained(state_dict=...)`` in a
    background thread (of the model's own class when FSDP2 ``fully_shard`` changed it). FSDP1
    (``use_orig_params=True``) swaps the live model's parameters
    for plain tensors during forward and backward, so a background ``save_pretrained`` of
    the live model would see no parameters (``model.dtype`` raises ``StopIteration``)."""
    dtype = model_dtype(model)
    cls = model_class(model)
    with torch.device("meta"):
        twin = cls(copy.deepcopy(model.config))
    twin.to(dtype=dtype)
    if getattr(model, "generation_config", None) is not None:
        twin.generation_config = copy.deepcopy(model.generation_config)
    # Instance state save_pretrained reads (weight-name conversions, quantizer, PEFT adapters).
    for name in HF_INSTANCE_STATE:
        if name in model.__dict__:
            setattr(twin, name, model.__dict__[name])
    return twin


def _is_sharded_tensor(tensor: Any) -> bool:
    from areal_lightning._torch_internals import sharded_tensor_types

    return isinstance(tensor, sharded_tensor_types()[0])


def split_for_dcp(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split ``state_dict`` into the part DCP consolidation can write and the rest.

    Returns ``(shards, extras)``: ``shards`` keeps floating-point tensors of dimension >= 1
    as they are (sharded ``DTensor`` s stay sharded); ``extras`` holds the others (integer,
    bool, 0-dim) as full local tensors. Collective if an extra is a ``DTensor``.
    """
    shards: dict[str, torch.Tensor] = {}
    extras: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if tensor.dtype in _CONSOLIDATABLE and len(tensor.shape) > 0:
            shards[name] = tensor
        elif _is_sharded_tensor(tensor):
            raise CheckpointWriteError(f"DCP HF export: {name!r} is a sharded {tensor.dtype} tensor, which DCP "
                                       "cannot consolidate; use sharded_method='gather'")
        else:
            extras[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return shards, extras


