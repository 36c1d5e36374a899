"""Saves of FSDP2 shards without DCP's planning: the memory tier's save point and a collective save, against a host copy.

Usage::

    python benchmarks/sharded_slot.py --json benchmarks/results/sharded_slot.json [--layers 512] [--width 64]
        [--repeats 15] [--ranks 2] [--workdir /dev/shm]

``--ranks`` gloo processes train ``--layers`` ``Linear(width, width)`` layers, each sharded by
FSDP2's ``fully_shard``, with Adam (a state of ``3 x layers`` ``DTensor`` s, plus Adam's steps).
Each rank then times, interleaved, medians over ``--repeats``:

  tier_write   ``MemoryTier.write`` of the recover state (what the training step waits for: the
               local shards copied into the slot's mapped file, each item's CRC32C)
  dcp_local    ``DCPEngine.save`` of the same state, rank-local (DCP plans it item by item: what
               the tier did for sharded states before ``LocalShards``), into a new folder each time
  host_copy    the peer: ``copy_`` of every local shard into host buffers made once
  shared_spread  a collective sync save of the same state into a new folder (``DCPEngine(collective=True)``:
               spread over the ranks without planning, write/spread.py; every rank's call)
  shared_dcp   the same save planned by DCP (what it was before write/spread.py took sharded tensors)

and prints rank 0's table (the ratio is against ``host_copy``) and writes every rank's numbers
to the JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402

METHODS = ("tier_write", "dcp_local", "host_copy", "shared_spread", "shared_dcp")


def _rank(rank: int, args: argparse.Namespace, port: int, workdir: str, results: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from areal_lightning.commit.memory_tier import MemoryTier
    from areal_lightning.config import MemoryConfig
    from areal_lightning.write.dcp import DCPEngine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    model(torch.randn(4, args.width)).square().mean().backward()
    optimizer.step()
    weights, optim = get_state_dict(model, optimizer)
    state = {"state_dict": weights, "optimizer_states": [optim], "epoch": 0, "global_step": 1}

    def local(value: Any) -> torch.Tensor:
        return value.to_local() if hasattr(value, "to_local") else value

    shards = [local(v) for v in weights.values()]
    shards += [local(t) for s in optim["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    buffers = [torch.empty_like(t) for t in shards]
    root = Path(workdir) / f"rank{rank}"
    tier = MemoryTier(MemoryConfig(enabled=True).validate(), root / "tier", rank)
    engine = DCPEngine()
    shared = {False: DCPEngine(collective=True), True: DCPEngine(collective=True)}  # one each: its plan kept
    shared_root = Path(workdir) / "shared"
    from areal_lightning.write import spread

    spread_plan = spread.plan

    def collective(folder: Path, planned: bool) -> float:
        spread.plan = (lambda *a, **k: None) if planned else spread_plan  # every rank alike
        try:
            dist.barrier()
            start = time.perf_counter()
            shared[planned].save(state, folder)
            return time.perf_counter() - start
        finally:
            spread.plan = spread_plan
    times: dict[str, list[float]] = {m: [] for m in METHODS}

    def host_copy() -> None:
        with torch.no_grad():
            for buffer, tensor in zip(buffers, shards):
                buffer.copy_(tensor)

    for repeat in range(args.repeats + 2):  # the first two: warm-up (slots and layouts made)
        start = time.perf_counter()
        tier.write(state, global_step=repeat, world_size=args.ranks, lineage=None, info={})
        tier_s = time.perf_counter() - start
        tier.wait()
        folder = root / f"dcp{repeat}"
        start = time.perf_counter()
        engine.save(state, folder)
        dcp_s = time.perf_counter() - start
        shutil.rmtree(folder)
        start = time.perf_counter()
        host_copy()
        copy_s = time.perf_counter() - start
        spread_s = collective(shared_root / f"spread{repeat}", planned=False)
        planned_s = collective(shared_root / f"dcp{repeat}", planned=True)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(shared_root / f"spread{repeat}")
            shutil.rmtree(shared_root / f"dcp{repeat}")
        if repeat >= 2:
            times["tier_write"].append(tier_s)
            times["dcp_local"].append(dcp_s)
            times["host_copy"].append(copy_s)
            times["shared_spread"].append(spread_s)
            times["shared_dcp"].append(planned_s)
    tier.close()
    engine.close()
    for each in shared.values():
        each.close()
    results.put((rank, len(shards), sum(t.numel() * t.element_size() for t in shards),
                 {m: statistics.median(v) for m, v in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=512)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="where the tier and the DCP saves go (e.g. /dev/shm)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.layers, args.width, args.repeats) < 1 or args.ranks < 2:
        parser.error("--layers, --width, --repeats >= 1 and --ranks >= 2")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.harness.launch import free_port

    workdir = tempfile.mkdtemp(prefix="sharded_slot_", dir=args.workdir)
    results = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_rank, args=(args, free_port(), workdir, results), nprocs=args.ranks)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = {}
    while not results.empty():
        rank, tensors, nbytes, medians = results.get()
        rows[rank] = {"tensors": tensors, "mb": nbytes / 1e6, "median_s": medians,
                      "ratio_to_host_copy": {m: medians[m] / medians["host_copy"] for m in METHODS}}
    first = rows[0]
    print(f"FSDP2, {args.ranks} ranks, {args.layers} layers of {args.width} x {args.width} + Adam: rank 0 holds "
          f"{first['tensors']} local shards, {first['mb']:.1f} MB (median of {args.repeats}, workdir {workdir})")
    print(f"{'method':<14}{'ms':>10}{'/ host copy':>14}")
    for m in METHODS:
        print(f"{m:<14}{1000 * first['median_s'][m]:>10.2f}{first['ratio_to_host_copy'][m]:>14.2f}")
    write_json(args.json, {"benchmark": "sharded_slot", "layers": args.layers, "width": args.width,
                           "ranks": args.ranks, "repeats": args.repeats, "workdir": str(Path(workdir).parent),
                           "results": {str(rank): row for rank, row in sorted(rows.items())}})


if __name__ == "__main__":
    main()
