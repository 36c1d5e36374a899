"""A collective save of replicated plain tensors without DCP's planning (write/spread.py), on real
gloo ranks: each rank writes its share and its own copies of the tensors that differ, rank 0 the
merged ``.metadata``; the checkpoint holds what a save planned by DCP holds (the same keys,
shapes, dtypes and per-rank copies), loads back on every rank as it was saved (by our loader and
by DCP's own), and a failure on one rank fails the save on every rank without a ``.metadata``.
Sync and async, 2 and 4 ranks. The Lightning runs of tests/test_per_rank.py and
tests/test_distributed.py save through it too (DDP, sync and async)."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.harness.launch import free_port

pytestmark = pytest.mark.slow


def _state(rank: int) -> dict:
    """What a DDP rank saves: equal weights of several dtypes and shapes (0-dim and empty too),
    BatchNorm statistics of its own, and Python values."""
    g = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(64 + 7 * i, generator=g) for i in range(24)}
    weights.update({"emb.weight": torch.randn(33, 5, generator=g).to(torch.bfloat16),
                    "mask": torch.rand(17, generator=g) > 0.5, "count": torch.tensor(12, dtype=torch.int64),
                    "empty": torch.zeros(0, 3), "scale": torch.tensor(0.5)})
    return {"state_dict": weights, "bn": {"running_mean": torch.full((6,), float(rank)),
                                          "num_batches": torch.tensor(10 + rank)},
            "epoch": 2, "loops": {"names": ["a", "b"], "done": True}}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _described(path: Path) -> dict:
    """Each saved key's dtype and size (None for a byte item), as DCP's reader gives them."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    return {fqn: (md.properties.dtype, tuple(md.size)) if isinstance(md, TensorStorageMetadata) else None
            for fqn, md in metadata.state_dict_metadata.items()}


def _rank(rank: int, world: int, port: int, root: str, asynchronous: bool, errors) -> None:
    try:
        _scenario(rank, world, port, Path(root), asynchronous)
    except BaseException:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def _scenario(rank: int, world: int, port: int, root: Path, asynchronous: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from areal_lightning.errors import AreaLightningError
    from areal_lightning.write import spread
    from areal_lightning.write.dcp import DCPEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    engine = DCPEngine(collective=True)

    def save(state: dict, name: str) -> Path:
        engine.save(state, root / name, asynchronous=asynchronous)
        if asynchronous:
            engine.wait_for_staging()
            live = state["state_dict"]["layer0.weight"]
            kept = live.clone()
            live.add_(1000)  # after staging: not in this save
            engine.wait_all("the test's save")
            live.copy_(kept)
        return root / name

    # 1. Spread: no plan made, every rank writes a share of the equal tensors and its own
    #    copies of those that differ; every rank loads back its own state.
    state = _state(rank)
    first = save(state, "first")
    assert not engine._plan_keys, "a spread save makes no DCP plan"
    plan = engine._spread
    assert plan is not None
    assert _equal(engine.load(first), state), "a rank's load gives back what it saved"
    dist.barrier()
    described = _described(first)
    per_rank = {f"areal_per_rank/{world}/{r}/bn.{k}" for r in range(1, world) for k in ("running_mean", "num_batches")}
    assert per_rank <= described.keys()
    from torch.distributed.checkpoint import FileSystemReader
    storage = FileSystemReader(str(first)).read_metadata().storage_data
    owners = {index.fqn: int(info.relative_path.split("_")[2]) for index, info in storage.items()}
    assert {owners[key] for key in owners if key.startswith("state_dict.")} == set(range(world)), \
        "every rank writes a share of the equal tensors"
    assert all(owners[key] == int(key.split("/")[2]) for key in per_rank), "each rank writes its own copies"
    assert owners["bn.running_mean"] == 0 and sum(1 for key in owners if key == "state_dict.layer3.weight") == 1

    # 2. Converted to torch's own layout (every item read and verified), DCP's reader loads it:
    #    rank 0's copy under the usual key, each per-rank copy under its key.
    if rank == 0:
        from areal_lightning import convert

        stock = convert(first, "dcp", root / "stock")
        template = {"state_dict.layer5.weight": torch.empty(99), "bn.running_mean": torch.empty(6),
                    f"areal_per_rank/{world}/{world - 1}/bn.running_mean": torch.empty(6)}
        dcp.load(template, checkpoint_id=str(stock), no_dist=True)
        assert torch.equal(template["state_dict.layer5.weight"], state["state_dict"]["layer5.weight"])
        assert torch.equal(template["bn.running_mean"], torch.zeros(6))
        assert torch.equal(template[f"areal_per_rank/{world}/{world - 1}/bn.running_mean"],
                           torch.full((6,), world - 1.0))

    # 2b. The next save reuses the plan; rank 1's CRC32Cs are in .metadata: a flipped byte in its
    #    file is found at load, naming the file.
    state["state_dict"]["layer1.weight"].mul_(2)
    second = save(state, "second")
    assert engine._spread is plan
    assert _equal(engine.load(second), state)
    dist.barrier()
    if rank == 1:
        victim = next(p for p in sorted(second.glob("__1_*.distcp")) if p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    dist.barrier()
    with pytest.raises(AreaLightningError, match=r"__1_\d\.distcp"):
        engine.load(second)

    # 3. The same keys, dtypes and sizes as DCP's planned save of the same state.
    original = spread.plan
    spread.plan = lambda *args, **kwargs: None  # every rank alike: DCP plans this one
    try:
        planned = save(_state(rank), "planned")
    finally:
        spread.plan = original
    assert engine._plan_keys, "that save was planned by DCP"
    dist.barrier()
    assert _described(planned) == described

    # 5. The tensors that differ change: a new plan, still exact (a copy of each rank's own shape).
    same = _state(0)  # the BatchNorm statistics are equal on every rank now
    same["bn"]["histogram"] = torch.arange(3 + rank)
    third = save(same, "third")
    assert engine._spread is not None and engine._spread is not plan
    assert [k for k in _described(third) if k.startswith("areal_per_rank/")] == \
        [f"areal_per_rank/{world}/{r}/bn.histogram" for r in range(1, world)]
    assert _equal(engine.load(third), same)

    # 6. A failure on one rank fails the save on every rank; no .metadata is written; the next
    #    save (the plan's first success) commits. The failing rank's plan was never confirmed.
    fresh = DCPEngine(collective=True)
    if rank == world - 1:
        os.environ["AREAL_LIGHTNING_FAULT"] = "engine.after_shard_file:raise"
    with pytest.raises(AreaLightningError, match="InjectedFault" if rank == world - 1 else f"rank {world - 1}"):
        fresh.save(state, root / "failed", asynchronous=asynchronous)
        fresh.wait_all("the failing save")
    os.environ.pop("AREAL_LIGHTNING_FAULT", None)
    dist.barrier()
    assert not (root / "failed" / ".metadata").exists()
    engine.close()
    engine = fresh
    after = save(state, "after")
    assert _equal(engine.load(after), state)

    # 6b. Rank 0 fails to write .metadata: every rank's wait() raises it (async: as DCP's planned
    #     save, whose .metadata is written inside its last collective), and the plan is made anew.
    if rank == 0:
        os.environ["AREAL_LIGHTNING_FAULT"] = "engine.before_commit:raise"
    with pytest.raises(AreaLightningError, match="InjectedFault" if rank == 0 else "rank 0"):
        engine.save(state, root / "uncommitted", asynchronous=asynchronous)
        engine.wait()
    os.environ.pop("AREAL_LIGHTNING_FAULT", None)
    dist.barrier()
    assert not (root / "uncommitted" / ".metadata").exists()
    assert _equal(engine.load(save(state, "committed")), state)

    # 7. A tensor a spread save does not take (quantized): DCP plans that save, which loads as it was.
    odd = _state(rank)
    odd["quantized"] = torch.quantize_per_tensor(torch.linspace(-1, 1, 8), 0.1, 0, torch.qint8)
    save(odd, "odd")
    assert engine._plan_keys and engine._spread is None
    assert _equal(engine.load(root / "odd"), odd)
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world,how", [(2, "sync"), (2, "async"), (4, "async")])
def test_a_collective_save_of_replicated_tensors_is_spread_without_planning_and_loads_exactly(tmp_path, world, how) -> None:
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_rank, args=(world, free_port(), str(tmp_path), how == "async", errors), nprocs=world)
    except Exception:  # noqa: BLE001 - the ranks' own tracebacks say more
        reports = []
        while not errors.empty():
            reports.append(errors.get())
        pytest.fail("\n".join(reports) or traceback.format_exc())


def _chunked(path: Path) -> dict:
    """Each saved key's dtype, global size and sorted chunks (offsets, sizes); None for a byte item."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    return {fqn: (md.properties.dtype, tuple(md.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
            if isinstance(md, TensorStorageMetadata) else None for fqn, md in metadata.state_dict_metadata.items()}


def _sharded_rank(rank: int, world: int, port: int, root: str, strategy: str, asynchronous: bool, errors) -> None:
    try:
        _sharded(rank, world, port, Path(root), strategy, asynchronous)
    except BaseException:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def _sharded(rank: int, world: int, port: int, root: Path, strategy: str, asynchronous: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from areal_lightning.write import spread
    from areal_lightning.write.dcp import DCPEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    # rows 7, 1 and 3 over the ranks: uneven shards, and some rank holds none of the 1-row weight;
    # a BatchNorm's statistics stay replicated tensors of each rank's own
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 1),
                                torch.nn.Linear(1, 3, bias=False))
    if strategy in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # HSDP: replicated over the mesh's first dimension, sharded over its second (of 1 rank)
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) if strategy == "hsdp" \
            else None
        for layer in (model[0], model[2], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(2):
        model(torch.randn(4, 5) + rank).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    extra = {}
    if strategy == "fsdp2":  # every rank holds an empty chunk of it, at the same offsets
        from torch.distributed.tensor import Shard, distribute_tensor

        extra["empty"] = distribute_tensor(torch.zeros(0, 3), init_device_mesh("cpu", (world,)), [Shard(0)])

    def state() -> dict:
        weights, optim = get_state_dict(model, optimizer)
        return {"state_dict": weights, "optimizer_states": [optim], "epoch": 1, **extra}

    def local(value):
        if hasattr(value, "to_local"):
            return value.to_local()
        if hasattr(value, "local_shards"):
            shards = value.local_shards()
            return shards[0].tensor if shards else None
        return value

    engine = DCPEngine(collective=True)

    def save(name: str) -> Path:
        engine.save(state(), root / name, asynchronous=asynchronous)
        engine.wait_all("the test's save")
        return root / name

    spread_path = save("spread")
    if strategy == "hsdp":  # every rank holds the same chunks: DCP plans the save (and de-duplicates them)
        assert engine._plan_keys and engine._spread is None
    else:
        assert not engine._plan_keys and engine._spread is not None, "a spread save makes no DCP plan"
    original = spread.plan
    spread.plan = lambda *args, **kwargs: None  # every rank alike: DCP plans this one
    try:
        planned = save("planned")
    finally:
        spread.plan = original
    assert engine._plan_keys
    dist.barrier()
    assert _chunked(spread_path) == _chunked(planned), "the keys, sizes, dtypes and chunks of DCP's save"
    per_rank = [k for k in _chunked(spread_path) if k.startswith("areal_per_rank/")]
    assert per_rank and all("running_mean" in k or "running_var" in k or "num_batches" in k for k in per_rank)

    want = state()
    live = state()
    with torch.no_grad():
        for value in live["state_dict"].values():
            tensor = local(value)
            if tensor is not None:
                tensor.zero_()
    loaded = engine.load(spread_path, template=live)
    for key, value in want["state_dict"].items():
        got, expected = local(loaded["state_dict"][key]), local(value)
        assert (got is None and expected is None) or torch.equal(got, expected), key
    for key, entry in want["optimizer_states"][0]["state"].items():
        for name, tensor in entry.items():
            got, expected = local(loaded["optimizer_states"][0]["state"][key][name]), local(tensor)
            assert (got is None and expected is None) or torch.equal(got, expected), (key, name)
    engine.close()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("strategy,how", [("fsdp2", "sync"), ("fsdp2", "async"), ("fsdp1", "sync"), ("hsdp", "sync")])
def test_a_collective_save_of_sharded_tensors_is_spread_as_dcp_would_write_it(tmp_path, strategy, how) -> None:
    """FSDP2 / FSDP1 on 2 ranks: each rank writes its own chunk of every sharded tensor (uneven
    and empty ones too) and its share of the replicated ones (BatchNorm statistics of its own:
    per-rank copies); the keys, sizes, dtypes and chunks are those of DCP's planned save of the
    same state, and a load into the live shards gives every rank its state back. HSDP (chunks
    replicated over ranks) is left to DCP, which de-duplicates them."""
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_sharded_rank, args=(2, free_port(), str(tmp_path), strategy, how == "async", errors), nprocs=2)
    except Exception:  # noqa: BLE001 - the ranks' own tracebacks say more
        reports = []
        while not errors.empty():
            reports.append(errors.get())
        pytest.fail("\n".join(reports) or traceback.format_exc())


def _swapped_rank(process: int, ports: tuple[int, int], root: str, errors) -> None:
    try:
        import torch.distributed as dist

        from areal_lightning.write.dcp import DCPEngine

        def state(rank: int) -> dict:
            return {"state_dict": {f"w{i}": torch.arange(8.0) * i for i in range(6)},
                    "bn": torch.full((4,), float(rank)), "epoch": 1}

        engine = DCPEngine(collective=True, collective_timeout=60)
        for rank, port, name in ((process, ports[0], "first"), (1 - process, ports[1], "swapped")):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            for n in range(2):
                engine.save(state(rank), Path(root) / f"{name}{n}")
                assert engine._spread is not None and engine._spread.layout.rank == rank
                assert _equal(engine.load(Path(root) / f"{name}{n}"), state(rank))
            dist.barrier()
            dist.destroy_process_group()
        engine.close()
    except BaseException:  # noqa: BLE001 - reported to the test
        errors.put(f"process {process}:\n{traceback.format_exc()}")
        raise


def test_a_process_whose_rank_changed_makes_its_plan_anew(tmp_path) -> None:
    """The process group re-made with the ranks swapped (same world size, same states): each
    process writes as its new rank, and the saves load back per rank."""
    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_swapped_rank, args=((free_port(), free_port()), str(tmp_path), errors), nprocs=2)
    except Exception:  # noqa: BLE001 - the ranks' own tracebacks say more
        reports = []
        while not errors.empty():
            reports.append(errors.get())
        pytest.fail("\n".join(reports) or traceback.format_exc())
