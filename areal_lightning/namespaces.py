"""Both Lightning namespaces: ``lightning.pytorch`` and the standalone ``pytorch_lightning``.

The ``lightning`` package installs both: the same code twice, as two sets of classes that do
not know each other (a ``pytorch_lightning.Trainer`` refuses a plugin derived from
``lightning.pytorch``'s ``CheckpointIO``; LightningCLI under one namespace refuses the other's
callbacks). The package works under either without the user choosing:

* our callbacks and ``DCPCheckpointIO`` derive from the base class of **every** installed
  namespace (:func:`bases`), so either Trainer, either LightningCLI and either set of type checks
  accepts them, and one instance can be handed to any Trainer;
* every ``isinstance`` test of a Lightning class uses the class of every installed namespace
  (:func:`classes`), so the Trainer given decides, never an import of ours.
"""

from __future__ import annotations

import functools
import importlib

__all__ = ["PYTORCH_NAMESPACES", "FABRIC_NAMESPACES", "classes", "fabric_classes", "bases"]

PYTORCH_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
"""The trainer-side namespaces, the unified package's first."""
FABRIC_NAMESPACES = ("lightning.fabric", "lightning_fabric")
"""Their fabric counterparts (in the same order)."""


def _lookup(namespaces: tuple[str, ...], path: str) -> tuple[type, ...]:
    module_path, _, name = path.rpartition(".")
    found: list[type] = []
    for root in namespaces:
        try:
            module = importlib.import_module(f"{root}.{module_path}" if module_path else root)
        except ImportError:  # a namespace that is not installed
            continue
        cls = getattr(module, name)
        if cls not in found:
            found.append(cls)
    if not found:
        raise ImportError(f"none of {', '.join(namespaces)} provides {path}")
    return tuple(found)


@functools.cache
def classes(path: str) -> tuple[type, ...]:
    """The class ``path`` (e.g. ``"strategies.FSDPStrategy"``) of every installed trainer
    namespace, for ``isinstance``: ``isinstance(x, classes("loggers.CSVLogger"))``."""
    return _lookup(PYTORCH_NAMESPACES, path)


@functools.cache
def fabric_classes(path: str) -> tuple[type, ...]:
    """As :func:`classes`, in the fabric namespaces (``lightning.fabric``, ``lightning_fabric``)."""
    return _lookup(FABRIC_NAMESPACES, path)


def bases(path: str) -> tuple[type, ...]:
    """Base classes for a class of ours that both namespaces must accept (``class
    RecoverCallback(*bases("callbacks.Callback"))``): the same class in every installed namespace."""
    return classes(path)
