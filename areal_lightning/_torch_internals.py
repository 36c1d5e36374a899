"""The only module that touches the private names of torch (2.13), transformers, peft, the Azure
storage SDK and the standard library (Lightning's are in :mod:`areal_lightning.lightning._internals`).

Each function or constant below names the private it reads, builds or replaces; every one is
pinned by ``tests/test_torch_internals.py`` against the installed torch, so a torch upgrade
that moves one breaks one test with a clear name instead of a save or a resume.
``tests/test_internals.py`` checks that no other module of the package uses these names (as
``lightning/_internals.py`` is the only one for Lightning's).

Why each is needed (public torch has no equivalent):

* DCP's per-item storage record, ``torch.distributed.checkpoint.filesystem._StorageInfo``
  (file, offset, length, transform descriptors): a writer that lays out its own files must
  return one per item, and it is what ``.metadata`` pickles (readers of every version find it
  under that name).
* DCP's object-store file system, ``torch.distributed.checkpoint._fsspec_filesystem.FileSystem``
  (what ``FsspecWriter`` / ``FsspecReader`` use): subclassed for uploads that abort instead of
  publishing a truncated object.
* DCP's class-level plan caches (``DefaultSavePlanner(enable_plan_caching=True)``):
  ``SavePlanner._cached_save_plan`` and its four siblings, under the planner's
  ``_cached_plans_key`` (set per engine: the default, the class name, would be shared by every
  engine of the process), read to tell a dtype change (which DCP's plan comparison ignores;
  the changed plan is then sent as ``_pending_local_plan``) and dropped when an engine closes.
* FSDP1's sharded state dicts hold ``ShardedTensor`` s (module ``torch.distributed._shard``);
  an async save stages their local shards and rebuilds them around the staged copies with
  ``ShardedTensor._init_from_local_shards_and_global_metadata`` and the source's
  ``_process_group``.
* a batch carrying its worker's RNG states is pinned by the DataLoader's pin-memory thread
  through ``torch.utils.data._utils.pin_memory.pin_memory`` (what the DataLoader itself calls).
* DCP's event logger (``torch.distributed.checkpoint.logger._dcp_logger``) is created at
  DEBUG level with only a ``NullHandler`` and no propagation: every planning call of every
  item builds and discards two log records in the caller's (training) thread. Where nobody
  listens (no other handler) it is raised to INFO, which drops nothing anyone could see.
* ``dcp.save`` / ``dcp.async_save`` first pass every top-level value through
  ``_stateful_to_state_dict`` (a runtime-protocol ``isinstance`` and a logging wrapper with a
  fresh UUID per value: about a third of a save's fixed cost per tensor, and in an async save
  in the training thread); our flat dicts hold tensors and one skeleton object, never a
  ``Stateful``, so saves call what follows that pass, ``state_dict_saver._save_state_dict``,
  and loads ``state_dict_loader._load_state_dict`` (``dcp.load``'s protocol check of every
  value cost about 45 us per tensor).
* ``torch.compile``'s ``OptimizedModule`` holds the user's module as ``_orig_mod`` only; FSDP1 and
  activation checkpointing hold it as ``_fsdp_wrapped_module`` / ``_checkpoint_wrapped_module``,
  module-tree segments that torch's state-dict names leave out.
* transformers' ``save_pretrained`` reads instance state of the model it saves: the weight-name
  conversions (``_weight_conversions``) and PEFT's flag ``_hf_peft_config_loaded``; a meta twin
  saved in the live model's place carries them over.
* the standard library's ``warnings`` module caches filter decisions per call site until
  ``warnings._filters_mutated()`` is called (every public filter function calls it; removing a
  filter from ``warnings.filters`` does not).
* a CUDA runtime call that failed leaves its error as the runtime's "last error", which torch's
  check after the next kernel launch (``cudaGetLastError``) raises as that kernel's; torch's
  binding of ``cudaHostRegister`` returns the error without clearing it and binds no
  ``cudaGetLastError``, so :func:`clear_cuda_error` calls the one of the CUDA runtime torch
  loaded (found among the process's mapped libraries).
* the Azure storage SDK's retries (adlfs' ``BlobServiceClient``, ``azure-storage-blob``): its
  retry policy takes a per-retry hook only per call (adlfs passes none) and nothing public
  reports how many requests it retried; :func:`count_azure_retries` wraps ``increment`` of the
  client's policy instance, ``service_client._config.retry_policy`` (the one instance every
  container and blob client of it shares), to count the retries it grants.
* a slot of the memory tier, where its compiled one-pass copy is not built, copies its small
  tensors a group at a time, each group by one call that releases the GIL (``torch._foreach_copy_``, what torch's optimizers use): copied one by
  one, 2,000 tensors of 32 KB cost about 1 us of Python each, and threads copying them take
  turns at the GIL (measured in ``benchmarks/many_tensors.py``).
* a save that needs no plan reuses its layout while its tensors keep their keys, shapes, dtypes
  and kinds; reading those properties of each tensor from Python costs about 0.6 us per
  tensor at every save (2,000 tensors: 1.25 ms of a 6.3 ms slot write). ``torch.compile``'s
  guards check the same properties of many tensors in one call into C++
  (``torch._C._dynamo.guards.TensorGuards``: each tensor's type, dispatch keys, dtype, device,
  ``requires_grad``, sizes and strides; about 50 ns per tensor): :func:`tensor_check`.
* the same saves read every tensor's address (``data_ptr()``) at every save: about 0.15 us of
  Python per tensor, caches cold. torch exports the C function behind it for compiled code that
  does not include torch's headers (``torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr``:
  its address, what inductor's generated C++ wrappers call); the memory tier's compiled copy
  reads all addresses of a save by it in one call: :data:`DATA_PTR_FUNCTION`. That function
  throws a C++ exception for a tensor without storage (``torch.func``'s wrappers inside ``vmap``
  or ``grad`` are such tensors, yet of type ``torch.Tensor``, on the CPU and contiguous), which
  would abort the process from the extension's C frame; public torch tells that only by raising
  from ``untyped_storage()``: :func:`has_storage` (``torch._C._has_storage``).
* the exact data position: torch's DataLoader iterators read indices from
  ``DataLoader._index_sampler`` and are built by ``DataLoader._get_iterator``; a tracked loader
  overrides both in a subclass made with ``type()`` and takes it by a ``__class__`` swap
  (Lightning re-instantiates loaders, so the object itself is not ours to replace).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner

__all__ = ["PRIVATE_NAMES", "DATA_SUFFIX", "storage_info", "FsspecFileSystem", "set_plan_cache_key", "cached_save_plan",
           "send_changed_plan", "drop_plan_cache",
           "sharded_tensor_types", "rebuild_sharded_tensor", "sharded_tensor_group_size", "pin_memory", "original_module", "COMPILED_SEGMENT",
           "index_sampler", "loader_subclass", "swap_class", "quiet_dcp_debug_log", "save_flat_state_dict", "load_flat_state_dict",
           "WRAPPER_SEGMENTS", "HF_INSTANCE_STATE", "PEFT_LOADED_FLAG", "remove_warning_filter", "clear_cuda_error",
           "count_azure_retries", "copy_tensors", "tensor_check", "DATA_PTR_FUNCTION", "has_storage"]

PRIVATE_NAMES = ("_StorageInfo", "_fsspec_filesystem", "_cached_save_plan", "_cached_all_plans",
                 "_cached_global_plan", "_cached_metadata", "_cached_final_save_plan", "_cached_plans_key", "_pending_local_plan", "_shard",
                 "_init_from_local_shards_and_global_metadata", "_process_group", "_utils", "_orig_mod",
                 "_index_sampler", "_get_iterator", "_dcp_logger", "_save_state_dict", "_load_state_dict",
                 "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_weight_conversions",
                 "_hf_peft_config_loaded", "_filters_mutated", "_config", "_foreach_copy_", "_dynamo",
                 "_dispatch_tls_local_exclude_set", "_torchinductor_pyobject_tensor_data_ptr",
                 "_has_storage")
"""The private names of torch, transformers, peft, the Azure SDK and the standard library used here (and nowhere
else in the package)."""

DATA_SUFFIX = ".distcp"
"""The suffix of DCP's data files (``torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX``)."""

FsspecFileSystem = _FsspecFileSystem
"""torch's fsspec ``FileSystem`` of DCP (private module ``_fsspec_filesystem``)."""

COMPILED_SEGMENT = "_orig_mod"
"""The attribute (and state-dict name segment) of the module inside ``torch.compile``'s wrapper."""

WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", COMPILED_SEGMENT)
"""Module-tree segments that torch's state-dict names leave out (FSDP1, activation
checkpointing, ``torch.compile``'s ``OptimizedModule``)."""

PEFT_LOADED_FLAG = "_hf_peft_config_loaded"
"""transformers' instance flag: PEFT adapters were loaded into this ``PreTrainedModel``."""

HF_INSTANCE_STATE = ("_weight_conversions", "hf_quantizer", PEFT_LOADED_FLAG, "peft_config")
"""Instance state of a ``PreTrainedModel`` that its ``save_pretrained`` reads (weight-name
conversions, quantizer, PEFT adapters)."""


def remove_warning_filter(entry: Any) -> None:
    """Remove ``entry`` from ``warnings.filters`` (if present) and invalidate the per-call-site
    caches of filter decisions, as the public filter functions do (``warnings._filters_mutated``)."""
    import warnings

    if entry in warnings.filters:
        warnings.filters.remove(entry)
    mutated = getattr(warnings, "_filters_mutated", None)  # 3.11-3.13; 3.14 names it _filters_mutated_lock_held
    if callable(mutated):
        mutated()


_PLAN_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                "_cached_final_save_plan")


def save_flat_state_dict(state_dict: dict[str, Any], storage_writer: Any, planner: Any, *,
                         process_group: Any = None, no_dist: bool = False) -> Any:
    """``dcp.save(state_dict, storage_writer=..., planner=..., process_group=..., no_dist=...)``
    for a dict none of whose values is ``Stateful``, without ``dcp.save``'s per-value
    ``_stateful_to_state_dict`` pass (``state_dict_saver._save_state_dict``); returns DCP's
    ``Metadata``. ``no_dist`` is forced where no process group is initialized, as ``dcp.save``
    does."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    no_dist = no_dist or not dist.is_available() or not dist.is_initialized()
    return _save_state_dict(state_dict=state_dict, storage_writer=storage_writer, process_group=process_group,
                            no_dist=no_dist, planner=planner)


def load_flat_state_dict(state_dict: dict[str, Any], storage_reader: Any, planner: Any) -> None:
    """``dcp.load(state_dict, storage_reader=..., planner=..., no_dist=True)`` for a dict none
    of whose values is ``Stateful``, without ``dcp.load``'s per-value runtime-protocol
    ``isinstance`` (``state_dict_loader._load_state_dict``): the values are replaced in place."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _load_state_dict(state_dict=state_dict, storage_reader=storage_reader, planner=planner, no_dist=True)


def quiet_dcp_debug_log() -> bool:
    """Raise DCP's event logger from DEBUG to INFO where its records go nowhere (only
    ``NullHandler`` s, no propagation); returns whether it did. A user who attached a handler
    keeps the DEBUG events."""
    import logging

    from torch.distributed.checkpoint import logger as dcp_logging

    events = dcp_logging._dcp_logger
    if events.propagate or not all(isinstance(h, logging.NullHandler) for h in events.handlers) \
            or events.getEffectiveLevel() >= logging.INFO:
        return False
    events.setLevel(logging.INFO)
    return True


def storage_info(relative_path: str, offset: int, length: int, descriptors: Sequence[str] | None = None) -> Any:
    """DCP's record of one item (``_StorageInfo``): ``length`` bytes at ``offset`` of the data
    file ``relative_path``, encoded by the transform ``descriptors`` (``None``: a ``torch.save``
    container, what every reader takes)."""
    return _StorageInfo(relative_path, offset, length,
                        transform_descriptors=list(descriptors) if descriptors else None)


def set_plan_cache_key(planner: Any, cache_key: str) -> None:
    """File ``planner``'s cached plans under ``cache_key`` (``DefaultSavePlanner._cached_plans_key``,
    by default the class name, shared by every planner of that class in the process)."""
    planner._cached_plans_key = cache_key


def cached_save_plan(planner: Any) -> Any:
    """The local save plan DCP cached for ``planner``'s key (``SavePlanner._cached_save_plan``)."""
    return SavePlanner._cached_save_plan[planner._cached_plans_key]


def send_changed_plan(planner: Any, plan: Any) -> None:
    """Make ``plan`` the local plan ``planner`` sends as changed, and caches once the save's
    global plan is final (``plan`` and ``DefaultSavePlanner._pending_local_plan``)."""
    planner.plan = planner._pending_local_plan = plan


def drop_plan_cache(cache_key: str) -> None:
    """Forget DCP's cached plans under ``cache_key`` (all five class-level caches)."""
    for name in _PLAN_CACHES:
        getattr(SavePlanner, name).pop(cache_key, None)


def sharded_tensor_types() -> tuple[type, type]:
    """``(ShardedTensor, Shard)`` of ``torch.distributed._shard.sharded_tensor`` (FSDP1's)."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    return ShardedTensor, Shard


def sharded_tensor_group_size(value: Any) -> int:
    """The number of ranks a ``ShardedTensor`` is sharded over (its process group's size, read
    from ``ShardedTensor._process_group``: FSDP1's hybrid sharding shards within a node, and a
    collective save that writes each rank's shard without de-duplication must know whether
    another rank holds the same one)."""
    import torch.distributed as dist

    return dist.get_world_size(value._process_group)


def rebuild_sharded_tensor(shards: list[Any], metadata: Any, like: Any) -> Any:
    """A ``ShardedTensor`` of these local ``shards`` and global ``metadata``, on the process
    group of the ``ShardedTensor`` ``like`` (``_init_from_local_shards_and_global_metadata``)."""
    sharded, _shard = sharded_tensor_types()
    return sharded._init_from_local_shards_and_global_metadata(shards, metadata, process_group=like._process_group)


def pin_memory(data: Any) -> Any:
    """``data`` (nested) in pinned memory, as the DataLoader's pin-memory thread pins a batch."""
    from torch.utils.data._utils.pin_memory import pin_memory as pin

    return pin(data)


def original_module(module: Any) -> Any:
    """The module a ``torch.compile`` wrapper holds (``OptimizedModule._orig_mod``)."""
    return getattr(module, COMPILED_SEGMENT)


def index_sampler(loader: Any) -> Any:
    """What a DataLoader's iterators read indices from (``DataLoader._index_sampler``: the
    batch sampler when batched, else the sampler)."""
    return loader._index_sampler


def loader_subclass(cls: type, name: str, attrs: dict[str, Any], *,
                    index_sampler: Callable[[Any, Any], Any],
                    make_iterator: Callable[[Any, Callable[[], Any]], Any]) -> type:
    """A subclass of the DataLoader class ``cls`` (made with ``type()``, no extra base: its
    objects have ``cls``'s layout, so a loader can take it by :func:`swap_class`) whose
    ``_index_sampler`` is ``index_sampler(loader, inner)`` and whose ``_get_iterator`` is
    ``make_iterator(loader, build)`` (``inner``, ``build``: ``cls``'s own), with ``attrs``."""

    def _index_sampler(self: Any) -> Any:
        return index_sampler(self, super(sub, self)._index_sampler)

    def _get_iterator(self: Any) -> Any:
        return make_iterator(self, super(sub, self)._get_iterator)

    sub = type(name, (cls,), {**attrs, "_index_sampler": property(_index_sampler), "_get_iterator": _get_iterator})
    return sub


def swap_class(obj: Any, cls: type) -> None:
    """Give ``obj`` the class ``cls`` in place (one of the same layout: see :func:`loader_subclass`)."""
    object.__setattr__(obj, "__class__", cls)


def clear_cuda_error() -> int:
    """Reset the CUDA runtime's last error after a failed call whose error was handled
    (``cudaGetLastError`` of every ``libcudart`` this process loaded: torch's among them, which
    one is not known by name); returns the first error found (0: none, or no CUDA runtime)."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return 0
    found = 0
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            error = int(ctypes.CDLL(path).cudaGetLastError())
        except (OSError, AttributeError):
            continue
        found = found or error
    return found


def count_azure_retries(fs: Any, on_retry: Callable[[], None]) -> None:
    """Call ``on_retry()`` each time the Azure SDK under adlfs' file system ``fs`` retries a
    request (its retry policy's ``increment`` granting another attempt: throttling, 5xx,
    timeouts, connection errors; an ``increment`` that exhausts the retries is not counted)."""
    policy = fs.service_client._config.retry_policy
    increment = policy.increment

    def counted(settings: Any, *args: Any, **kwargs: Any) -> bool:
        again = increment(settings, *args, **kwargs)
        if again:
            on_retry()
        return again

    policy.increment = counted


def copy_tensors(destinations: Sequence[Any], sources: Sequence[Any]) -> None:
    """``destination.copy_(source)`` for each pair, in one call that releases the GIL
    (``torch._foreach_copy_``), outside autograd."""
    import torch

    with torch.no_grad():
        torch._foreach_copy_(list(destinations), list(sources))


def tensor_check(tensors: Sequence[Any]) -> Callable[..., bool] | None:
    """A check whether other tensors, as many, passed as positional arguments, each have the
    same Python type, dispatch keys (the conjugate and negative bits, sparse and quantized
    kinds, inference tensors), dtype, device, ``requires_grad``, sizes and strides as the
    corresponding one of ``tensors``: torch.compile's ``TensorGuards.check``, one call into C++
    that holds no reference to ``tensors``. It compares the keys as the calling thread's
    dispatch state shows them (a different state fails it); a state that excludes the
    negative or conjugate key (``torch._C._dispatch_tls_local_exclude_set``) would hide those
    bits, so there the check fails. ``None`` where this torch has none (the caller then reads
    the properties itself)."""
    try:
        import torch
        from torch._C._dynamo.guards import TensorGuards

        guards = TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        hidden = torch._C.DispatchKeySet(torch._C.DispatchKey.Negative).add(torch._C.DispatchKey.Conjugate)
        excluded = torch._C._dispatch_tls_local_exclude_set
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return None

    def check(*others: Any) -> bool:
        return not (excluded() & hidden).raw_repr() and guards.check(*others)

    return check


def _data_ptr_function() -> int | None:
    try:
        from torch._C._dynamo.guards import _torchinductor_pyobject_tensor_data_ptr as address
    except (ImportError, AttributeError):
        return None
    return address if isinstance(address, int) and address else None


DATA_PTR_FUNCTION: int | None = _data_ptr_function()
"""The address of torch's C function ``void *data_ptr(PyObject *tensor)``: a tensor's
``data_ptr()`` (0 where its storage was freed); for a non-tensor, or a tensor without storage,
it throws a C++ exception, so a caller gives it only tensors it checked (exact ``torch.Tensor``,
dense, on the CPU, with a storage: :func:`has_storage`). ``None`` where this torch exports none
(the caller reads ``data_ptr()`` in Python)."""


def has_storage(tensor: Any) -> bool:
    """Whether ``tensor`` has a storage (``torch._C._has_storage``): False for ``torch.func``'s
    batched and gradient wrappers, whose ``data_ptr()`` raises (and whose address torch's
    :data:`DATA_PTR_FUNCTION` cannot give without throwing)."""
    import torch

    return bool(torch._C._has_storage(tensor))
