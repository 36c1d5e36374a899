"""Stage: copy a state dict to host memory, off the training thread.

:class:`HostStager` is the host copy of every async save (recover checkpoints, plain
``DCPCheckpointIO`` saves, HF exports): one long-lived ``DefaultStager``'s reused buffers
(pinned on CUDA, never shared memory), filled in the stager's own thread; ``ShardedTensor`` s
(FSDP1) through their local shards; on CUDA ordered after the caller's stream, on the
caller's device. It also is the ``async_stager`` ``dcp.async_save`` expects
(``stage`` -> future, ``synchronize_staging``, ``close``).
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from areal_lightning._torch_internals import clear_cuda_error, rebuild_sharded_tensor, sharded_tensor_types
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

__all__ = ["HostStager", "staging_options", "bind_thread_to", "cuda_device", "pin_buffers", "copy_into",
           "register_host", "unregister_host"]


def staging_options() -> StagingOptions:
    """Staging options for this build: pinned memory and non-blocking copies only where an
    accelerator exists (``DefaultStager()`` with default options raises on CPU-only builds).
    Never shared memory: saves run in a thread of this process (DCP's THREAD checkpointer),
    and ``/dev/shm`` is small in containers (64 MB by default in Docker: SIGBUS). The copy
    runs in :class:`HostStager`'s own thread, so the stager itself stages synchronously."""
    accel = torch.accelerator.is_available()
    return StagingOptions(
        use_pinned_memory=accel,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=accel,
    )


def cuda_device() -> torch.device | None:
    """The calling thread's current CUDA device, or ``None`` without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def bind_thread_to(device: torch.device | None) -> None:
    """Make a background thread use ``device`` (from :func:`cuda_device` in the thread that
    started it): a new thread's CUDA calls default to GPU 0, which would create a context
    there on every rank."""
    if device is not None:
        torch.cuda.set_device(device)


def register_host(address: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of host memory at ``address`` already allocated (a mapped file's
    pages, say) for CUDA (``cudaHostRegister``): device-to-host copies into it are then DMA
    transfers that run on a stream while the host goes on. ``False`` (nothing registered)
    without CUDA or where the driver refuses it; the memory stays usable, pageable."""
    if nbytes <= 0 or cuda_device() is None:
        return False
    if int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)) == 0:
        return True
    clear_cuda_error()  # else torch's check after the next kernel launch would raise it
    return False


def unregister_host(address: int) -> None:
    """Undo :func:`register_host` (before the memory is unmapped)."""
    if int(torch.cuda.cudart().cudaHostUnregister(address)) != 0:
        clear_cuda_error()


def pin_buffers() -> bool:
    """Whether host staging buffers are page-locked here (on CUDA; see :func:`staging_options`)."""
    return torch.cuda.is_available()


def pinning_possible() -> bool:
    """Whether a host tensor of this process can be page-locked: only with an accelerator
    (``torch.accelerator.is_available()``; without one ``pin_memory()`` raises, and
    ``is_pinned()`` is False for every tensor)."""
    return torch.accelerator.is_available()


def copy_into(buffers: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], *, ready: Any = None,
              stream: Any = None) -> None:
    """Copy each tensor of ``state`` into its buffer of ``buffers`` (same shape and dtype;
    one ``copy_`` each, no traversal or cache lookups), in the calling thread; returns once
    the copies are done. On CUDA (``stream`` given) the copies run on ``stream`` after the
    event ``ready`` recorded on the caller's stream (what training queued before the save)."""
    with torch.no_grad():
        if stream is None:
            for key, buffer in buffers.items():
                buffer.copy_(state[key].detach())
            return
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            for key, buffer in buffers.items():
                buffer.copy_(state[key].detach(), non_blocking=buffer.is_pinned())
        stream.synchronize()


def _unshard_views(state: Mapping[str, Any]) -> tuple[dict[str, Any], Callable[[Mapping[str, Any]], dict[str, Any]]]:
    """Replace every ``ShardedTensor`` (FSDP1's sharded state dicts) of a flat dict by its
    local shard tensors, which any stager copies; return that dict and the function that
    rebuilds the ``ShardedTensor`` s around the staged copies (same global metadata, shards
    placed on CPU). DCP's own stager cannot copy a ``ShardedTensor`` (it calls
    ``data_ptr()``, which ``ShardedTensor`` refuses)."""
    ShardedTensor, Shard = sharded_tensor_types()
    plain: dict[str, Any] = {}
    sharded: dict[str, tuple[ShardedTensor, list[str]]] = {}
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            keys = [f"{key}\x00shard{i}" for i in range(len(value.local_shards()))]
            for k, shard in zip(keys, value.local_shards()):
                plain[k] = shard.tensor
            sharded[key] = (value, keys)
        else:
            plain[key] = value
    if not sharded:
        return plain, dict

    def on_cpu(shard_meta: Any) -> Any:
        return dataclasses.replace(shard_meta, placement=f"rank:{shard_meta.placement.rank()}/cpu")

    def rebuild(staged: Mapping[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in staged.items() if "\x00shard" not in k}
        for key, (source, keys) in sharded.items():
            meta = copy.copy(source.metadata())
            meta.shards_metadata = [on_cpu(m) for m in meta.shards_metadata]
            if keys:  # the staged copies may be pinned (their source never is): ShardedTensor checks it
                meta.tensor_properties = dataclasses.replace(meta.tensor_properties,
                                                             pin_memory=staged[keys[0]].is_pinned())
            shards = [Shard(staged[k], on_cpu(s.metadata)) for k, s in zip(keys, source.local_shards())]
            out[key] = rebuild_sharded_tensor(shards, meta, source)
        return out

    return plain, rebuild


def _not_for_the_stager(value: Any) -> bool:
    """A tensor torch's ``DefaultStager`` copies wrongly: a quantized one (its copy has no
    quantizer: the write fails) or a lazily conjugated or negated view (its bytes are copied
    without the bit: the values change)."""
    return type(value) is torch.Tensor and (value.is_quantized or value.is_conj() or value.is_neg())


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor``'s values now, made by torch (in the caller's thread, at the save point),
    written from there instead of a staged buffer."""
    return tensor.detach().resolve_conj().resolve_neg().clone()


class HostStager:
    """Copies state dicts to long-lived host buffers in its own thread; implements the
    ``stage`` / ``synchronize_staging`` / ``close`` protocol ``dcp.async_save`` expects of
    an ``async_stager``.

    * Buffers come from one ``DefaultStager``, cached by source storage and reused by every
      later staging of the same tensors (no growth across saves); pinned on CUDA. (State
      dicts made of fresh copies at each save, such as FSDP1's, get fresh buffers.)
    * ``ShardedTensor`` s (FSDP1) are staged through their local shards.
    * Quantized tensors and lazily conjugated or negated views, which ``DefaultStager`` copies
      wrongly, are copied by torch at :meth:`stage` (see :func:`_not_for_the_stager`).
    * CUDA: the copy is ordered after the work queued so far on the caller's current
      stream (an event recorded at :meth:`stage`, waited for on the copying thread's
      stream), and the copying thread uses the caller's device.

    Use it from one thread. A staged dict stays valid until the next staging of the same
    tensors overwrites the buffers."""

    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self._stager: DefaultStager | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future | None = None
        self._stream: Any = None  # CUDA: the copy stream

    def stage(self, state_dict: Mapping[str, Any]) -> Future:
        """Start copying ``state_dict`` to host in the stager's thread; the future holds the copy."""
        if self._executor is None:
            self._stager = DefaultStager(staging_options())
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="areal-stage",
                                                initializer=bind_thread_to, initargs=(cuda_device(),))
        ready = stream = None
        if cuda_device() is not None:
            ready = torch.cuda.Event()
            ready.record()  # on the caller's current stream: what training queued so far
            if self._stream is None:
                self._stream = torch.cuda.Stream()  # created on the caller's thread and device
            stream = self._stream
        plain, rebuild = _unshard_views(state_dict)
        held = {key: _snapshot(value) for key, value in plain.items() if _not_for_the_stager(value)}
        if held:
            plain = {key: value for key, value in plain.items() if key not in held}
        stager = self._stager

        def copy_now() -> dict[str, Any]:
            if ready is None:
                staged = stager.stage(plain)
            else:
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    staged = stager.stage(plain)  # non-blocking copies on this stream, then a sync
            return rebuild({**staged, **held} if held else staged)

        self._last = self._executor.submit(copy_now)
        return self._last

    def synchronize_staging(self) -> None:
        """Wait for the last staging (DCP's protocol)."""
        if self._last is not None:
            concurrent.futures.wait([self._last])

    def stage_to_host(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``state_dict`` into the reused host buffers and return the copy (blocking)."""
        return self.stage(state_dict).result()

    def close(self) -> None:
        """Free the host buffers and the thread; the next use builds fresh ones."""
        self.synchronize_staging()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        self._last = None


