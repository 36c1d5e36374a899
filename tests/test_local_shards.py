"""The memory tier's slot of an FSDP2 rank (its ``DTensor`` shards, uneven and empty ones too) or an
FSDP1 rank (its ``ShardedTensor`` shards, none at all of some tensors) is
written by the tier's own copy, without DCP's planning (write/direct.py ``LocalShards``): its
``.metadata`` is the one DCP's rank-local save of the same state writes (every key's global size,
this rank's chunk offsets and sizes, dtypes, item keys), every item's CRC32C checks, and a load of
the slot into the live sharded state gives it back exactly. The Lightning runs that resume FSDP2 and
FSDP1 from the tier, and from the shared tier copied from its slots, are in tests/test_memory_tier.py."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.harness.launch import free_port

pytestmark = pytest.mark.slow


def _described(path: Path) -> tuple[dict, set]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    entries = {fqn: (tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks], md.properties.dtype)
               if isinstance(md, TensorStorageMetadata) else "bytes" for fqn, md in metadata.state_dict_metadata.items()}
    keys = {(index.fqn, tuple(index.offset) if index.offset is not None else None) for index in metadata.storage_data}
    return entries, keys


def _rank(rank: int, world: int, port: int, root: str, strategy: str, errors) -> None:
    try:
        _scenario(rank, world, port, Path(root) / f"rank{rank}", strategy)
    except BaseException:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def _local(value):
    if hasattr(value, "to_local"):
        return value.to_local()
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        return shards[0].tensor if shards else torch.zeros(0)
    return value


def _scenario(rank: int, world: int, port: int, root: Path, strategy: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from areal_lightning.commit.memory_tier import MemoryTier, verify_slot
    from areal_lightning.config import MemoryConfig
    from areal_lightning.write.dcp import DCPEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    # rows 7, 1 and 3 over 2 ranks: uneven shards, and rank 1 holds none of the 1-row weight
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 1), torch.nn.Linear(1, 3, bias=False))
    if strategy == "fsdp2":
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    else:  # FSDP1 on the CPU (ShardedTensor state dicts; a tensor can have no shard on a rank)
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(2):
        model(torch.randn(4, 5)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def state() -> dict:
        weights, optim = get_state_dict(model, optimizer)
        return {"state_dict": weights, "optimizer_states": [optim], "epoch": 1}

    tier = MemoryTier(MemoryConfig(enabled=True).validate(), root / "tier", rank)
    for step in (1, 2):
        tier.write(state(), global_step=step, world_size=world, lineage=None, info={})
        tier.wait()
        if step == 1:
            with torch.no_grad():
                for p in model.parameters():
                    _local(p).mul_(3)  # the next save holds other values
    assert tier._engine is None, "no slot was written by DCP"
    seal = max(tier.held(), key=lambda seal: seal.global_step)
    assert seal.global_step == 2
    problem, nbytes = verify_slot(seal)  # .metadata's CRC32C against the seal, then every item's
    assert problem is None and nbytes > 0
    slot = seal.path

    DCPEngine().save(state(), root / "planned")  # DCP's own rank-local save of the same state
    assert _described(slot) == _described(root / "planned")

    live = state()
    with torch.no_grad():
        for value in live["state_dict"].values():
            _local(value).zero_()
    loaded = DCPEngine().load(slot, template=live)
    expected = state()
    for key, value in expected["state_dict"].items():
        assert torch.equal(_local(loaded["state_dict"][key]), _local(value)), key
    for key, value in expected["optimizer_states"][0]["state"].items():
        for name, tensor in value.items():
            assert torch.equal(_local(loaded["optimizer_states"][0]["state"][key][name]), _local(tensor)), (key, name)
    tier.close()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp1"])
def test_an_fsdp_ranks_slot_is_written_without_planning_as_dcp_writes_it_and_loads_exactly(tmp_path, strategy) -> None:
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_rank, args=(2, free_port(), str(tmp_path), strategy, errors), nprocs=2)
    except Exception:  # noqa: BLE001 - the ranks' own tracebacks say more
        reports = []
        while not errors.empty():
            reports.append(errors.get())
        pytest.fail("\n".join(reports) or traceback.format_exc())
