"""DCP's THREAD against its PROCESS async checkpointer, and this package's two async executors.

Usage::

    python benchmarks/async_checkpointer.py [--mb 192] [--tensors N] [--saves 3] [--root /dev/shm/async_ckpt] [--json FILE]

A stock ``dcp.async_save`` (``FileSystemWriter``, two writer threads, fsync) of ``--mb`` MB
of fp32 tensors (4 MB each, or ``--tensors`` of them), one rank (a gloo process group of one: the PROCESS checkpointer refuses to
run without a default group), each checkpointer in its own process. While a save is in
flight the main thread keeps running a fixed step (a stand-in for training steps: matmuls,
which release the GIL, and 300 small in-place ops, whose Python dispatch holds it).
Per save: ``call_s`` (``async_save`` returns), ``durable_s``, and ``step_slowdown``, the
median loop time during the save divided by the same loop with no save running: what the
background save costs the training that overlaps it. The first save (PROCESS: spawning the
checkpoint process) is shown apart. ``ours_thread`` / ``ours_process``: ``DCPEngine`` async saves
(``async_executor="thread"`` / ``"process"``), which also report ``staged_s`` (the training may
change the weights again) against ``host_copy_s`` (the same tensors copied into preallocated
buffers). A table and JSON.
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


def _worker(kind: str, mb: float, saves: int, root: str, out: str, tensors: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    count = tensors or max(1, round(mb / 4))
    state = {f"w{i}": torch.randn(max(1, int(mb * 2**20 / 4 / count))) for i in range(count)}
    a, small = torch.randn(512, 512), torch.randn(16)

    def step() -> float:
        # a training step's two halves: kernels that release the GIL, and per-op Python
        # dispatch that holds it (a small model's step)
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        for _ in range(300):
            small.mul_(1.0001)
        return time.perf_counter() - start

    base = statistics.median(step() for _ in range(20))
    if kind.startswith("ours_"):
        _ours(kind[len("ours_"):], state, step, base, saves, root, out)
        dist.destroy_process_group()
        return
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


def _ours(executor: str, state: dict[str, Any], step: Any, base: float, saves: int, root: str, out: str) -> None:
    """This package's async save (``DCPEngine``, rank-local) with ``async_executor=executor``:
    besides DCP's measures, ``staged_s`` (the training may change the weights again) and
    ``host_copy_s``, a copy of the same tensors into preallocated host buffers (the peer)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from areal_lightning.write.dcp import DCPEngine

    buffers = {k: torch.empty_like(v) for k, v in state.items()}

    def host_copy() -> float:
        start = time.perf_counter()
        for k, v in state.items():
            buffers[k].copy_(v)
        return time.perf_counter() - start

    engine = DCPEngine(async_executor=executor)
    rows = []
    for i in range(saves):
        path = Path(root) / f"ours_{executor}{i}"
        shutil.rmtree(path, ignore_errors=True)
        copy_s = statistics.median(host_copy() for _ in range(3))
        start = time.perf_counter()
        engine.save(state, path, asynchronous=True)
        call = time.perf_counter() - start
        engine.wait_for_staging()
        staged = time.perf_counter() - start
        steps = []
        while engine.in_flight is not None:
            steps.append(step())
        engine.wait()
        rows.append({"call_s": call, "staged_s": staged, "host_copy_s": copy_s,
                     "durable_s": time.perf_counter() - start,
                     "step_slowdown": statistics.median(steps) / base if steps else 1.0})
        shutil.rmtree(path, ignore_errors=True)
    engine.close()
    Path(out).write_text(json.dumps(rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=192)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--tensors", type=int, default=0, help="tensors the MB are split into (0: 4 MB each)")
    parser.add_argument("--root", default="/dev/shm/async_ckpt")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.mb, args.saves, args.root, args.out, args.tensors)
        return 0
    from _report import write_json

    Path(args.root).mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    for kind in ("thread", "process", "ours_thread", "ours_process"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = Path(args.root) / f"{kind}.json"
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        subprocess.run([sys.executable, __file__, "--worker", kind, "--mb", str(args.mb), "--saves", str(args.saves),
                        "--tensors", str(args.tensors),
                        "--root", args.root, "--out", str(out)], env=env, check=True, timeout=600)
        saves = json.loads(out.read_text())
        later = saves[1:] or saves
        result[kind] = {"first": saves[0], **{k: statistics.median(r[k] for r in later) for k in saves[0]}}
    print(f"{'checkpointer':<13} {'call s':>7} {'staged s':>9} {'/host copy':>10} {'durable s':>9} "
          f"{'step slowdown':>13} {'first save durable s':>20}")
    for kind, r in result.items():
        staged = f"{r['staged_s']:>9.3f} {r['staged_s'] / r['host_copy_s']:>10.2f}" if "staged_s" in r else f"{'-':>9} {'-':>10}"
        print(f"{kind:<13} {r['call_s']:>7.3f} {staged} {r['durable_s']:>9.3f} {r['step_slowdown']:>13.2f} "
              f"{r['first']['durable_s']:>20.2f}")
    write_json(args.json, {"benchmark": "async_checkpointer", "mb": args.mb, "saves": args.saves,
                                 "tensors": args.tensors or max(1, round(args.mb / 4)), "results": result})
    shutil.rmtree(args.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
