"""HuggingFace export of a ``PreTrainedModel`` (+ tokenizer) into one atomic folder.

Weights are written by ``transformers``' own ``save_pretrained`` (safetensors, sharded with
``model.safetensors.index.json`` above ``max_shard_size``, tied weights handled, plus
``config.json`` and ``generation_config.json``), the tokenizer by its ``save_pretrained``.
Everything goes into a hidden temporary sibling that is fsynced and renamed into place by
:func:`areal_lightning.commit.publish_dir`.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from areal_lightning._fault import fault_point
from areal_lightning.commit.atomic import publish_dir
from areal_lightning.layout import tmp_sibling

__all__ = ["export_hf", "finish_export", "DEFAULT_MAX_SHARD_SIZE"]

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = "5GB"


@contextlib.contextmanager
def _quiet_hf_progress() -> Iterator[None]:
    """Hide transformers' 'Writing model shards' bar so it does not break Lightning's bar."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def prepare_tmp(final: Path) -> Path:
    """Create and return a fresh temporary sibling folder for ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_sibling(final)
    tmp.mkdir()
    return tmp


def finish_export(tmp: Path, final_dir: Path, tokenizer: Any = None) -> None:
    """Once weights and config are in ``tmp``: save the tokenizer there, then publish ``tmp``
    as ``final_dir`` atomically (fault points ``hf.after_weights``, ``hf.before_publish``)."""
    fault_point("hf.after_weights")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    fault_point("hf.before_publish")
    publish_dir(tmp, final_dir)


def export_hf(
    model: Any,
    final_dir: Path,
    tokenizer: Any = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    tmp_dir: Path | None = None,
) -> Path:
    """Export ``model`` (and ``tokenizer``) to ``final_dir`` atomically; return ``final_dir``.

    Args:
        model: a ``transformers.PreTrainedModel`` (supplies config and tied-weight info).
        final_dir: the export folder; it appears only when complete.
        tokenizer: saved with ``save_pretrained`` when given.
        state_dict: weights to write instead of ``model.state_dict()`` (e.g. a host copy
            staged for an async export). It is not modified (transformers empties the dict
            it is given, so a shallow copy is passed).
        max_shard_size: shard threshold (bytes or a string such as ``"5GB"``).
        tmp_dir: an already created temporary sibling to finish (else one is made).

    On any failure the temporary folder is removed and the error propagates; no folder
    with the final name is created.

    Example:
        >>> export_hf(model, Path("out/epoch0epochstep9globalstep9"), tokenizer)  # doctest: +SKIP
    """
    tmp = tmp_dir if tmp_dir is not None else prepare_tmp(final_dir)
    try:
        with _quiet_hf_progress():
            model.save_pretrained(
                tmp,
                state_dict=dict(state_dict) if state_dict is not None else None,
                max_shard_size=max_shard_size,
            )
        finish_export(tmp, final_dir, tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.debug("exported HF checkpoint to %s", final_dir)
    return final_dir
