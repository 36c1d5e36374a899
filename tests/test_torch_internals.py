"""Pins every accessor of areal_lightning/_torch_internals.py against the installed torch.

One test per accessor (``test_<name>``): a torch upgrade that moves a private breaks the test
of that name, not a save or a resume. tests/test_internals.py checks that no other module of
the package uses these private names.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.utils.data import DataLoader

from areal_lightning import _torch_internals as ti


def test_every_accessor_is_pinned_here() -> None:
    here = sys.modules[__name__]
    missing = [name for name in ti.__all__ if not callable(getattr(here, f"test_{name.lower()}", None))]
    assert not missing, f"accessors of _torch_internals.py without a test_<name> here: {missing}"


def test_private_names() -> None:
    text = Path(ti.__file__).read_text()
    assert all(name in text for name in ti.PRIVATE_NAMES)


def test_data_suffix() -> None:
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

    assert ti.DATA_SUFFIX == DEFAULT_SUFFIX


def test_storage_info() -> None:
    info = ti.storage_info("__0_1.distcp", 64, 128, ["areal.raw/1"])
    again = pickle.loads(pickle.dumps(info))  # what .metadata holds
    assert (again.relative_path, again.offset, again.length, again.transform_descriptors) == \
        ("__0_1.distcp", 64, 128, ["areal.raw/1"])
    assert ti.storage_info("f", 0, 1).transform_descriptors is None  # a torch.save item, as DCP writes it


def test_fsspecfilesystem(tmp_path: Path) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    writer = FsspecWriter(f"file://{tmp_path}/ckpt")
    assert isinstance(writer.fs, ti.FsspecFileSystem)
    for method in ("create_stream", "init_path", "mkdir", "rename", "exists", "rm_file", "concat_path"):
        assert callable(getattr(ti.FsspecFileSystem, method)), method


def _cached_save(tmp_path: Path, key: str) -> DefaultSavePlanner:
    planner = DefaultSavePlanner(enable_plan_caching=True)
    ti.set_plan_cache_key(planner, key)
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp_path / key, planner=planner, no_dist=True)
    return planner


def test_set_plan_cache_key(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    _cached_save(tmp_path, "pin-key")
    assert "pin-key" in SavePlanner._cached_save_plan and "pin-key" in SavePlanner._cached_metadata
    ti.drop_plan_cache("pin-key")


def test_cached_save_plan(tmp_path: Path) -> None:
    planner = _cached_save(tmp_path, "pin-cached")
    plan = ti.cached_save_plan(planner)
    assert [item.index.fqn for item in plan.items] == ["w"]
    ti.drop_plan_cache("pin-cached")


def test_send_changed_plan(tmp_path: Path) -> None:
    planner = _cached_save(tmp_path, "pin-send")
    plan = ti.cached_save_plan(planner)
    ti.send_changed_plan(planner, plan)
    assert planner.plan is plan and planner._pending_local_plan is plan  # what DefaultSavePlanner caches
    ti.drop_plan_cache("pin-send")


def test_drop_plan_cache(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    _cached_save(tmp_path, "pin-drop")
    caches = [c for c in vars(SavePlanner).values() if isinstance(c, dict) and "pin-drop" in c]
    assert len(caches) >= 4  # every class-level cache that filed this key
    ti.drop_plan_cache("pin-drop")
    assert not any(isinstance(c, dict) and "pin-drop" in c for c in vars(SavePlanner).values())


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_network_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_tensor_types() -> None:
    sharded, shard = ti.sharded_tensor_types()
    assert sharded.__name__ == "ShardedTensor" and shard.__name__ == "Shard"
    assert callable(sharded.local_shards) and callable(sharded.metadata)


def test_rebuild_sharded_tensor(one_rank_group) -> None:
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharded_tensor.metadata import ShardMetadata

    sharded_cls, shard_cls = ti.sharded_tensor_types()
    local = shard_cls(torch.arange(6.0).view(2, 3), ShardMetadata([0, 0], [2, 3], "rank:0/cpu"))
    source = init_from_local_shards([local], [2, 3])
    copy = shard_cls(local.tensor.clone() + 1, local.metadata)
    rebuilt = ti.rebuild_sharded_tensor([copy], source.metadata(), source)
    assert isinstance(rebuilt, sharded_cls) and rebuilt.size() == source.size()
    assert torch.equal(rebuilt.local_shards()[0].tensor, local.tensor + 1)


def test_sharded_tensor_group_size(one_rank_group) -> None:
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharded_tensor.metadata import ShardMetadata

    _, shard_cls = ti.sharded_tensor_types()
    local = shard_cls(torch.arange(6.0).view(2, 3), ShardMetadata([0, 0], [2, 3], "rank:0/cpu"))
    assert ti.sharded_tensor_group_size(init_from_local_shards([local], [2, 3])) == 1  # the world's group here


def test_pin_memory() -> None:
    from torch.utils.data._utils import pin_memory as module

    assert hasattr(module, "_pin_memory_loop")  # the DataLoader's pin-memory thread calls this function
    batch = {"text": ["a", "b"], "n": 3}
    assert ti.pin_memory(batch) == batch  # non-tensors pass through; tensors need an accelerator to pin


def test_compiled_segment() -> None:
    compiled = torch.compile(torch.nn.Linear(2, 2))  # wrapping only: nothing is compiled until called
    assert all(key.startswith(f"{ti.COMPILED_SEGMENT}.") for key in compiled.state_dict())


def test_original_module() -> None:
    module = torch.nn.Linear(2, 2)
    assert ti.original_module(torch.compile(module)) is module


def test_index_sampler() -> None:
    batched = DataLoader(list(range(6)), batch_size=2)
    assert ti.index_sampler(batched) is batched.batch_sampler
    unbatched = DataLoader(list(range(6)), batch_size=None)
    assert ti.index_sampler(unbatched) is unbatched.sampler


def test_loader_subclass() -> None:
    seen = []

    def index_sampler(loader, inner):
        seen.append("sampler")
        return [[5, 4], [3, 2]] if inner is not None else inner

    def make_iterator(loader, build):
        seen.append("iterator")
        return build()

    loader = DataLoader(list(range(6)), batch_size=2)
    sub = ti.loader_subclass(DataLoader, "Probe", {"marker": True}, index_sampler=index_sampler,
                             make_iterator=make_iterator)
    assert sub.marker and sub.__mro__[1] is DataLoader
    ti.swap_class(loader, sub)
    assert [b.tolist() for b in loader] == [[5, 4], [3, 2]]  # torch's iterators read the index sampler
    assert seen[0] == "iterator" and "sampler" in seen


def test_swap_class() -> None:
    loader = DataLoader(list(range(4)), batch_size=2)
    sub = type("Sub", (DataLoader,), {})
    ti.swap_class(loader, sub)
    assert type(loader) is sub and [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    ti.swap_class(loader, DataLoader)
    assert type(loader) is DataLoader


def test_quiet_dcp_debug_log() -> None:
    import logging

    from torch.distributed.checkpoint import logger as dcp_logging

    events = dcp_logging._dcp_logger
    level = events.level
    try:
        events.setLevel(logging.DEBUG)  # as torch creates it, with a NullHandler only
        assert not events.propagate and all(isinstance(h, logging.NullHandler) for h in events.handlers)
        assert ti.quiet_dcp_debug_log() and not events.isEnabledFor(logging.DEBUG)
        events.setLevel(logging.DEBUG)
        listener = logging.StreamHandler()
        events.addHandler(listener)  # somebody listens: left as it is
        try:
            assert not ti.quiet_dcp_debug_log() and events.isEnabledFor(logging.DEBUG)
        finally:
            events.removeHandler(listener)
    finally:
        events.setLevel(level)


def test_load_flat_state_dict(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import state_dict_loader

    source = Path(state_dict_loader.__file__).read_text()
    assert "elem.state_dict() if isinstance(elem, Stateful) else elem" in source  # what dcp.load adds around it
    dcp.save({"w": torch.arange(4.0), "n": 3}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    loaded = {"w": torch.zeros(4), "n": 0}
    ti.load_flat_state_dict(loaded, FileSystemReader(tmp_path / "ckpt"), DefaultLoadPlanner())
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["n"] == 3


def test_save_flat_state_dict(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter, state_dict_saver

    source = Path(state_dict_saver.__file__).read_text()
    assert "state_dict=_stateful_to_state_dict(state_dict)" in source  # what dcp.save adds before it
    metadata = ti.save_flat_state_dict({"w": torch.arange(4.0), "n": 3}, FileSystemWriter(tmp_path / "ckpt"),
                                       DefaultSavePlanner())
    assert set(metadata.state_dict_metadata) == {"w", "n"}
    loaded = {"w": torch.zeros(4)}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(4.0))


def test_wrapper_segments(one_rank_group) -> None:
    """FSDP1 and activation checkpointing hold the wrapped module under these names, and
    torch's state-dict names leave them out."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FullyShardedDataParallel

    inner = torch.nn.Linear(2, 2)
    wrapped = torch.nn.Sequential(checkpoint_wrapper(inner))
    fsdp = FullyShardedDataParallel(wrapped, device_id=torch.device("cpu"))
    names = dict(fsdp.named_modules())
    assert any(ti.WRAPPER_SEGMENTS[0] in n for n in names) and any(ti.WRAPPER_SEGMENTS[1] in n for n in names)
    assert not any(seg in key for key in fsdp.state_dict() for seg in ti.WRAPPER_SEGMENTS)
    assert ti.WRAPPER_SEGMENTS[2] == ti.COMPILED_SEGMENT


def test_hf_instance_state() -> None:
    """``save_pretrained`` reads these instance attributes of the model it saves."""
    import inspect

    from transformers import PreTrainedModel

    source = inspect.getsource(PreTrainedModel.save_pretrained)
    assert "_weight_conversions" in source or "weight_conversions" in inspect.getsource(
        sys.modules[PreTrainedModel.__module__])
    assert "hf_quantizer" in source
    assert ti.PEFT_LOADED_FLAG in ti.HF_INSTANCE_STATE


def test_peft_loaded_flag() -> None:
    """transformers sets the flag when a PEFT adapter is loaded into a ``PreTrainedModel``."""
    import inspect

    from transformers.integrations import peft as hf_peft

    assert f"self.{ti.PEFT_LOADED_FLAG} = True" in inspect.getsource(hf_peft)


def test_remove_warning_filter() -> None:
    """A removed filter no longer hides a warning from a call site that hit it before."""
    import warnings

    def emit() -> None:
        warnings.warn("areal test warning 7f3a", UserWarning, stacklevel=1)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="areal test warning 7f3a")
        entry = warnings.filters[0]
        with warnings.catch_warnings(record=True) as caught:
            emit()
        assert caught == []
        ti.remove_warning_filter(entry)
        assert entry not in warnings.filters
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            emit()
        assert len(caught) == 1


def test_clear_cuda_error() -> None:
    # torch binds cudaHostRegister but not cudaGetLastError (what a handled failure must be cleared with)
    if not torch.cuda.is_available():
        assert ti.clear_cuda_error() == 0  # no CUDA runtime loaded: nothing to clear
        return
    cudart = torch.cuda.cudart()
    assert not hasattr(cudart, "cudaGetLastError")
    x = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
    assert int(cudart.cudaHostRegister(x.data_ptr(), x.numel(), 0)) != 0  # already page-locked: refused
    assert ti.clear_cuda_error() != 0  # that error, cleared
    assert ti.clear_cuda_error() == 0
    torch.ones(4, device="cuda").add_(1)  # the next kernel launch's check sees no error
    torch.cuda.synchronize()


def test_count_azure_retries() -> None:
    # adlfs' client: the retry policy instance of its config, whose increment grants a retry
    pytest.importorskip("adlfs")
    from adlfs import AzureBlobFileSystem
    from azure.core.exceptions import ServiceRequestError
    from azure.core.pipeline import PipelineContext, PipelineRequest
    from azure.core.rest import HttpRequest

    from tests.harness.stores import AZURITE_ACCOUNT, AZURITE_KEY

    fs = AzureBlobFileSystem(connection_string=f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                                               f"AccountKey={AZURITE_KEY};BlobEndpoint=http://127.0.0.1:9/x;",
                             skip_instance_cache=True)
    counted = []
    ti.count_azure_retries(fs, lambda: counted.append(1))
    policy = fs.service_client._config.retry_policy
    request = HttpRequest("GET", "http://127.0.0.1:9/x/c/b")
    settings = policy.configure_retries(PipelineRequest(request, PipelineContext(None)))
    assert policy.increment(settings, request=request, error=ServiceRequestError("refused")) is True
    assert counted == [1]


def test_copy_tensors() -> None:
    """Pairs of any shape and dtype, sources needing grad or not contiguous: each copied into its
    destination, which stays outside autograd."""
    sources = [torch.randn(3, 4, requires_grad=True), torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),
               torch.tensor(True), torch.randn(5, dtype=torch.bfloat16)]
    destinations = [torch.empty_like(s, memory_format=torch.contiguous_format).detach() for s in sources]
    ti.copy_tensors(destinations, sources)
    for destination, source in zip(destinations, sources):
        assert torch.equal(destination, source.detach()) and not destination.requires_grad


def test_tensor_check() -> None:
    """Alike tensors (new objects, other values and storage offsets) pass; each property the
    check is relied on for fails it: type, dtype, device, requires_grad, sizes, strides, the
    negative and conjugate bits (also where the thread's dispatch state excludes those keys),
    sparse layout, an inference tensor. It holds no reference to the tensors it was made from."""
    import gc
    import weakref

    made = [torch.randn(3, 4), torch.randn(6, dtype=torch.complex64), torch.tensor(2.0), torch.empty(0)]
    check = ti.tensor_check(made)
    assert check is not None
    gone = weakref.ref(made[0])
    del made
    gc.collect()
    assert gone() is None
    alike = [torch.randn(20)[4:16].view(3, 4), torch.zeros(6, dtype=torch.complex64), torch.tensor(5.0), torch.empty(0)]
    assert check(*alike)
    with torch.inference_mode():
        inference = torch.randn(3, 4)
    for change in (lambda t: torch.nn.Parameter(t), lambda t: t.double(), lambda t: t.to("meta"),
                   lambda t: t.clone().requires_grad_(), lambda t: t.reshape(4, 3), lambda t: t.t().contiguous().t(),
                   lambda t: torch._neg_view(t), lambda t: t.to_sparse(), lambda t: inference):
        assert not check(change(alike[0]), *alike[1:])
    assert not check(alike[0], alike[1].conj(), *alike[2:])
    # a thread-local dispatch state that hides a tensor's negative or conjugate bit from the
    # guard's key comparison: the check fails (never a pass for a lazily negated view)
    for key, view in ((torch._C.DispatchKey.Negative, lambda: (torch._neg_view(alike[0]), *alike[1:])),
                      (torch._C.DispatchKey.Conjugate, lambda: (alike[0], alike[1].conj(), *alike[2:]))):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            assert not check(*view())
    assert check(*alike)


def test_data_ptr_function() -> None:
    """An exported C function that gives a tensor's data_ptr(), its storage offset included; 0
    for a tensor whose storage was freed."""
    import ctypes

    assert isinstance(ti.DATA_PTR_FUNCTION, int)
    data_ptr = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(ti.DATA_PTR_FUNCTION)  # the GIL held
    tensors = [torch.randn(100), torch.arange(10, dtype=torch.int16)[3:], torch.randn(4, 5).t(), torch.tensor(1.5)]
    assert [data_ptr(t) for t in tensors] == [t.data_ptr() for t in tensors]
    freed = torch.ones(10)
    freed.untyped_storage().resize_(0)
    assert not data_ptr(freed) and freed.data_ptr() == 0


def test_has_storage() -> None:
    """True for plain, viewed, freed and functional tensors; False for torch.func's wrappers
    inside vmap and grad (whose data_ptr() raises)."""
    freed = torch.ones(3)
    freed.untyped_storage().resize_(0)
    assert all(ti.has_storage(t) for t in (torch.ones(2), torch.ones(4)[1:], freed))
    seen = []
    torch.func.vmap(lambda x: seen.append(ti.has_storage(x)) or x.sum())(torch.ones(3, 4))
    torch.func.grad(lambda x: seen.append(ti.has_storage(x)) or x.sum())(torch.ones(4))
    torch.func.functionalize(lambda x: seen.append(ti.has_storage(x)) or x)(torch.ones(4))
    assert seen == [False, False, True]
