"""Benchmark checkpoint writes and reads: our DCP engine against the disk, memcpy and Lightning.

Usage::

    python benchmarks/checkpoint_io.py --size-mb 256 --json benchmarks/results/checkpoint_io_256mb.json [--repeats 3]

The state is ``--size-mb`` MB of fp32 parameters (16 MB tensors) plus an Adam-like
optimizer state (``exp_avg`` and ``exp_avg_sq`` per parameter, and a step counter), laid
out as a Lightning checkpoint dict: about 3x ``--size-mb`` MB is written per save.

Rows (medians over interleaved repeats; every method runs once per repeat, in turn):
  raw_fsync        one plain file write of the same bytes + fsync: the disk's limit
  host_copy        one memcpy of the state into warm, reused buffers: the staging limit
  torch_save       Lightning ``TorchCheckpointIO.save_checkpoint`` + fsync of the file
  lightning_async  Lightning ``AsyncCheckpointIO(TorchCheckpointIO())``; durable after
                   its teardown + fsync
  dcp_sync         ``DCPEngine.save`` (``dcp.save``); returns durable and committed
  dcp_async        ``DCPEngine.save(asynchronous=True)`` + ``wait_for_staging`` (blocked),
                   then ``wait`` (durable)
  raw_read         plain read of the raw file into memory, page cache dropped first
  torch_load       Lightning ``TorchCheckpointIO.load_checkpoint``, cache dropped first
  dcp_load         ``DCPEngine.load``, cache dropped first

``blocked_s``: how long the caller's training loop is held, including the wait for staging
before its next optimizer step, assuming NO compute to overlap it with (worst case; with a
``StagingWaitCallback`` the copy overlaps forward/backward). ``call_s`` (extra field): how
long the save call alone holds the caller. ``durable_s``: until the data is fsynced and the
checkpoint committed (``null`` for rows with nothing to persist). ``gbps``: bytes moved /
``durable_s`` (or ``blocked_s`` for memory and load rows), in GB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from areal_lightning.write.dcp import DCPEngine  # noqa: E402

TENSOR_MB = 16
SAVE_METHODS = ("raw_fsync", "host_copy", "torch_save", "lightning_async", "dcp_sync", "dcp_async")
LOAD_METHODS = ("raw_read", "torch_load", "dcp_load")


def build_state(size_mb: int) -> dict[str, Any]:
    """A Lightning-shaped checkpoint: ``size_mb`` MB of fp32 params + Adam moments."""
    numel = TENSOR_MB * 2**20 // 4
    count = max(1, size_mb // TENSOR_MB)
    gen = torch.Generator().manual_seed(0)
    params = {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(count)}
    state = {
        i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(numel, generator=gen), "exp_avg_sq": torch.rand(numel, generator=gen)}
        for i in range(count)
    }
    return {
        "epoch": 0,
        "global_step": 10,
        "state_dict": params,
        "optimizer_states": [{"state": state, "param_groups": [{"lr": 1e-3, "params": list(range(count))}]}],
    }


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """All tensors in a nested checkpoint, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: Path) -> None:
    """Evict ``path`` (a file or every file under a directory) from the page cache."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Bench:
    """Runs each method, returning ``(call_s, blocked_s, durable_s)`` per run."""

    def __init__(self, state: dict[str, Any], workdir: Path, thread_count: int) -> None:
        self.state = state
        self.tensors = tensors_of(state)
        self.nbytes = sum(t.nbytes for t in self.tensors)
        self.dir = workdir
        self.engine = DCPEngine(thread_count=thread_count)
        self.host = [torch.empty_like(t) for t in self.tensors]
        for buf, src in zip(self.host, self.tensors):  # warm the buffers: staging reuses its own too
            buf.copy_(src)

    def _fresh(self, name: str) -> Path:
        path = self.dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        return path

    def raw_fsync(self) -> tuple[float, float, float]:
        path = self._fresh("raw.bin")
        start = time.perf_counter()
        with open(path, "wb") as f:
            for t in self.tensors:
                f.write(t.numpy().data)
            f.flush()
            os.fsync(f.fileno())
        took = time.perf_counter() - start
        return took, took, took

    def host_copy(self) -> tuple[float, float, None]:
        start = time.perf_counter()
        for buf, src in zip(self.host, self.tensors):
            buf.copy_(src)
        took = time.perf_counter() - start
        return took, took, None

    def torch_save(self) -> tuple[float, float, float]:
        path = self._fresh("torch.ckpt")
        start = time.perf_counter()
        TorchCheckpointIO().save_checkpoint(self.state, path)
        fsync_file(path)
        took = time.perf_counter() - start
        return took, took, took

    def lightning_async(self) -> tuple[float, float, float]:
        path = self._fresh("lightning_async.ckpt")
        io = AsyncCheckpointIO(TorchCheckpointIO())
        start = time.perf_counter()
        io.save_checkpoint(self.state, path)  # clones every tensor on the caller thread
        blocked = time.perf_counter() - start
        io.teardown()  # its only way to wait
        fsync_file(path)
        return blocked, blocked, time.perf_counter() - start

    def dcp_sync(self) -> tuple[float, float, float]:
        path = self._fresh("dcp_sync")
        start = time.perf_counter()
        self.engine.save(self.state, path)
        took = time.perf_counter() - start
        return took, took, took

    def dcp_async(self) -> tuple[float, float, float]:
        path = self._fresh("dcp_async")
        start = time.perf_counter()
        self.engine.save(self.state, path, asynchronous=True)
        call = time.perf_counter() - start
        self.engine.wait_for_staging()
        blocked = time.perf_counter() - start
        self.engine.wait()
        return call, blocked, time.perf_counter() - start

    def raw_read(self) -> tuple[float, float, None]:
        path = self.dir / "raw.bin"
        drop_cache(path)
        start = time.perf_counter()
        buf = torch.empty(self.nbytes, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            view = memoryview(buf.numpy()).cast("B")
            got = 0
            while got < self.nbytes:
                got += f.readinto(view[got:])
        took = time.perf_counter() - start
        return took, took, None

    def torch_load(self) -> tuple[float, float, None]:
        path = self.dir / "torch.ckpt"
        drop_cache(path)
        start = time.perf_counter()
        TorchCheckpointIO().load_checkpoint(path, weights_only=True)
        took = time.perf_counter() - start
        return took, took, None

    def dcp_load(self) -> tuple[float, float, None]:
        path = self.dir / "dcp_sync"
        drop_cache(path)
        start = time.perf_counter()
        self.engine.load(path, weights_only=True)
        took = time.perf_counter() - start
        return took, took, None


def machine_info(workdir: Path) -> dict[str, Any]:
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")), platform.processor())
    mem = next((l.split()[1] for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")), "0")
    usage = shutil.disk_usage(workdir)
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "mem_gib": round(int(mem) / 2**20, 1),
        "workdir": str(workdir),
        "disk_total_gib": round(usage.total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.cuda.is_available(),
    }


def run(size_mb: int, repeats: int, workdir: Path, thread_count: int) -> list[dict[str, Any]]:
    bench = Bench(build_state(size_mb), workdir, thread_count)
    methods: dict[str, Callable[[], tuple]] = {m: getattr(bench, m) for m in SAVE_METHODS + LOAD_METHODS}
    for fn in methods.values():  # warm-up: imports, first-touch of long-lived buffers
        fn()
    samples: dict[str, list[tuple]] = {m: [] for m in methods}
    for rep in range(repeats):
        order = list(SAVE_METHODS[rep % len(SAVE_METHODS):] + SAVE_METHODS[: rep % len(SAVE_METHODS)]) + list(LOAD_METHODS)
        for name in order:
            samples[name].append(methods[name]())
    bench.engine.close()
    rows = []
    for name, runs in samples.items():
        call = statistics.median(r[0] for r in runs)
        blocked = statistics.median(r[1] for r in runs)
        durable = None if runs[0][2] is None else statistics.median(r[2] for r in runs)
        rows.append(
            {
                "method": name,
                "call_s": round(call, 4),
                "blocked_s": round(blocked, 4),
                "durable_s": None if durable is None else round(durable, 4),
                "gbps": round(bench.nbytes / (durable if durable is not None else blocked) / 1e9, 3),
            }
        )
    return rows


def report(rows: list[dict[str, Any]], nbytes: int) -> str:
    by = {r["method"]: r for r in rows}
    raw, copy, sync = by["raw_fsync"]["durable_s"], by["host_copy"]["blocked_s"], by["dcp_sync"]["durable_s"]
    lines = [
        f"state written per save: {nbytes / 2**20:.0f} MiB (params + 2 Adam moments)",
        f"{'method':<16}{'call_s':>9}{'blocked_s':>11}{'durable_s':>11}{'GB/s':>8}{'dur/raw':>9}{'blk/copy':>10}",
    ]
    for r in rows:
        dur = r["durable_s"]
        ref = by["raw_read"]["blocked_s"] if r["method"] in LOAD_METHODS else raw
        ratio = (dur if dur is not None else r["blocked_s"]) / ref
        lines.append(
            f"{r['method']:<16}{r['call_s']:>9.4f}{r['blocked_s']:>11.4f}{(dur if dur is not None else float('nan')):>11.4f}"
            f"{r['gbps']:>8.2f}{ratio:>9.2f}{r['blocked_s'] / copy:>10.2f}"
        )
    lines.append("(dur/raw: load rows are relative to raw_read)")
    a = by["dcp_async"]
    lines += [
        "targets:",
        f"  dcp_async blocked / dcp_sync durable = {a['blocked_s'] / sync:.3f} (target <= 0.02; call alone: {a['call_s'] / sync:.3f})",
        f"  dcp_async blocked / host_copy        = {a['blocked_s'] / copy:.2f} (target <= 1.1)",
        f"  dcp_async blocked / lightning_async  = {a['blocked_s'] / by['lightning_async']['blocked_s']:.2f} (target < 1)",
        f"  dcp_sync durable / raw_fsync         = {sync / raw:.2f} (target <= 1.2)",
        f"  dcp_load / raw_read                  = {by['dcp_load']['blocked_s'] / by['raw_read']['blocked_s']:.2f} (target <= 1.2)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, required=True, help="MB of fp32 parameters (about 3x is written)")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results JSON")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory on the disk to measure")
    parser.add_argument("--thread-count", type=int, default=2, help="DCP writer threads")
    args = parser.parse_args(argv)
    if args.size_mb < 1 or args.repeats < 1:
        parser.error("--size-mb and --repeats must be >= 1")
    workdir = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.workdir))
    try:
        rows = run(args.size_mb, args.repeats, workdir, args.thread_count)
        nbytes = sum(t.nbytes for t in tensors_of(build_state(args.size_mb)))
        print(report(rows, nbytes))
        result = {
            "results": rows,
            "machine": machine_info(workdir),
            "config": {"size_mb": args.size_mb, "bytes_per_save": nbytes, "repeats": args.repeats, "thread_count": args.thread_count},
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
