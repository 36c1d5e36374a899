"""``torch.compile``d modules: the user's module inside torch's ``OptimizedModule``.

``torch.compile(module)`` returns an ``OptimizedModule`` holding the module as ``_orig_mod``
(its only handle; read in :mod:`areal_lightning._torch_internals`). Its parameters are the module's, but
under names with a ``_orig_mod.`` segment. HF exports take the module itself
(:func:`uncompiled`); recover checkpoints store the names without the segment
(:func:`plain_name`) and a resume maps them to the live model's names (:func:`live_names`),
so a compiled run and an uncompiled one resume each other's checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from areal_lightning._torch_internals import COMPILED_SEGMENT, original_module

__all__ = ["COMPILED_SEGMENT", "is_compiled", "uncompiled", "plain_name", "live_names"]

def is_compiled(module: Any) -> bool:
    """Whether ``module`` is torch's ``OptimizedModule`` (what ``torch.compile`` returns)."""
    return type(module).__name__ == "OptimizedModule" and hasattr(module, COMPILED_SEGMENT)


def uncompiled(module: Any) -> Any:
    """The module a (possibly repeatedly) ``torch.compile``d ``module`` wraps; others as they are."""
    while is_compiled(module):
        module = original_module(module)
    return module


def plain_name(name: str) -> str:
    """A state-dict key without the ``_orig_mod.`` segments ``torch.compile`` adds."""
    if COMPILED_SEGMENT not in name:  # (every key of a run without torch.compile: called per key, per save)
        return name
    return ".".join(part for part in name.split(".") if part != COMPILED_SEGMENT)


def live_names(saved: dict[str, Any], live: Iterable[str]) -> dict[str, Any]:
    """``saved`` (keys as :func:`plain_name` gives them) keyed by the live model's names
    (compiled or not); keys the live model does not have are kept as they are."""
    by_plain = {plain_name(name): name for name in live}
    return {by_plain.get(key, key): value for key, value in saved.items()}
