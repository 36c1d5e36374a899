"""DCP's THREAD against its PROCESS async checkpointer: is the process one worth offering?

Usage::

    python benchmarks/async_checkpointer.py [--mb 192] [--saves 3] [--root /dev/shm/async_ckpt] [--json FILE]

A stock ``dcp.async_save`` (``FileSystemWriter``, two writer threads, fsync) of ``--mb`` MB
of fp32 tensors, one rank (a gloo process group of one: the PROCESS checkpointer refuses to
run without a default group), each checkpointer in its own process. While a save is in
flight the main thread keeps running a fixed matmul loop (a stand-in for training steps).
Per save: ``call_s`` (``async_save`` returns), ``durable_s``, and ``step_slowdown``, the
median loop time during the save divided by the same loop with no save running: what the
background save costs the training that overlaps it. The first save (PROCESS: spawning the
checkpoint process) is shown apart. A table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _worker(kind: str, mb: float, saves: int, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(max(1, round(mb / 4)))}
    a = torch.randn(512, 512)

    def step() -> float:
        start = time.perf_counter()
        for _ in range(20):
            a @ a
        return time.perf_counter() - start

    base = statistics.median(step() for _ in range(20))
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=kind == "process",
                                          use_async_staging=False, use_non_blocking_copy=False))
    rows = []
    for i in range(saves):
        path = Path(root) / f"{kind}{i}"
        shutil.rmtree(path, ignore_errors=True)
        start = time.perf_counter()
        response = dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(path, sync_files=True, thread_count=2), async_stager=stager,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS if kind == "process" else AsyncCheckpointerType.THREAD)
        call = time.perf_counter() - start
        upload = getattr(response, "upload_completion", response)
        steps = []
        while not upload.done():
            steps.append(step())
        upload.result()
        rows.append({"call_s": call, "durable_s": time.perf_counter() - start,
                     "step_slowdown": statistics.median(steps) / base if steps else 1.0})
        shutil.rmtree(path, ignore_errors=True)
    stager.close()
    Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=192)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--root", default="/dev/shm/async_ckpt")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.mb, args.saves, args.root, args.out)
        return 0
    from _report import write_json

    Path(args.root).mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    for kind in ("thread", "process"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = Path(args.root) / f"{kind}.json"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        subprocess.run([sys.executable, __file__, "--worker", kind, "--mb", str(args.mb), "--saves", str(args.saves),
                        "--root", args.root, "--out", str(out)], env=env, check=True, timeout=600)
        saves = json.loads(out.read_text())
        later = saves[1:] or saves
        result[kind] = {"first": saves[0], **{k: statistics.median(r[k] for r in later) for k in saves[0]}}
    print(f"{'checkpointer':<12} {'call s':>7} {'durable s':>9} {'step slowdown':>13} {'first save durable s':>20}")
    for kind, r in result.items():
        print(f"{kind:<12} {r['call_s']:>7.3f} {r['durable_s']:>9.3f} {r['step_slowdown']:>13.2f} "
              f"{r['first']['durable_s']:>20.2f}")
    write_json(args.json, {"benchmark": "async_checkpointer", "mb": args.mb, "saves": args.saves, "results": result})
    shutil.rmtree(args.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
