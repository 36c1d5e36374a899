"""Benchmark HF export of an FSDP2-sharded model: streamed gather vs DCP's HF writer.

Usage::

    python benchmarks/hf_sharded_export.py --json benchmarks/results/hf_sharded_export.json \\
        [--repeats 3] [--layers 4] [--world-size 2] [--max-shard-size 5GB]

Spawns ``--world-size`` CPU processes (gloo), builds a randomly initialised Llama (hidden
768, vocab 32000, ``--layers`` decoder layers; about 77M parameters, 310 MB in fp32, at 4
layers) from a config on every rank and applies ``fully_shard`` to each decoder layer and to
the root, as a Lightning ``ModelParallelStrategy`` run would in ``configure_model``. Then it
exports it with :class:`areal_lightning.hf_export.HFExporter`, both methods
in the same run, interleaved, sync and async (config + tokenizer + weights, fsynced and
renamed into place, exactly what ``HFSaverCallback`` does):

  gather  streamed full gather (``full_tensor()`` tensor by tensor) to rank 0's host memory,
          rank 0 writes with ``save_pretrained``
  dcp     every rank writes its shards with DCP's ``HuggingFaceStorageWriter``
          (``save_distributed=True, enable_consolidation=True``), rank 0 consolidates

Columns (medians over interleaved repeats, max over ranks): ``blocked_s`` how long the
training thread is held (for async: until the host copy is taken and the write submitted),
``durable_s`` until the export is published and every rank is done. ``rank0_host_mb``: the
host copy rank 0 holds while the export runs (async; sync gather holds the same).
``vs_gather``: the row's time divided by the ``gather`` row of the same mode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = (("gather", False), ("dcp", False), ("gather", True), ("dcp", True))


def build_model(layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, args: argparse.Namespace, scratch: str, out_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.utils import logging as hf_logging

    from areal_lightning.capture.hf_weights import export_state_dict
    from areal_lightning.hf_export import HFExporter
    from areal_lightning.tools.demo import build_tokenizer

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(args.layers)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tokenizer = build_tokenizer()
    state = export_state_dict(model)
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    local_bytes = sum(t.to_local().numel() * t.element_size() for t in state.values())
    n_params = sum(t.numel() for t in state.values())

    exporters = {(m, a): HFExporter(method=m, asynchronous=a, max_shard_size=args.max_shard_size,
                                               name=f"bench-{m}-{a}") for m, a in ROWS}
    times: dict[str, list[tuple[float, float]]] = {f"{m}_{'async' if a else 'sync'}": [] for m, a in ROWS}
    root = Path(scratch)
    run = 0
    try:
        for repeat in range(args.repeats + 1):  # the first round warms buffers and groups; not timed
            for method, asynchronous in ROWS:
                exporter = exporters[(method, asynchronous)]
                final = root / f"r{run}" / "export"
                run += 1
                dist.barrier()
                t0 = time.perf_counter()
                exporter.export(model, final, tokenizer)
                blocked = time.perf_counter() - t0
                exporter.settle()
                durable = time.perf_counter() - t0
                both = torch.tensor([blocked, durable], dtype=torch.float64)
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
                if rank == 0:
                    shutil.rmtree(final.parent, ignore_errors=True)
                if repeat > 0:
                    times[f"{method}_{'async' if asynchronous else 'sync'}"].append((both[0].item(), both[1].item()))
    finally:
        for exporter in exporters.values():
            exporter.close(agree=False)
    if rank == 0:
        Path(out_file).write_text(json.dumps({"times": times, "full_bytes": full_bytes, "local_bytes": local_bytes,
                                              "params": n_params}))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp dir beside the JSON)")
    args = parser.parse_args(argv)

    import torch.multiprocessing as mp

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="hf_sharded_bench_", dir=args.dir or Path(args.json).resolve().parent))
    raw_file = scratch / "raw.json"
    try:
        mp.spawn(worker, args=(args.world_size, _free_port(), args, str(scratch), str(raw_file)),
                 nprocs=args.world_size, join=True)
        raw = json.loads(raw_file.read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    med = {name: (statistics.median(b for b, _ in runs), statistics.median(d for _, d in runs))
           for name, runs in raw["times"].items()}
    nbytes = raw["full_bytes"]
    results = []
    print(f"\nHF export of a {raw['params'] / 1e6:.0f}M-parameter Llama ({nbytes / 1e6:.0f} MB fp32), FSDP2 on "
          f"{args.world_size} gloo CPU ranks, median of {args.repeats}")
    print(f"{'method':<14} {'blocked_s':>10} {'durable_s':>10} {'GB/s':>6} {'rank0_host_mb':>14} "
          f"{'blocked_vs_gather':>18} {'durable_vs_gather':>18}")
    for method, asynchronous in ROWS:
        mode = "async" if asynchronous else "sync"
        blocked, durable = med[f"{method}_{mode}"]
        base_blocked, base_durable = med[f"gather_{mode}"]
        host = raw["full_bytes"] if method == "gather" else raw["local_bytes"]
        row = {"method": method, "mode": mode, "blocked_s": blocked, "durable_s": durable, "gbps": nbytes / durable / 1e9,
               "rank0_host_mb": host / 1e6, "blocked_vs_gather": blocked / base_blocked,
               "durable_vs_gather": durable / base_durable}
        results.append(row)
        print(f"{method + '_' + mode:<14} {blocked:>10.3f} {durable:>10.3f} {row['gbps']:>6.2f} {host / 1e6:>14.0f} "
              f"{row['blocked_vs_gather']:>18.2f} {row['durable_vs_gather']:>18.2f}")
    report = {
        "results": results,
        "model": {"params": raw["params"], "bytes": nbytes, "layers": args.layers},
        "world_size": args.world_size,
        "max_shard_size": args.max_shard_size,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "repeats": args.repeats,
        "raw": raw["times"],
    }
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
