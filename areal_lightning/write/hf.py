"""HuggingFace export of a ``PreTrainedModel`` (+ tokenizer) into one folder.

Weights are written by ``transformers``' own ``save_pretrained`` (safetensors, sharded with
``model.safetensors.index.json`` above ``max_shard_size``, tied weights handled, plus
``config.json`` and ``generation_config.json``), the tokenizer by its ``save_pretrained``.
Every function here writes into the folder it is given (an export's hidden temporary
sibling) and nothing else: making it visible under its final name is the commit stage's
(:class:`areal_lightning.commit.atomic.AtomicDir`, run by :mod:`areal_lightning.hf_export`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from areal_lightning._fault import fault_point
from areal_lightning.errors import CheckpointWriteError
from areal_lightning.layout import (
    HF_DCP_SHARDS,
    HF_INDEX,
    HF_METADATA_TMP,
    HF_WEIGHTS,
)

__all__ = ["write_hf", "write_peft", "save_tokenizer", "save_hf_metadata", "write_hf_dcp", "HFFilePlan", "DEFAULT_MAX_SHARD_SIZE"]

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


def save_tokenizer(folder: Path, tokenizer: Any = None) -> None:
    """Once the weights and config are in ``folder``: the tokenizer's ``save_pretrained`` there
    (fault point ``hf.after_weights`` first)."""
    fault_point("hf.after_weights")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def write_hf(
    model: Any,
    folder: Path,
    tokenizer: Any = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Write the HF files of ``model`` (and ``tokenizer``) into the existing ``folder``.

    Args:
        model: a ``transformers.PreTrainedModel`` (supplies config and tied-weight info).
        folder: where to write (an export's temporary folder).
        tokenizer: saved with ``save_pretrained`` when given.
        state_dict: weights to write instead of ``model.state_dict()`` (e.g. a host copy
            staged for an async export). It is not modified (transformers empties the dict
            it is given, so a shallow copy is passed).
        max_shard_size: shard threshold (bytes or a string such as ``"5GB"``).

    Example:
        >>> write_hf(model, Path("out/.tmp-epoch0epochstep9globalstep9-ab12"), tokenizer)  # doctest: +SKIP
    """
    with _quiet_hf_progress():
        model.save_pretrained(folder, state_dict=dict(state_dict) if state_dict is not None else None,
                              max_shard_size=max_shard_size)
    save_tokenizer(folder, tokenizer)


def write_peft(
    model: Any,
    folder: Path,
    tokenizer: Any = None,
    *,
    adapter: Mapping[str, torch.Tensor] | None,
    merged: Mapping[str, torch.Tensor] | None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Write the HF files of a ``peft.PeftModel`` into the existing ``folder``, as :func:`write_hf` does.

    ``merged`` (the base model's names, adapters merged in): written with the base model's
    ``save_pretrained`` (``config.json`` + safetensors), loadable with ``AutoModelForCausalLM``.
    ``adapter`` (the model's adapter entries, see ``capture.peft_weights.adapter_entries``):
    written with ``PeftModel.save_pretrained`` (``adapter_config.json`` +
    ``adapter_model.safetensors``), into the folder itself, or into ``adapter/`` when both are
    written. The tokenizer is saved with each."""
    with _quiet_hf_progress():
        if merged is not None:
            model.get_base_model().save_pretrained(folder, state_dict=dict(merged), max_shard_size=max_shard_size)
        if adapter is not None:
            inner = folder / "adapter" if merged is not None else folder
            model.save_pretrained(inner, state_dict=dict(adapter), safe_serialization=True)
            if merged is not None and tokenizer is not None:
                tokenizer.save_pretrained(inner)
    save_tokenizer(folder, tokenizer)


# --------------------------------------------------------------------------------------
# The DCP method


def _read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _shard_file_name(index: int, total: int) -> str:
    return f"model-{index:05d}-of-{total:05d}.safetensors"


class HFFilePlan:
    """Which file each tensor of a DCP export goes to: the split ``save_pretrained`` would
    make of ``state_dict`` (same order, same ``max_shard_size``), with the entries DCP cannot
    consolidate (not in ``shard_keys``) moved to one extra, last file. Computed identically
    on every rank from shapes and dtypes only (no communication, no I/O)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], shard_keys: set[str] | Mapping[str, Any],
                 max_shard_size: int | str) -> None:
        from huggingface_hub import split_torch_state_dict_into_shards

        # Meta stand-ins of the full shapes: sized like save_pretrained sizes them, without
        # touching (sharded) storage.
        meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in state_dict.items()}
        split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)
        self.total_size: int = int(split.metadata["total_size"])
        self.dcp_index: dict[str, int] = {}
        for names in split.filename_to_tensors.values():
            names = [n for n in names if n in shard_keys]
            if names:
                index = len(set(self.dcp_index.values())) + 1
                self.dcp_index.update(dict.fromkeys(names, index))
        self.extra_keys: list[str] = [n for n in state_dict if n not in shard_keys]
        self.dcp_files = len(set(self.dcp_index.values()))
        self.files = self.dcp_files + (1 if self.extra_keys else 0)
        self.sharded = self.files > 1

    def name(self, index: int) -> str:
        """Final name of file ``index`` (1-based)."""
        return HF_WEIGHTS if not self.sharded else _shard_file_name(index, self.files)


def _check_shard_coverage(sharded_dir: Path, expected: Mapping[str, torch.Tensor]) -> None:
    """Every element of every tensor must have been written by some rank (catches ranks
    whose files did not land in the same folder, i.e. no shared file system)."""
    written: dict[str, int] = collections.Counter()
    for path in sharded_dir.glob("*.safetensors"):
        for name, info in _read_header(path).items():
            if name != "__metadata__":
                written[name] += math.prod(info["shape"])
    missing = [name for name, t in expected.items() if written.get(name, 0) != math.prod(t.shape)]
    if missing:
        raise CheckpointWriteError(
            f"DCP HF export to {sharded_dir.parent}: shards of {len(missing)} tensors (e.g. {missing[0]!r}) are "
            "missing or duplicated; every rank must write to a file system that rank 0 can read (shared storage)"
        )


def _check_consolidated(folder: Path, plan: HFFilePlan, expected: Mapping[str, torch.Tensor]) -> None:
    """The consolidated files hold exactly the planned tensors, with their full shapes and dtypes."""
    from safetensors.torch import _getdtype  # type: ignore[attr-defined]

    for index in range(1, plan.dcp_files + 1):
        header = _read_header(folder / _shard_file_name(index, plan.dcp_files))
        header.pop("__metadata__", None)
        planned = sorted(name for name, i in plan.dcp_index.items() if i == index)
        if sorted(header) != planned:
            raise CheckpointWriteError(f"DCP HF export to {folder}: file {index} holds {sorted(header)}, "
                                       f"expected {planned}")
        for name, info in header.items():
            want = expected[name]
            if list(info["shape"]) != list(want.shape) or _getdtype(info["dtype"]) != want.dtype:
                raise CheckpointWriteError(f"DCP HF export to {folder}: consolidated {name!r} has shape "
                                           f"{info['shape']} {info['dtype']}, expected {list(want.shape)} {want.dtype}")


def save_hf_metadata(model: Any, folder: Path) -> None:
    """config.json (+ generation_config.json, remote code) exactly as ``save_pretrained``
    writes them: ``save_pretrained`` with an empty state dict writes no weight file. It runs
    in a subfolder (it deletes ``model-*-of-*`` files it did not write) whose files are
    then moved up."""
    meta = folder / HF_METADATA_TMP
    with _quiet_hf_progress():
        model.save_pretrained(meta, state_dict={})
    for item in meta.iterdir():
        os.rename(item, folder / item.name)
    meta.rmdir()


def _finish_dcp_folder(tmp: Path, plan: HFFilePlan, extras: Mapping[str, torch.Tensor],
                       expected: Mapping[str, torch.Tensor], total_parameters: int) -> None:
    """Turn DCP's consolidated output into ``save_pretrained``'s layout (rank 0)."""
    from safetensors.torch import save_file

    sharded = tmp / HF_DCP_SHARDS
    if plan.dcp_files:
        _check_shard_coverage(sharded, {k: v for k, v in expected.items() if k in plan.dcp_index})
        _check_consolidated(tmp, plan, expected)
    shutil.rmtree(sharded, ignore_errors=True)
    (tmp / HF_INDEX).unlink(missing_ok=True)  # DCP's; rewritten below
    weight_map: dict[str, str] = {}
    for index in range(1, plan.dcp_files + 1):
        name = plan.name(index)
        os.rename(tmp / _shard_file_name(index, plan.dcp_files), tmp / name)
    for key, index in plan.dcp_index.items():
        weight_map[key] = plan.name(index)
    if extras:
        name = plan.name(plan.files)
        save_file({k: v.detach().cpu().contiguous() for k, v in extras.items()}, str(tmp / name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(extras, name))
    if plan.sharded:
        index_doc = {"metadata": {"total_parameters": total_parameters, "total_size": plan.total_size},
                     "weight_map": weight_map}
        with open(tmp / HF_INDEX, "w", encoding="utf-8") as f:
            f.write(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")


def write_hf_dcp(
    model: Any,
    folder: Path,
    tokenizer: Any,
    shards: Mapping[str, torch.Tensor],
    extras: Mapping[str, torch.Tensor],
    *,
    plan: HFFilePlan,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int = 1,
) -> None:
    """Write one HF export with DCP's ``HuggingFaceStorageWriter``; collective over ``process_group``.

    Every rank passes its (possibly host-staged) ``shards``, the ``extras`` (see
    :func:`split_for_dcp`), the same ``plan`` and the same ``folder`` (created by rank 0 on
    storage every rank sees). ``dcp.save`` comes first (no rank can fail alone before it);
    then rank 0 checks the consolidated files and writes the extras, config and tokenizer.
    The error propagates (on every rank if DCP failed).
    """
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint import save as dcp_save

    if plan.dcp_files:
        writer = HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=plan.dcp_index, save_distributed=True,
                                          enable_consolidation=True, thread_count_consolidation=thread_count)
        writer.sync_files = False  # the shard files are deleted; the final files are fsynced at publish
        dcp_save(dict(shards), storage_writer=writer, process_group=process_group)
    if dist.get_rank(process_group) != 0:
        return
    _finish_dcp_folder(folder, plan, extras, {**shards, **extras}, int(model.num_parameters()))
    save_hf_metadata(model, folder)
    save_tokenizer(folder, tokenizer)
    log.debug("wrote HF checkpoint (DCP, %d files) to %s", plan.files, folder)
