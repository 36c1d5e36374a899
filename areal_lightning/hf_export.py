"""The HF export pipeline, one path for any world size: trigger -> capture -> stage -> write -> commit.

:class:`HFExporter` is what ``HFSaverCallback`` calls at each trigger, on one process or on
every rank of a ``torch.distributed`` run (DDP, FSDP1, FSDP2, DTensor): it captures the
weights (:mod:`areal_lightning.capture.hf_weights`), stages them to host memory for async
exports (:mod:`areal_lightning.stage`), writes them (:mod:`areal_lightning.write.hf`) and
commits the folder (:class:`~areal_lightning.commit.atomic.AtomicDir`). On one process every
agreement below is a no-op.

Every rank calls :meth:`HFExporter.export` for the same folder, in the same
order. The result is the layout of :func:`areal_lightning.write.hf.write_hf`: ``config.json``
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
    Before each async export (and at :meth:`HFExporter.close` with
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

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from areal_lightning._fault import fault_point
from areal_lightning.capture.hf_weights import (
    export_state_dict,
    fsdp1_state,
    gather_to_host,
    is_sharded,
    meta_twin,
    split_for_dcp,
)
from areal_lightning.capture.peft_weights import (
    adapter_entries,
    follow,
    is_peft,
    layer_merges,
    loaded,
    merged_state_dict,
    over_pretrained,
    peft_twin,
    plain_state,
)
from areal_lightning.collective import DEFAULT_TIMEOUT_S, CheckpointGroup
from areal_lightning.commit.atomic import AtomicDir
from areal_lightning.commit.upload import UploadCommit
from areal_lightning.config import DEFAULT_SHARDED_METHOD, SHARDED_METHODS
from areal_lightning.errors import CheckpointWriteError, ConfigError, UsageError
from areal_lightning.objectstore import is_remote
from areal_lightning.stage import BackgroundWorker
from areal_lightning.write.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    HFFilePlan,
    write_hf,
    write_hf_dcp,
    write_peft,
)

__all__ = ["HFExporter", "export_hf", "SHARDED_METHODS", "DEFAULT_SHARDED_METHOD", "PublishHook", "validate_method"]

log = logging.getLogger(__name__)


def _rank() -> int:
    """This process's rank (0 without an initialized process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


PublishHook = Callable[[Path, float | None], None]
"""Called on rank 0 once an export is published: ``(final_dir, blocked_s or None for sync)``."""


PEFT_EXPORTS = ("adapter", "merged", "both")
"""What an HF export of a PEFT model writes (see ``HFSaverCallback(peft_export=...)``)."""


def validate_peft_export(value: Any, field: str = "peft_export") -> str:
    """``value`` if it is one of :data:`PEFT_EXPORTS`, else :class:`ConfigError` naming ``field``."""
    if value not in PEFT_EXPORTS:
        raise ConfigError(field, f"unknown value {value!r}; allowed: {', '.join(PEFT_EXPORTS)}")
    return value


def commit_of(final: Any, tmp: Path | None = None, storage_options: Any = None,
              staging: Path | None = None) -> Any:
    """The commit of an export to ``final``: an :class:`AtomicDir` (local ``final``; its
    temporary folder ``tmp`` if already made), or on an object store an
    :class:`~areal_lightning.commit.upload.UploadCommit` (staged in ``staging``, uploaded, marked)."""
    if is_remote(final):
        return UploadCommit(str(final), storage_options, staging, tmp)
    return AtomicDir.of_tmp(tmp, final) if tmp is not None else AtomicDir(final)


def _write_and_publish(final: Path, write: Callable[[Path], Any], lead: bool, tmp: Path | None,
                       storage_options: Any = None, staging: Path | None = None) -> None:
    """The write stage fills the export's temporary folder (``tmp``, made by rank 0 and shared
    with the other ranks of a DCP export; else made here), then rank 0 commits it as ``final``
    (:class:`AtomicDir`: fsync, rename; an export of the same step is replaced; on an object
    store: upload, then the marker). On failure rank 0 removes the temporary folder; nothing
    appears under ``final``."""
    commit = commit_of(final, tmp, storage_options, staging)
    try:
        write(commit.create() if lead else commit.tmp)
        if lead:
            fault_point("hf.before_publish")
            commit.finalize()
    except BaseException:
        if lead:
            commit.discard()
        raise


def export_hf(model: Any, final_dir: Path, tokenizer: Any = None, state_dict: Any = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, tmp_dir: Path | None = None) -> Path:
    """One HF export of ``model`` (+ ``tokenizer``) on this process: :func:`~areal_lightning.write.hf.write_hf`
    into a temporary sibling (``tmp_dir``, if already made), committed as ``final_dir``; returns it.

    Example:
        >>> export_hf(model, Path("out/epoch0epochstep9globalstep9"), tokenizer)  # doctest: +SKIP
    """
    _write_and_publish(Path(final_dir), lambda folder: write_hf(model, folder, tokenizer, state_dict, max_shard_size),
                       True, tmp_dir)
    return Path(final_dir)


def validate_method(method: Any, field: str = "method") -> str:
    """Return ``method`` if it is one of :data:`SHARDED_METHODS`, else raise :class:`ConfigError` naming ``field``."""
    if method not in SHARDED_METHODS:
        raise ConfigError(field, f"unknown method {method!r}; allowed: {', '.join(SHARDED_METHODS)}")
    return method


# --------------------------------------------------------------------------------------
# Orchestration: sync / async, agreement


class HFExporter:
    """HF exports of one model, on one process or on every rank (see the module doc).

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
        peft_export: what a PEFT model's export writes (``adapter``, ``merged``, ``both``).
        storage_options: options of the object-store file system for ``s3://`` exports.
        staging: the node-local folder object-store exports are written in before their upload.

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
        peft_export: str = "adapter",
        storage_options: dict[str, Any] | None = None,
        staging: Path | None = None,
    ) -> None:
        self.method = validate_method(method)
        self.storage_options = dict(storage_options or {})
        self.staging = staging
        self.peft_export = validate_peft_export(peft_export)
        self.asynchronous = asynchronous
        self.max_shard_size = max_shard_size
        self.thread_count = thread_count
        self._worker: BackgroundWorker | None = BackgroundWorker(f"areal-hf-{name}") if asynchronous else None
        self._ranks = ranks if ranks is not None else CheckpointGroup(collective_timeout)
        self._own_ranks = ranks is None  # groups it made itself end with close()
        self._pending: str | None = None  # the folder of the export in flight (for messages)
        self._twin: tuple[Any, Any] | None = None  # (live model, its meta twin) for FSDP1
        self._peft_twin: tuple[Any, Any] | None = None  # (live PEFT model, its peft_twin)
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
            try:
                if worker is not None:
                    worker.close()
            except BaseException as exc:
                if raise_failure:
                    raise
                log.error("HF export in flight failed too: %s", exc)
            finally:
                if self._own_ranks:
                    self._ranks.close()

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
            raise UsageError("HFExporter.save: the exporter is closed (HFExporter.close was called); make a new one")
        start = time.perf_counter()
        if self._worker is not None:
            self.settle()  # (a sync export already agreed when it finished)
        lead = _rank() == 0
        sharded = fsdp_root is not None or is_sharded(model)
        dcp_method = self.method == "dcp" and sharded and not is_peft(model)  # PEFT: gathered (see _prepare_peft)
        error: BaseException | None = None
        write: Callable[[Path], Any] | None = None
        tmp: Path | None = None
        try:
            if dcp_method:
                write = self._prepare_dcp(model, tokenizer, fsdp_root)
            else:
                write = self._prepare_rank0(model, tokenizer, lead, fsdp_root)
            if lead and (dcp_method or self._worker is not None):
                tmp = commit_of(final_dir, None, self.storage_options, self.staging).create()
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
                self._submit(lambda: _write_and_publish(final_dir, write, lead, shared_tmp, self.storage_options,
                                                        self.staging), final_dir, lead, start, on_published)
            return final_dir if lead else None
        error = None
        try:
            if write is not None:
                _write_and_publish(final_dir, write, lead, shared_tmp, self.storage_options, self.staging)
                if lead and on_published is not None:
                    on_published(final_dir, None)
        except (Exception, CheckpointException) as exc:
            error = exc
        self._agree(error, str(final_dir))
        return final_dir if lead else None

    def _prepare_rank0(self, model: Any, tokenizer: Any, lead: bool,
                       fsdp_root: torch.nn.Module | None) -> Callable[[Path], Any] | None:
        """Replicated weights: rank 0's own copy. Sharded: the streamed gather to rank 0
        (FSDP1: its full state dict, one unit at a time). Returns rank 0's write (``None``
        elsewhere)."""
        if is_peft(model):
            return self._prepare_peft(model, tokenizer, lead, fsdp_root)
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
        return lambda folder: write_hf(writer, folder, tokenizer, state_dict=staged, max_shard_size=self.max_shard_size)

    def _prepare_peft(self, model: Any, tokenizer: Any, lead: bool,
                      fsdp_root: torch.nn.Module | None) -> Callable[[Path], Any] | None:
        """A PEFT model, under any strategy: its state dict (adapter entries only for an adapter
        export) is captured on the training thread: the live tensors (sync), a host copy
        (async), or the full tensors gathered to rank 0 (FSDP1: one unit at a time; FSDP2: one
        tensor at a time), whatever ``method``. Rank 0's write loads them into the model's
        :func:`peft_twin` to compute the merged weights and ``save_pretrained`` the files."""
        merged = self.peft_export in ("merged", "both")
        adapters = list(model.peft_config)
        sharded = is_sharded(model)
        if fsdp_root is not None:
            frozen = any(not p.requires_grad for p in adapter_entries(dict(model.named_parameters()), adapters).values())
            state = fsdp1_state(fsdp_root, model, full=True, trainable_only=not merged and not frozen)  # collective
        elif not lead and not sharded:
            return None  # replicated: rank 0 exports its own copy
        else:
            live = model.state_dict()
            live = live if merged else adapter_entries(live, adapters)
            if sharded:
                state = gather_to_host(live)  # collective: training thread
            elif self._worker is not None:
                state = self._worker.stage_to_host(live)
            else:
                state = {key: value.detach() for key, value in live.items()}  # sync: read in place
        if not lead:
            return None
        assert state is not None
        state = plain_state(state)
        merges = layer_merges(model) if merged else {}
        if not over_pretrained(model):
            twin = model  # a PEFT model over a plain module (adapter exports only) is written by itself
        else:
            if self._peft_twin is None or self._peft_twin[0] is not model or not follow(self._peft_twin[1], model):
                self._peft_twin = (model, peft_twin(model))
            twin = self._peft_twin[1]

        def write(folder: Path) -> None:
            merged_state = None
            if merged:
                with loaded(twin, state, merges):
                    merged_state = merged_state_dict(twin)
            adapter = adapter_entries(state, adapters) if self.peft_export != "merged" else None
            write_peft(twin, folder, tokenizer, adapter=adapter, merged=merged_state, max_shard_size=self.max_shard_size)

        return write

    def _writer_model(self, model: Any, fsdp_root: torch.nn.Module | None) -> Any:
        """The model ``save_pretrained`` is called on: the live one, or for FSDP1 its
        :func:`meta_twin` (made once, on the training thread)."""
        if fsdp_root is None:
            return model
        if self._twin is None or self._twin[0] is not model:
            self._twin = (model, meta_twin(model))
        return self._twin[1]

    def _prepare_dcp(self, model: Any, tokenizer: Any,
                     fsdp_root: torch.nn.Module | None) -> Callable[[Path], Any]:
        """Every rank writes its shards (see :func:`write_hf_dcp`); async: from host copies."""
        state = fsdp1_state(fsdp_root, model, full=False) if fsdp_root is not None else export_state_dict(model)
        assert state is not None
        shards, extras = split_for_dcp(state)
        plan = HFFilePlan(state, shards, self.max_shard_size)
        if self._worker is not None:
            staged = self._worker.stage_to_host({**shards, **extras})
            shards, extras = {k: staged[k] for k in shards}, {k: staged[k] for k in extras}
        group = self.group
        writer = self._writer_model(model, fsdp_root) if _rank() == 0 else model

        def write(folder: Path) -> None:
            write_hf_dcp(writer, folder, tokenizer, shards, extras, plan=plan, process_group=group,
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
