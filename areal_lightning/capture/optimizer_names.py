"""Capture: optimizer state keyed by parameter name, whatever wraps the model.

``Optimizer.state_dict()`` keys each parameter's state by its position in the optimizer (0, 1,
...); torch's ``get_optimizer_state_dict`` (what FSDP1 and FSDP2 checkpoints hold) keys it by the
parameter's name in the module. Recover checkpoints store every optimizer by name
(:func:`by_name`), so one written under DDP or one process resumes under FSDP and the other way
round; :func:`by_index` turns a named state back into what ``Optimizer.load_state_dict`` of a
replicated strategy takes. Names are the module's own, without ``torch.compile``'s ``_orig_mod.``
(:func:`~areal_lightning.capture.compiled.plain_name`), the same as torch's for FSDP models.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from areal_lightning.capture.compiled import plain_name

__all__ = ["parameter_names", "names_every_parameter", "is_by_name", "by_name", "by_index"]


def parameter_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` of every parameter of ``module`` (first name of a shared one)."""
    return {id(p): plain_name(name) for name, p in module.named_parameters()}


def names_every_parameter(optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> bool:
    """Whether every parameter ``optimizer`` updates has a name in the module (else its state
    stays keyed by position: a parameter outside the module has no name to key it by)."""
    return all(id(p) in names for group in optimizer.param_groups for p in group["params"])


def is_by_name(state: Mapping[str, Any]) -> bool:
    """Whether an optimizer state dict keys its parameters by name."""
    return any(isinstance(p, str) for group in state.get("param_groups", []) for p in group.get("params", []))


def by_name(optimizer: torch.optim.Optimizer, state: dict[str, Any], names: Mapping[int, str]) -> dict[str, Any]:
    """``state`` (``optimizer.state_dict()``, keyed by position) keyed by parameter name; the
    tensors are the same objects. Returned unchanged when a parameter has no name."""
    if "param_groups" not in state or is_by_name(state) or not names_every_parameter(optimizer, names):
        return state  # also the {} a ZeroRedundancyOptimizer gives on the ranks it does not consolidate to
    name_of: dict[Any, str] = {}
    for saved, live in zip(state["param_groups"], optimizer.param_groups):
        name_of.update({index: names[id(p)] for index, p in zip(saved["params"], live["params"])})
    return {
        **state,
        "state": {name_of[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def by_index(optimizer: torch.optim.Optimizer, state: dict[str, Any], names: Mapping[int, str],
             what: str = "optimizer") -> dict[str, Any]:
    """A named optimizer ``state`` in the positional form ``optimizer.load_state_dict`` takes
    (positions as ``optimizer.state_dict()`` numbers them). A state keyed by position is
    returned as it is. Raises ``ValueError`` naming the parameters when the groups differ."""
    if not is_by_name(state):
        return state
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"{what}: the checkpoint has {len(saved_groups)} parameter group(s), the optimizer "
                         f"{len(optimizer.param_groups)}")
    index_of: dict[str, int] = {}
    groups = []
    position = 0
    for number, (saved, live) in enumerate(zip(saved_groups, optimizer.param_groups)):
        live_names = []
        for p in live["params"]:
            if id(p) not in names:
                raise ValueError(f"{what}: parameter {position} of group {number} is not a parameter of the "
                                 "module, so a state keyed by name cannot be matched to it")
            live_names.append(names[id(p)])
            index_of[names[id(p)]] = position
            position += 1
        if set(saved["params"]) != set(live_names):
            missing = sorted(set(live_names) - set(saved["params"]))[:5]
            extra = sorted(set(saved["params"]) - set(live_names))[:5]
            raise ValueError(f"{what}: group {number} holds other parameters than the checkpoint's (not in the "
                             f"checkpoint: {missing}; only in the checkpoint: {extra})")
        groups.append({**saved, "params": [index_of[name] for name in live_names]})
    return {**state, "state": {index_of[name]: value for name, value in state["state"].items()},
            "param_groups": groups}
