"""PEFT models (``peft.PeftModel``: LoRA and the other adapters ``peft`` saves the same way).

Two exports of one PEFT model, both without changing the live (training) model:

* the **adapter**, as ``peft`` saves it (``adapter_config.json`` + ``adapter_model.safetensors``;
  ``PeftModel.from_pretrained(base, dir)`` / ``AutoPeftModelForCausalLM.from_pretrained(dir)``):
  :func:`adapter_tensors` are the model's own adapter entries, written by ``PeftModel.save_pretrained``
  (which keeps only what the adapter needs);
* the **merged** full weights under the base model's names, which plain
  ``AutoModelForCausalLM.from_pretrained`` loads: :func:`merged_state_dict` adds each tuner
  layer's ``get_delta_weight`` to a copy of its base weight (never ``merge_and_unload`` on the
  training model) and takes the trained copy of each ``modules_to_save`` module.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_peft", "adapter_tensors", "merged_state_dict"]


def is_peft(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (``peft`` is imported only for such models)."""
    if not type(model).__module__.startswith("peft"):
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The entries of ``model.state_dict()`` that belong to its adapters (names with an adapter
    name as one segment, e.g. ``...lora_A.default.weight``): what ``PeftModel.save_pretrained``
    selects its files from, and all an async export copies to host."""
    adapters = set(model.peft_config)
    return {key: value.detach() for key, value in model.state_dict().items()
            if adapters.intersection(key.split("."))}


def _lift(state: dict[str, torch.Tensor], prefix: str, inner: str) -> None:
    """Replace the entries under ``prefix`` by those under ``prefix + inner``, renamed to
    ``prefix + rest`` (a wrapper's chosen inner module takes the wrapper's place)."""
    for key in [k for k in state if k.startswith(prefix)]:
        value = state.pop(key)
        rest = key[len(prefix):]
        if rest.startswith(inner):
            state[prefix + rest[len(inner):]] = value


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The base model's state dict with every active adapter merged in, as new tensors (the live
    weights are not changed). Raises ``TypeError`` for a tuner layer it cannot merge."""
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
                    if getattr(module, "use_dora", {}).get(adapter, False) or not hasattr(module, "get_delta_weight"):
                        raise TypeError(f"merged export: the {type(module).__name__} layer {name!r} (adapter "
                                        f"{adapter!r}) cannot be merged on the fly; supported: LoRA layers; "
                                        "export the adapter instead (peft_export='adapter')")
                    if adapter in getattr(module, "lora_A", {adapter: None}):
                        d = module.get_delta_weight(adapter).detach()
                        delta = d if delta is None else delta + d
            _lift(state, prefix, "base_layer.")  # the adapter's own weights are dropped
            if delta is not None:
                weight = state[prefix + "weight"]
                state[prefix + "weight"] = (weight + delta.to(weight.dtype)).contiguous()
    return state
