"""Benchmark the per-step cost of the preemption agreement on 2 gloo ranks.

Usage::

    python benchmarks/preempt_agreement.py [--steps 2000] [--grad-mb 4] [--json FILE]

``RecoverCallback`` with preemption signals (SIGTERM by default) asks at every optimizer
step's end whether any rank received one: one all-reduce of one int32 on the checkpoint's
gloo group (:meth:`CheckpointGroup.any`). Rows, per step (median over ``--steps``):

  agreement        ``CheckpointGroup.any(False)``: what every step pays with no signal
  grad_allreduce   one all-reduce of ``--grad-mb`` MB of fp32 on the default gloo group:
                   DDP's gradient exchange of a small model, for scale
  barrier          ``dist.barrier()`` on the default group: the floor of any collective

``vs_grad``: a row's time / ``grad_allreduce``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, port: int, steps: int, grad_mb: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from areal_lightning.collective import CheckpointGroup

    ranks = CheckpointGroup()
    grad = torch.zeros(int(grad_mb * 2**20 / 4))

    def timed(fn, n: int) -> list[float]:
        for _ in range(min(50, n)):
            fn()
        out = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out

    rows = {
        "agreement": timed(lambda: ranks.any(False, "bench"), steps),
        "grad_allreduce": timed(lambda: dist.all_reduce(grad), max(steps // 20, 20)),
        "barrier": timed(dist.barrier, steps),
    }
    if rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in rows.items()}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--grad-mb", type=float, default=4.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(worker, args=(2, port, args.steps, args.grad_mb, out), nprocs=2, join=True)
    medians = json.loads(Path(out).read_text())
    os.unlink(out)
    print(f"2 gloo ranks on this machine, {args.steps} steps; gradient {args.grad_mb} MB")
    print(f"{'row':<16}{'us/step':>12}{'vs_grad':>10}")
    for name, value in medians.items():
        print(f"{name:<16}{value * 1e6:>12.1f}{value / medians['grad_allreduce']:>10.3f}")
    result = {"machine": {"python": sys.version.split()[0], "torch": torch.__version__,
                          "platform": platform.platform(), "cpus": os.cpu_count()},
              "steps": args.steps, "grad_mb": args.grad_mb, "median_s": medians}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
