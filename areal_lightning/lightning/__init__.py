"""Lightning callbacks of areal-lightning, and building them from a config."""

from __future__ import annotations

from typing import Any

from areal_lightning.config import as_experiment
from areal_lightning.lightning.hf_saver import HFSaverCallback
from areal_lightning.lightning.recover import RecoverCallback

__all__ = ["HFSaverCallback", "RecoverCallback", "callbacks_from_config"]


def callbacks_from_config(cfg: Any, strict: bool = True, **saver_kwargs: Any) -> list[Any]:
    """The enabled callbacks of an experiment config (YAML path, dict, dataclass or ``DictConfig``).

    ``HFSaverCallback`` is included when the ``saver:`` section sets a trigger
    (``saver_kwargs`` such as ``model_attr``, ``tokenizer``, ``name`` go to it);
    ``RecoverCallback`` when ``recover.mode`` is ``on``/``auto`` (it is put last).

    Example:
        >>> cbs = callbacks_from_config({"fileroot": "/tmp/x", "experiment_name": "e",
        ...                              "trial_name": "t", "saver": {"freq_steps": 10}})
        >>> [type(c).__name__ for c in cbs]
        ['HFSaverCallback']
    """
    exp = as_experiment(cfg, strict)
    callbacks: list[Any] = []
    if exp.saver.enabled:
        callbacks.append(HFSaverCallback.from_config(exp, **saver_kwargs))
    if exp.recover.enabled:
        callbacks.append(RecoverCallback.from_config(exp))
    return callbacks
