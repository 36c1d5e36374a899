"""Fixed costs per item: the same bytes in 20 tensors and in 2,000, saved and loaded.

Usage::

    python benchmarks/many_tensors.py --mb 64 --json benchmarks/results/many_tensors.json [--repeats 5] [--workdir /dev/shm]
        [--structure adam]

A checkpoint of ``--mb`` MB of fp32 tensors, split into ``--counts`` tensors (default 20 and
2000; ``--structure adam``: nested as a Lightning checkpoint of a model trained by Adam, a
quarter of them parameters, each with its two moments and its step in the optimizer's
state), written and read by each method; medians over interleaved repeats, after one warm-up
save per method (a training run's saves after the first reuse DCP's cached plan; one engine
per count, so the 20- and 2,000-tensor saves do not evict each other's cached layout):

  dcp_sync     ``DCPEngine.save``: durable and committed when it returns, each into a new folder
               beside the last one's (as a run's recover saves: ``.tmp-recover_checkpoint-{gen}``)
  dcp_load     ``DCPEngine.load`` into a template of the same tensors (what a resume does)
  torch_save   ``torch.save`` of the same dict + fsync (the peer)
  torch_load   ``torch.load`` of it
  memory_copy  the memory tier's slot write, the part training waits for (the copy into the
               slot's one mapped file: ``MemoryTier.write``), in a folder of ``--workdir``
  memory_slot  the same until the slot is sealed (every item's CRC32C, ``.metadata``, the seal)
  memory_fresh memory_copy of a state dict made just before the save, untimed, as RecoverCallback
               passes one (Lightning's ``state_dict()``: new tensor objects under new key strings);
               memory_copy passes the same objects every time

The point is the ratio ``many / few`` of each method (target for ours: <= 1.10): what a save
or a load pays per tensor, beyond its bytes. A table and JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_lightning.commit.memory_tier import MemoryTier  # noqa: E402
from areal_lightning.config import MemoryConfig  # noqa: E402
from areal_lightning.write.dcp import DCPEngine  # noqa: E402

METHODS = ("dcp_sync", "dcp_load", "torch_save", "torch_load", "memory_copy", "memory_slot", "memory_fresh")


def state_of(mb: int, count: int, structure: str = "flat") -> dict[str, Any]:
    """``mb`` MB of fp32 in ``count`` tensors. ``flat``: equal tensors, as a model's state dict.
    ``adam``: as a Lightning checkpoint of a model trained by Adam: ``count // 4`` parameters in
    ``state_dict`` (an ``OrderedDict``), and per parameter its ``exp_avg``, ``exp_avg_sq`` and
    scalar ``step`` in ``optimizer_states`` (the same bytes over the weights and both moments)."""
    gen = torch.Generator().manual_seed(count)
    if structure == "flat":
        numel = max(1, mb * 2**20 // 4 // count)
        return {"state_dict": {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(count)}, "step": 1}
    params = max(1, count // 4)
    numel = max(1, mb * 2**20 // 4 // (3 * params))
    weights = OrderedDict((f"model.layers.{i}.weight", torch.randn(numel, generator=gen)) for i in range(params))
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.randn(numel, generator=gen),
                 "exp_avg_sq": torch.rand(numel, generator=gen)} for i in range(params)}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(params))}]
    return {"epoch": 0, "global_step": 1, "state_dict": weights,
            "optimizer_states": [{"state": state, "param_groups": groups}], "lr_schedulers": [{"last_epoch": 1}]}


def fresh_state(state: Any) -> Any:
    """``state`` as ``state_dict()`` makes it at every call: each tensor a new object (detached)
    under a new key string, each dict and list new."""
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, dict):
        return type(state)((key[:1] + key[1:] if isinstance(key, str) else key, fresh_state(value))
                           for key, value in state.items())
    if isinstance(state, list):
        return [fresh_state(value) for value in state]
    return state


def _template(state: Any) -> Any:
    """``state`` with every tensor an empty one like it (what a resume loads into)."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return type(state)((key, _template(value)) for key, value in state.items())
    if isinstance(state, list):
        return [_template(value) for value in state]
    return state


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds of one call, after a full garbage collection: a collection that earlier work made
    due (about 50 ms of this process's heap) lands in no measured call by chance; the call's own
    garbage is still collected as it goes."""
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fsynced_save(state: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def measure(mb: int, counts: list[int], repeats: int, workdir: Path,
            structure: str = "flat") -> dict[int, dict[str, float]]:
    """Median seconds per method and count."""
    engines = {count: DCPEngine() for count in counts}  # one per state, as a training run's (its layout cached)
    states = {count: state_of(mb, count, structure) for count in counts}
    templates = {count: _template(s) for count, s in states.items()}
    times: dict[int, dict[str, list[float]]] = {count: {m: [] for m in METHODS} for count in counts}
    tiers = {count: MemoryTier(MemoryConfig(enabled=True).validate(), workdir / f"tier{count}", 0) for count in counts}

    def slot(count: int, state: dict[str, Any] | None = None) -> None:
        tiers[count].write(state or states[count], global_step=1, world_size=1, lineage=None, info={})

    def sealed(count: int) -> None:
        slot(count)
        tiers[count].wait()

    for count in counts:  # warm-up: plans cached, files exist, the slots mapped
        for n in range(2):
            engines[count].save(states[count], workdir / f"dcp{count}" / f"warm{n}")
        _fsynced_save(states[count], workdir / f"t{count}.pt")
        for _ in range(2):
            sealed(count)
    for repeat in range(repeats):
        for count in counts:
            # each save into a new folder beside the last one's, as a run's recover saves go
            dcp, pt = workdir / f"dcp{count}" / f"save{repeat}", workdir / f"t{count}.pt"
            row = times[count]
            row["dcp_sync"].append(_timed(lambda: engines[count].save(states[count], dcp)))
            row["dcp_load"].append(_timed(lambda: engines[count].load(dcp, template=templates[count])))
            shutil.rmtree(dcp)
            row["torch_save"].append(_timed(lambda: _fsynced_save(states[count], pt)))
            row["torch_load"].append(_timed(lambda: torch.load(pt, weights_only=True)))
            row["memory_copy"].append(_timed(lambda: slot(count)))
            tiers[count].wait()
            row["memory_slot"].append(_timed(lambda: sealed(count)))
            fresh = fresh_state(states[count])
            row["memory_fresh"].append(_timed(lambda: slot(count, fresh)))
            tiers[count].wait()
            del fresh
    for engine in engines.values():
        engine.close()
    for tier in tiers.values():
        tier.close()
    return {count: {m: statistics.median(v) for m, v in row.items()} for count, row in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="MB of fp32 tensors per checkpoint")
    parser.add_argument("--counts", default="20,2000", help="tensor counts to compare, few first")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats; medians are reported")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (e.g. /dev/shm)")
    parser.add_argument("--structure", choices=("flat", "adam"), default="flat",
                        help="flat: one dict of equal tensors; adam: a Lightning checkpoint with Adam's state")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results JSON")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    if args.mb < 1 or args.repeats < 1 or len(counts) < 2 or min(counts) < 1:
        parser.error("--mb and --repeats must be >= 1, --counts two or more counts >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="many_tensors_", dir=args.workdir))
    try:
        rows = measure(args.mb, counts, args.repeats, workdir, args.structure)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    few, many = counts[0], counts[-1]
    ratios = {m: rows[many][m] / rows[few][m] for m in METHODS}
    print(f"{args.mb} MB in {few} vs {many} tensors ({args.structure}) at {workdir.parent} (median of {args.repeats})")
    print(f"{'method':<12}" + "".join(f"{f'{c} tensors s':>16}" for c in counts) + f"{f'{many}/{few}':>12}")
    for m in METHODS:
        print(f"{m:<12}" + "".join(f"{rows[c][m]:>16.4f}" for c in counts) + f"{ratios[m]:>12.2f}")
    print(f"target: dcp_sync, dcp_load, memory_copy, memory_slot and memory_fresh {many}/{few} <= 1.10")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": {"mb": args.mb, "counts": counts, "repeats": args.repeats,
                                                "structure": args.structure,
                                                "workdir": str(workdir.parent)},
                                     "results": [{"count": c, **rows[c]} for c in counts],
                                     "ratios": ratios}, indent=2) + "\n")


if __name__ == "__main__":
    main()
