"""HuggingFace export when ``torch.distributed`` runs more than one rank (DDP, FSDP2, DTensor).

Every rank calls :meth:`DistributedHFExporter.export` for the same folder, in the same
order. The result is the layout of :func:`areal_lightning.write.hf.export_hf`: ``config.json``
(+ ``generation_config.json``), ``model.safetensors`` or ``model-0000k-of-0000N.safetensors``
+ ``model.safetensors.index.json``, and the tokenizer, each written once (by rank 0) into a
hidden temporary sibling that is fsynced and renamed into place.

Replicated weights (DDP, or any model without ``DTensor`` parameters)
    Rank 0 exports its own copy; the other ranks write nothing.

Sharded weights (FSDP2 ``fully_shard``, tensor parallel: parameters are ``DTensor``)
    No rank can materialize the model alone, and no rank gathers the whole model on its
    accelerator. Two methods (``method=``):

    ``"gather"`` (the default): a streamed full gather. Tensor by tensor, every rank calls
    ``DTensor.full_tensor()`` (one full parameter on the device at a time); rank 0 moves it
    to host memory, the other ranks drop it. Rank 0 then writes with transformers' own
    ``save_pretrained``: the files are byte for byte those of a single-process export of
    the same weights (safetensors headers, shard split, index). Rank 0 holds one host copy
    of the model (the size of its safetensors files).

    ``"dcp"``: ``torch.distributed.checkpoint`` with ``HuggingFaceStorageWriter(
    save_distributed=True, enable_consolidation=True)``. Every rank writes its local
    shards to ``sharded/`` in the temporary folder; rank 0 then consolidates them into the
    final files (reading every shard back), and ``sharded/`` is deleted before publishing.
    No host copy of the full model exists anywhere, but every byte is written twice and
    read once, and all ranks must see the same file system. DCP's consolidation cannot
    handle integer/bool tensors (PyTorch issue #192485) nor 0-dim tensors: those entries
    (small buffers in practice) go through the gather path into one extra file. Tied
    weights (GPT-2 ``lm_head.weight`` = ``wte.weight``) are stored once, exactly as
    ``save_pretrained`` stores them, for both methods.

Why ``"gather"`` is the default (``benchmarks/hf_sharded_export.py``: FSDP2 on 2 gloo CPU
ranks, a 77M-parameter / 310 MB fp32 Llama, medians of 5, ratios dcp / gather):

    ========  ==========  ===========  ====================
    mode      blocked     durable      rank 0 host copy
    ========  ==========  ===========  ====================
    sync      1.6-1.9x    1.6-1.9x     0.5x (own shard)
    async     0.07-0.08x  1.7-2.1x     0.5x (own shard)
    ========  ==========  ===========  ====================

The gather writes every byte once (DCP writes it twice and reads it back once), so its
export is durable 1.6-2x sooner in both modes; its files are those of a single-process
``save_pretrained`` (bitwise), it needs no shared file system and none of the DCP
workarounds above. ``"dcp"`` holds training far less in async mode (only the local shards
are copied to host; the gather is a collective on the training thread) and never puts the
whole model in one host's memory: choose it when the async blocked time dominates or the
model does not fit in rank 0's host memory.

Async (``asynchronous=True``)
    The training thread is held only for the host copy: ``"gather"`` gathers to rank 0's
    host memory (a collective on the training process group, so it must run on the training
    thread), then rank 0 writes in a :class:`~areal_lightning.stage.BackgroundWorker`
    thread. ``"dcp"`` copies each rank's local shards to reused host buffers, then every
    rank runs ``dcp.save`` in its background thread on a dedicated gloo group, which shares
    nothing with training collectives.

Agreement
    Before each async export (and at :meth:`DistributedHFExporter.close` with
    ``agree=True``), every rank waits for its own export in flight, then all ranks exchange
    "did it succeed" on the dedicated gloo group: no rank starts an export (or its
    collectives) while another is still inside the previous one, and a failure on any rank
    is raised on every rank (the failing rank raises its own error, the others
    :class:`CheckpointWriteError` naming the failed rank). Every export also agrees once its
    training-thread part is done (host copy taken, temporary folder created), before any
    rank enters a DCP collective, and a sync export agrees again once written.

Known differences of ``"dcp"`` output from ``save_pretrained``'s: DCP's consolidated
safetensors headers carry no ``{"format": "pt"}`` metadata and list tensors in its own order
(transformers 5 loads them; the loaded tensors are bitwise the same).
"""

from __future__ import annotations

import collections
import copy
import itertools
import json
import logging
import math
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from areal_lightning.collective import DEFAULT_TIMEOUT_S, CheckpointGroup
from areal_lightning.stage import BackgroundWorker
from areal_lightning.errors import CheckpointWriteError
from areal_lightning.write.hf import DEFAULT_MAX_SHARD_SIZE, _quiet_hf_progress, export_hf, finish_export, prepare_tmp

__all__ = [
    "SHARDED_METHODS",
    "DEFAULT_SHARDED_METHOD",
    "DistributedHFExporter",
    "is_sharded",
    "export_state_dict",
    "fsdp1_root",
    "fsdp1_state",
    "gather_to_host",
    "split_for_dcp",
    "write_hf_dcp",
    "HFFilePlan",
    "validate_method",
]

log = logging.getLogger(__name__)

SHARDED_METHODS = ("gather", "dcp")
"""How sharded weights become one HF folder (see the module docstring)."""

DEFAULT_SHARDED_METHOD = "gather"

# Dtypes DCP's safetensors consolidation handles (it sizes elements with torch.finfo).
_CONSOLIDATABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

PublishHook = Callable[[Path, float | None], None]
"""Called on rank 0 once an export is published: ``(final_dir, blocked_s or None for sync)``."""


def validate_method(method: Any, field: str = "method") -> str:
    """Return ``method`` if it is one of :data:`SHARDED_METHODS`, else raise ``ValueError`` naming ``field``."""
    if method not in SHARDED_METHODS:
        raise ValueError(f"{field}: unknown sharded export method {method!r}; allowed: {', '.join(SHARDED_METHODS)}")
    return method


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


_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _prefix_in(root: torch.nn.Module, model: torch.nn.Module) -> str:
    """The state-dict prefix of ``model`` inside ``root`` (wrapper names removed), e.g. ``"model."``."""
    for name, module in root.named_modules():
        if module is model:
            clean = ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)
            return f"{clean}." if clean else ""
    raise ValueError(f"{type(model).__name__} is not a submodule of the FSDP-wrapped {type(root).__name__}")


@torch.no_grad()
def fsdp1_state(root: torch.nn.Module, model: Any, *, full: bool) -> dict[str, Any] | None:
    """The export weights of ``model`` (a submodule of the FSDP1 ``root``), keyed like
    ``model.state_dict()``, without tied aliases. Collective: every rank must call it.

    ``full=True``: torch's ``get_model_state_dict(full_state_dict=True)``: FSDP1 unshards one
    wrapped unit at a time (the root's own parameters stay unsharded while its children are
    visited); on GPUs (``cpu_offload=True``) each full tensor moves to rank 0's host memory
    and the other ranks drop it. Returns the full tensors on rank 0 (never aliasing live
    weights) and ``None`` elsewhere.
    ``full=False``: this rank's ``ShardedTensor`` shards (FSDP1's sharded state dict), for
    the ``"dcp"`` method."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # cpu_offload (which makes FSDP1 keep the full tensors on rank 0 only) only for weights on
    # an accelerator: FSDP1's offload of CPU parameters reads freed memory (a segfault seen
    # with torch 2.13 on CPU/gloo), and on CPU the full tensors are host memory anyway.
    compute = getattr(root, "compute_device", None)  # FSDP1's device (parameters may be offloaded to CPU)
    on_device = compute.type != "cpu" if compute is not None else any(p.device.type != "cpu" for p in root.parameters())
    options = StateDictOptions(full_state_dict=full, cpu_offload=full and on_device)
    state = get_model_state_dict(root, options=options)
    if full and dist.get_rank() != 0:
        return None
    prefix = _prefix_in(root, model)
    own = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
    if full:
        live = {t.untyped_storage().data_ptr() for t in itertools.chain(root.parameters(), root.buffers()) if t.numel()}
        for key, value in own.items():
            if isinstance(value, torch.Tensor) and value.numel() and value.untyped_storage().data_ptr() in live:
                own[key] = value.clone()  # e.g. NO_SHARD on CPU: the full tensor is the live one
    return export_state_dict(model, own)


def meta_twin(model: Any) -> Any:
    """A parameter-less twin of a ``PreTrainedModel`` (same class, config, generation config
    and dtype; parameters on the ``meta`` device) for ``save_pretrained(state_dict=...)`` in a
    background thread. FSDP1 (``use_orig_params=True``) swaps the live model's parameters
    for plain tensors during forward and backward, so a background ``save_pretrained`` of
    the live model would see no parameters (``model.dtype`` raises ``StopIteration``)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    with torch.device("meta"):
        twin = type(model)(copy.deepcopy(model.config))
    twin.to(dtype=dtype)
    if getattr(model, "generation_config", None) is not None:
        twin.generation_config = copy.deepcopy(model.generation_config)
    # Instance state save_pretrained reads (weight-name conversions, quantizer, PEFT adapters).
    for name in ("_weight_conversions", "hf_quantizer", "_hf_peft_config_loaded", "peft_config"):
        if name in model.__dict__:
            setattr(twin, name, model.__dict__[name])
    return twin


def _is_sharded_tensor(tensor: Any) -> bool:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return isinstance(tensor, ShardedTensor)


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
        return "model.safetensors" if not self.sharded else _shard_file_name(index, self.files)


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


def _save_hf_metadata(model: Any, folder: Path) -> None:
    """config.json (+ generation_config.json, remote code) exactly as ``save_pretrained``
    writes them: ``save_pretrained`` with an empty state dict writes no weight file. It runs
    in a subfolder (it deletes ``model-*-of-*`` files it did not write) whose files are
    then moved up."""
    meta = folder / ".hf-metadata"
    with _quiet_hf_progress():
        model.save_pretrained(meta, state_dict={})
    for item in meta.iterdir():
        os.rename(item, folder / item.name)
    meta.rmdir()


def _finish_dcp_folder(tmp: Path, plan: HFFilePlan, extras: Mapping[str, torch.Tensor],
                       expected: Mapping[str, torch.Tensor], total_parameters: int) -> None:
    """Turn DCP's consolidated output into ``save_pretrained``'s layout (rank 0)."""
    from safetensors.torch import save_file

    sharded = tmp / "sharded"
    if plan.dcp_files:
        _check_shard_coverage(sharded, {k: v for k, v in expected.items() if k in plan.dcp_index})
        _check_consolidated(tmp, plan, expected)
    shutil.rmtree(sharded, ignore_errors=True)
    (tmp / "model.safetensors.index.json").unlink(missing_ok=True)  # DCP's; rewritten below
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
        with open(tmp / "model.safetensors.index.json", "w", encoding="utf-8") as f:
            f.write(json.dumps(index_doc, indent=2, sort_keys=True) + "\n")


def write_hf_dcp(
    model: Any,
    final_dir: Path,
    tokenizer: Any,
    shards: Mapping[str, torch.Tensor],
    extras: Mapping[str, torch.Tensor],
    *,
    plan: HFFilePlan,
    tmp_dir: Path,
    process_group: dist.ProcessGroup | None = None,
    thread_count: int = 1,
) -> Path | None:
    """Write one HF export with DCP's ``HuggingFaceStorageWriter``; collective over ``process_group``.

    Every rank passes its (possibly host-staged) ``shards``, the ``extras`` (see
    :func:`split_for_dcp`), the same ``plan`` and the same ``tmp_dir`` (created by rank 0 on
    storage every rank sees). ``dcp.save`` comes first (no rank can fail alone before it);
    then rank 0 checks the consolidated files, writes the extras, config and tokenizer and
    publishes ``final_dir``. Returns ``final_dir`` on rank 0, ``None`` elsewhere. On failure
    rank 0 removes ``tmp_dir``; the error propagates (on every rank if DCP failed).
    """
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint import save as dcp_save

    lead = dist.get_rank(process_group) == 0
    try:
        if plan.dcp_files:
            writer = HuggingFaceStorageWriter(str(tmp_dir), fqn_to_index_mapping=plan.dcp_index, save_distributed=True,
                                              enable_consolidation=True, thread_count_consolidation=thread_count)
            writer.sync_files = False  # the shard files are deleted; the final files are fsynced at publish
            dcp_save(dict(shards), storage_writer=writer, process_group=process_group)
        if not lead:
            return None
        _finish_dcp_folder(tmp_dir, plan, extras, {**shards, **extras}, int(model.num_parameters()))
        _save_hf_metadata(model, tmp_dir)
        finish_export(tmp_dir, final_dir, tokenizer)
    except BaseException:
        if lead:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    log.debug("exported HF checkpoint (DCP, %d files) to %s", plan.files, final_dir)
    return final_dir


# --------------------------------------------------------------------------------------
# Orchestration: sync / async, agreement


class DistributedHFExporter:
    """HF exports under ``torch.distributed`` with more than one rank (see the module doc).

    Args:
        method: ``"gather"`` or ``"dcp"``, for sharded (``DTensor``) models.
        asynchronous: write in a background thread; only the host copy holds the caller.
        max_shard_size: safetensors shard threshold (bytes or a string such as ``"5GB"``).
        name: names the background thread (``areal-hf-{name}``).
        thread_count: consolidation threads for ``"dcp"``.
        collective_timeout: seconds each agreement and DCP collective of an export waits for
            the other ranks (see :mod:`areal_lightning.collective`).
        ranks: an existing :class:`~areal_lightning.collective.CheckpointGroup` to use instead
            (its timeout applies).

    Every rank must call :meth:`export` and :meth:`close` together, in the same order.
    """

    def __init__(
        self,
        *,
        method: str = DEFAULT_SHARDED_METHOD,
        asynchronous: bool = False,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        name: str = "default",
        thread_count: int = 1,
        collective_timeout: float = DEFAULT_TIMEOUT_S,
        ranks: CheckpointGroup | None = None,
    ) -> None:
        self.method = validate_method(method)
        self.asynchronous = asynchronous
        self.max_shard_size = max_shard_size
        self.thread_count = thread_count
        self._worker: BackgroundWorker | None = BackgroundWorker(f"areal-hf-{name}") if asynchronous else None
        self._ranks = ranks if ranks is not None else CheckpointGroup(collective_timeout)
        self._pending: str | None = None  # the folder of the export in flight (for messages)
        self._twin: tuple[Any, Any] | None = None  # (live model, its meta twin) for FSDP1
        self._closed = False

    @property
    def group(self) -> dist.ProcessGroup:
        """The dedicated gloo group of DCP writes (which may run in the background thread),
        with ``collective_timeout``; agreements use another one (created on first use; collective)."""
        return self._ranks.background_group

    # -- agreement --------------------------------------------------------------------------

    def _agree(self, error: BaseException | None, label: str | None, payload: Any = None) -> list[Any]:
        """All ranks learn whether every rank succeeded; raise on every rank if not.
        Returns every rank's ``payload``. Collective, training thread, nothing in flight."""
        return self._ranks.agree(error, f"HF export {label}", payload)

    def settle(self) -> None:
        """Wait for this rank's export in flight, then agree with all ranks that every one
        succeeded; raise on every rank otherwise. Collective."""
        error: BaseException | None = None
        if self._worker is not None:
            try:
                self._worker.wait()
            except CheckpointWriteError as exc:
                error = exc
        label, self._pending = self._pending, None
        self._agree(error, label)

    def close(self, *, agree: bool, raise_failure: bool = True) -> None:
        """Finish the export in flight and free the thread and buffers. ``agree=True``
        (collective, e.g. at fit end) raises a failure of any rank on every rank;
        ``agree=False`` (e.g. on an exception, other ranks may be gone) is rank-local."""
        if self._closed:
            return
        self._closed = True
        try:
            if agree:
                self.settle()
        finally:
            worker, self._worker = self._worker, None
            if worker is not None:
                try:
                    worker.close()
                except BaseException as exc:
                    if raise_failure:
                        raise
                    log.error("HF export in flight failed too: %s", exc)

    # -- export -----------------------------------------------------------------------------

    def export(self, model: Any, final_dir: Path, tokenizer: Any = None,
               on_published: PublishHook | None = None, fsdp_root: torch.nn.Module | None = None) -> Path | None:
        """Export ``model`` to ``final_dir``; collective. Returns ``final_dir`` on rank 0
        (published for sync, scheduled for async), ``None`` on the other ranks.
        ``fsdp_root``: the FSDP1 module wrapping ``model`` (Lightning's ``FSDPStrategy``):
        its parameters are flat shards, so the weights come from torch's FSDP1 state dicts
        (see :func:`fsdp1_state`), with every rank taking part.

        Steps: settle the previous async export (all ranks); take the host copy or gather
        (training thread); agree that every rank is ready; then write (sync) and agree
        again, or submit the write to the background thread (async).
        ``on_published(final_dir, blocked_s)`` runs on rank 0 after the folder is published
        (in the background thread for async; ``blocked_s`` is ``None`` for sync)."""
        if self._closed:
            raise RuntimeError("DistributedHFExporter is closed")
        start = time.perf_counter()
        if self._worker is not None:
            self.settle()  # (a sync export already agreed when it finished)
        lead = dist.get_rank() == 0
        sharded = fsdp_root is not None or is_sharded(model)
        dcp_method = self.method == "dcp" and sharded
        error: BaseException | None = None
        write: Callable[[Path | None], Any] | None = None
        tmp: Path | None = None
        try:
            if dcp_method:
                write = self._prepare_dcp(model, final_dir, tokenizer, fsdp_root)
            else:
                write = self._prepare_rank0(model, final_dir, tokenizer, lead, fsdp_root)
            if lead and (dcp_method or self._worker is not None):
                tmp = prepare_tmp(final_dir)
        except (Exception, CheckpointException) as exc:
            error = exc
        try:
            payloads = self._agree(error, str(final_dir), str(tmp) if tmp is not None else None)
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        shared_tmp = Path(payloads[0]) if payloads[0] is not None else None
        if self._worker is not None:
            if write is not None:
                self._submit(lambda: write(shared_tmp), final_dir, lead, start, on_published)
            return final_dir if lead else None
        error = None
        try:
            if write is not None:
                write(shared_tmp)
                if lead and on_published is not None:
                    on_published(final_dir, None)
        except (Exception, CheckpointException) as exc:
            error = exc
        self._agree(error, str(final_dir))
        return final_dir if lead else None

    def _prepare_rank0(self, model: Any, final: Path, tokenizer: Any, lead: bool,
                       fsdp_root: torch.nn.Module | None) -> Callable[[Path | None], Any] | None:
        """Replicated weights: rank 0's own copy. Sharded: the streamed gather to rank 0
        (FSDP1: its full state dict, one unit at a time). Returns rank 0's write (``None``
        elsewhere)."""
        if fsdp_root is not None:
            staged = fsdp1_state(fsdp_root, model, full=True)  # collective: training thread
        elif is_sharded(model):
            staged = gather_to_host(export_state_dict(model))  # collective: training thread
        elif self._worker is not None and lead:
            staged = self._worker.stage_to_host(model.state_dict())
        else:
            staged = None  # sync: save_pretrained reads the live (replicated) weights
        if not lead:
            return None
        writer = self._writer_model(model, fsdp_root)
        return lambda tmp: export_hf(writer, final, tokenizer, state_dict=staged, max_shard_size=self.max_shard_size,
                                     tmp_dir=tmp)

    def _writer_model(self, model: Any, fsdp_root: torch.nn.Module | None) -> Any:
        """The model ``save_pretrained`` is called on: the live one, or for FSDP1 its
        :func:`meta_twin` (made once, on the training thread)."""
        if fsdp_root is None:
            return model
        if self._twin is None or self._twin[0] is not model:
            self._twin = (model, meta_twin(model))
        return self._twin[1]

    def _prepare_dcp(self, model: Any, final: Path, tokenizer: Any,
                     fsdp_root: torch.nn.Module | None) -> Callable[[Path | None], Any]:
        """Every rank writes its shards (see :func:`write_hf_dcp`); async: from host copies."""
        state = fsdp1_state(fsdp_root, model, full=False) if fsdp_root is not None else export_state_dict(model)
        assert state is not None
        shards, extras = split_for_dcp(state)
        plan = HFFilePlan(state, shards, self.max_shard_size)
        if self._worker is not None:
            staged = self._worker.stage_to_host({**shards, **extras})
            shards, extras = {k: staged[k] for k in shards}, {k: staged[k] for k in extras}
        group = self.group
        writer = self._writer_model(model, fsdp_root) if dist.get_rank() == 0 else model

        def write(tmp: Path | None) -> Any:
            assert tmp is not None
            return write_hf_dcp(writer, final, tokenizer, shards, extras, plan=plan, tmp_dir=tmp, process_group=group,
                                thread_count=self.thread_count)

        return write

    def _submit(self, job: Callable[[], Any], final: Path, lead: bool, start: float,
                on_published: PublishHook | None) -> None:
        assert self._worker is not None
        blocked = time.perf_counter() - start

        def run() -> None:
            job()
            if lead and on_published is not None:
                on_published(final, blocked)

        self._worker.submit(run, label=str(final))
        self._pending = str(final)
