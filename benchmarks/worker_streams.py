"""Benchmark the per-batch cost of keeping the DataLoader workers' random streams.

Usage::

    python benchmarks/worker_streams.py [--batches 2000] [--batch-size 8] [--workers 2] [--repeats 5]
                                        [--json benchmarks/results/worker_streams.json]

One epoch of a map-style dataset whose ``__getitem__`` draws augmentation noise from torch,
``random`` and NumPy (a 256-float sample), iterated in this process by four loaders, in turn
(``--repeats`` times, interleaved; medians):

  plain            torch's ``DataLoader``: the baseline
  tracked_replay   the same loader made resumable by ``RecoverCallback``'s tracker with
                   ``fast_forward="replay"`` (position only: no worker streams)
  tracked_streams  the same with the default ``fast_forward="sampler"``: every batch also
                   carries its worker's RNG states after it (a worker's first batch: and
                   before it), which is what a resume needs
  stateful         torchdata's ``StatefulDataLoader`` (a peer that keeps its own position)

Columns: ``us_per_batch`` (wall time of the epoch / batches), ``vs_plain`` (ratio to the
plain loader), ``added_us_per_batch``; and the bytes of RNG state one batch carries, with the
time to capture, pickle and unpickle them alone (the software's own cost, free of the
loader's noise).
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402

from areal_lightning.capture.loader import LoaderTracker  # noqa: E402
from areal_lightning.capture.rng import raw_state  # noqa: E402


class Augmented(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 256, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = torch.randn(256) * 0.1 + random.random() * 0.01
        return self.x[i] + noise + float(np.random.standard_normal())


def make(kind: str, dataset: Dataset, batch_size: int, workers: int) -> Any:
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)
    if kind.startswith("tracked"):
        tracker = LoaderTracker(fast_forward="replay" if kind == "tracked_replay" else "sampler")
        tracker.track(loader, 0)
    return loader


def epoch_seconds(loader: Any) -> float:
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


KINDS = ("plain", "tracked_replay", "tracked_streams", "stateful")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    dataset = Augmented(args.batches * args.batch_size)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.repeats):
        for kind in KINDS:
            times[kind].append(epoch_seconds(make(kind, dataset, args.batch_size, args.workers)))
    per_batch = {k: statistics.median(v) / args.batches * 1e6 for k, v in times.items()}
    state_bytes = len(pickle.dumps(raw_state()))  # the state after the batch, as pickled to the main process
    n = 2000
    start = time.perf_counter()
    for _ in range(n):  # what a batch adds: one capture in the worker, pickled with the batch, unpickled
        pickle.loads(pickle.dumps(raw_state()))
    capture_us = (time.perf_counter() - start) / n * 1e6
    rows = {k: {"us_per_batch": round(per_batch[k], 1), "vs_plain": round(per_batch[k] / per_batch["plain"], 3),
                "added_us_per_batch": round(per_batch[k] - per_batch["plain"], 1)} for k in KINDS}
    print(f"{args.batches} batches of {args.batch_size} samples, {args.workers} workers, median of {args.repeats}")
    print(f"{'loader':<18}{'us/batch':>10}{'vs plain':>10}{'added us':>10}")
    for kind, row in rows.items():
        print(f"{kind:<18}{row['us_per_batch']:>10.1f}{row['vs_plain']:>10.3f}{row['added_us_per_batch']:>10.1f}")
    print(f"RNG state carried per batch (tracked_streams): {state_bytes} bytes; capturing, pickling and "
          f"unpickling it alone: {capture_us:.1f} us per batch")
    write_json(args.json, {"benchmark": "worker_streams", "batches": args.batches, "batch_size": args.batch_size,
                           "workers": args.workers, "repeats": args.repeats, "rows": rows,
                           "state_bytes_per_batch": state_bytes, "capture_us_per_batch": round(capture_us, 1)})


if __name__ == "__main__":
    main()
