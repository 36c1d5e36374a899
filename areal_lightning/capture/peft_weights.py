"""PEFT models (``peft.PeftModel``: LoRA and the other adapters ``peft`` saves the same way).

Two exports of one PEFT model, both without changing the live (training) model:

* the **adapter**, as ``peft`` saves it (``adapter_config.json`` + ``adapter_model.safetensors``;
  ``PeftModel.from_pretrained(base, dir)`` / ``AutoPeftModelForCausalLM.from_pretrained(dir)``):
  :func:`adapter_entries` of the model's state dict, written by ``PeftModel.save_pretrained``
  (which keeps only what the adapter needs);
* the **merged** full weights under the base model's names, which plain
  ``AutoModelForCausalLM.from_pretrained`` loads: :func:`merged_state_dict` adds each tuner
  layer's ``get_delta_weight`` to a copy of its base weight (never ``merge_and_unload`` on the
  training model) and takes the trained copy of each ``modules_to_save`` module.

Both are computed from a *captured* state dict (the live tensors, a host copy, or under FSDP the
full tensors gathered to rank 0) loaded into a :func:`peft_twin`: a parameter-less copy of the
PEFT model on the ``meta`` device whose module names are the plain ones (no FSDP or
``torch.compile`` segments), so the same code serves every strategy and the live model is
only read.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Mapping

import torch

from areal_lightning._torch_internals import PEFT_LOADED_FLAG
from areal_lightning.capture.compiled import plain_name, uncompiled
from areal_lightning.errors import CheckpointWriteError, UnsupportedModelError

__all__ = ["is_peft", "over_pretrained", "check_exportable", "unnamed_bases", "adapter_entries", "plain_state", "peft_twin", "follow", "layer_merges", "loaded", "merged_state_dict"]


def is_peft(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (``peft`` is imported only for such models)."""
    if not any(cls.__module__.startswith("peft") for cls in type(model).__mro__):
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def over_pretrained(model: Any) -> bool:
    """Whether the PEFT ``model`` wraps a ``transformers.PreTrainedModel`` (also ``torch.compile``d)."""
    from transformers import PreTrainedModel

    return isinstance(uncompiled(model.get_base_model()), PreTrainedModel)


def _check_mergeable(name: str, layer: Any, adapter: str) -> None:
    """``TypeError`` unless ``adapter`` of the tuner ``layer`` merges as a weight delta
    (``get_delta_weight``; not DoRA, whose merge rescales the weight)."""
    dora = getattr(layer, "use_dora", {}).get(adapter, False)
    if dora or not hasattr(layer, "get_delta_weight"):
        kind = "DoRA" if dora else type(layer).__module__.rsplit(".", 2)[-2]  # peft.tuners.<kind>.layer
        raise UnsupportedModelError(f"merged export: the {kind} {type(layer).__name__} layer {name!r} (adapter {adapter!r}) "
                        "cannot be merged on the fly; supported: adapters "
                        "that add a weight delta (LoRA, LoHa, LoKr, ...); export the adapter instead "
                        "(peft_export='adapter')")


def check_exportable(model: Any, merged: bool) -> None:
    """``TypeError`` for a merged export of a PEFT ``model`` that does not wrap a
    ``transformers.PreTrainedModel`` (no config or class to write full weights with; its
    adapter exports as ``peft`` saves any adapter) or has an active adapter layer that cannot
    be merged on the fly."""
    if not merged:
        return
    if not over_pretrained(model):
        raise UnsupportedModelError(f"the PeftModel wraps a {type(uncompiled(model.get_base_model())).__name__}, not a "
                        "transformers.PreTrainedModel, so it has no merged HF export (supported: a merged "
                        "export of a PeftModel over a PreTrainedModel, also torch.compile'd; or "
                        "peft_export='adapter' for any PeftModel)")
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in model.get_base_model().named_modules():
        if isinstance(module, BaseTunerLayer):
            for adapter in module.active_adapters:
                _check_mergeable(plain_name(name), module, adapter)


def unnamed_bases(model: Any) -> list[str]:
    """The adapters of the PEFT ``model`` over a ``transformers.PreTrainedModel`` whose config names
    no base (``base_model_name_or_path`` empty: a base built from a config or assembled in code).
    Their adapter export would say ``"base_model_name_or_path": null``, and
    ``AutoPeftModelForCausalLM.from_pretrained`` would look for that base on the Hub."""
    if not over_pretrained(model):
        return []  # no AutoPeft loading for a plain module: PeftModel.from_pretrained(module, dir)
    return [name for name, config in model.peft_config.items() if not config.base_model_name_or_path]


def adapter_entries(state: Mapping[str, torch.Tensor], adapters: Any) -> dict[str, torch.Tensor]:
    """The entries of a PEFT state dict that belong to one of ``adapters`` (names with an adapter
    name as one segment, e.g. ``...lora_A.default.weight``, ``...modules_to_save.default.weight``):
    what ``PeftModel.save_pretrained`` selects its files from."""
    names = set(adapters)
    return {key: value for key, value in state.items() if names.intersection(key.split("."))}


def plain_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` keyed without ``torch.compile``'s ``_orig_mod`` segments (a base model compiled
    before ``get_peft_model``): the names of :func:`peft_twin` and of a plain base model."""
    return {plain_name(key): value for key, value in state.items()}


def peft_twin(model: Any) -> Any:
    """A parameter-less twin of the PEFT ``model`` on the ``meta`` device: the base model's class
    and config (unwrapped from ``torch.compile`` and FSDP2), the same adapters with their configs
    and the same active adapter. Cheap to make; the model to ``save_pretrained`` an export with.
    Call on the training thread (FSDP1 swaps the live parameters during forward/backward)."""
    from peft import get_peft_model

    from areal_lightning.capture.hf_weights import meta_twin

    names = list(model.peft_config)
    base = meta_twin(uncompiled(model.get_base_model()))
    for attribute in ("peft_config", PEFT_LOADED_FLAG):  # the live model's: not the twin's yet
        base.__dict__.pop(attribute, None)
    # peft initializes adapter weights (on meta) from torch's global generator: training's RNG
    # stream must not move; its warnings are those the user saw making the live model.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = get_peft_model(base, copy.deepcopy(model.peft_config[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            twin.add_adapter(name, copy.deepcopy(model.peft_config[name]))
    for name in names:  # as the live model has them (get_peft_model may have filled in fields)
        twin.peft_config[name] = copy.deepcopy(model.peft_config[name])
    follow(twin, model)
    return twin


def follow(twin: Any, model: Any) -> bool:
    """Give the :func:`peft_twin` the live ``model``'s active adapters (a user may switch them
    between exports); ``False`` if the model's set of adapters changed (make a new twin)."""
    if set(twin.peft_config) != set(model.peft_config):
        return False
    active = list(model.active_adapters)
    if list(twin.active_adapters) != active:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin.base_model.set_adapter(active if len(active) > 1 else active[0])
    return True


def layer_merges(model: Any) -> dict[str, list[str]]:
    """The adapters merged into each tuner layer of the live ``model`` (plain names; layers
    with none left out): a layer a user merged (``merge_adapter``) holds the merged weight."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {plain_name(name): list(module.merged_adapters) for name, module in model.named_modules()
            if isinstance(module, BaseTunerLayer) and module.merged_adapters}


class loaded:  # noqa: N801 (a context manager used like a function)
    """``with loaded(twin, state, merges):`` the :func:`peft_twin` holds the tensors of ``state``
    (a full, plain-named state dict of the PEFT model; not copied) and the live model's
    :func:`layer_merges` for the block, and no tensor after it (back on ``meta``: no host copy
    is kept between exports). ``CheckpointWriteError`` names a tensor the state does not have."""

    def __init__(self, twin: Any, state: Mapping[str, torch.Tensor], merges: Mapping[str, list[str]]) -> None:
        self.twin, self.state, self.merges = twin, state, merges

    def __enter__(self) -> Any:
        from peft.tuners.tuners_utils import BaseTunerLayer

        twin = self.twin
        twin.load_state_dict(dict(self.state), strict=False, assign=True)
        for name, module in twin.named_modules():
            if isinstance(module, BaseTunerLayer):
                module.merged_adapters = list(self.merges.get(name, []))
        base = twin.get_base_model()
        if getattr(base.config, "tie_word_embeddings", False):
            base.tie_weights()  # a tied alias the capture dropped
        missing = [key for key, value in twin.state_dict().items() if value.device.type == "meta"]
        if missing:
            self.__exit__(None, None, None)
            raise CheckpointWriteError(f"PEFT export: {len(missing)} tensors (e.g. {missing[0]!r}) were not "
                                       "captured from the live model")
        return twin

    def __exit__(self, *exc: Any) -> None:
        self.twin.to_empty(device="meta")


def _lift(state: dict[str, torch.Tensor], prefix: str, inner: str) -> None:
    """Replace the entries under ``prefix`` by those under ``prefix + inner``, renamed to
    ``prefix + rest`` (a wrapper's chosen inner module takes the wrapper's place)."""
    for key in [k for k in state if k.startswith(prefix)]:
        value = state.pop(key)
        rest = key[len(prefix):]
        if rest.startswith(inner):
            state[prefix + rest[len(inner):]] = value


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict with every active adapter merged in, as new tensors (the
    model's weights are not changed). Raises ``TypeError`` for a tuner layer it cannot merge."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model()
    state = {key: value.detach() for key, value in base.state_dict().items()}
    for name, module in base.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapters[0] if module.active_adapters else None
            _lift(state, prefix, f"modules_to_save.{active}." if active in module.modules_to_save else "original_module.")
        elif isinstance(module, BaseTunerLayer):
            delta = None
            if not module.merged:
                for adapter in module.active_adapters:
                    _check_mergeable(name, module, adapter)
                    if adapter in getattr(module, "lora_A", {adapter: None}):
                        d = module.get_delta_weight(adapter).detach()
                        delta = d if delta is None else delta + d
            _lift(state, prefix, "base_layer.")  # the adapter's own weights are dropped
            if delta is not None:
                weight = state[prefix + "weight"]
                state[prefix + "weight"] = (weight + delta.to(weight.dtype)).contiguous()
    return state
