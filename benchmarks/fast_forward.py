"""Benchmark a mid-epoch resume: time to the first trained batch, against a fresh start.

Usage::

    python benchmarks/fast_forward.py [--batches 10000] [--at 0.9] [--getitem-ms 2] [--root /dev/shm/ff]
                                      [--json benchmarks/results/fast_forward.json]

One epoch of ``--batches`` batches (batch size 1) of a map-style dataset whose
``__getitem__`` sleeps ``--getitem-ms`` ms (a tokenised corpus read from disk). A first
run trains ``--at`` of the epoch (data loading without the sleep, to be quick) and crashes
right after a recover checkpoint; then the same job is started again, three ways, each in
its own trial folder copied from that checkpoint (``--repeats`` times, interleaved; medians):

  fresh            a new run (no checkpoint): the baseline
  resume_sampler   RecoverCallback(fast_forward="sampler"), the default: indices of the
                   trained batches drawn and dropped, no sample fetched
  resume_replay    RecoverCallback(fast_forward="replay"): the trained batches fetched again
                   (what a plain DataLoader resume did before)

Columns: ``to_train_start_s`` from ``trainer.fit`` to ``on_train_start`` (setup, and for a
resume the checkpoint load), ``to_first_batch_s`` from ``trainer.fit`` to the first
``training_step``; ``load_s`` = a resume's ``to_train_start_s`` minus the fresh run's.
Target: ``resume_sampler.to_first_batch_s <= 1.5 * fresh.to_first_batch_s + load_s``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from areal_lightning import RecoverCallback

logging.getLogger("lightning").setLevel(logging.ERROR)


class SlowData(Dataset):
    sleep_s = 0.0  # set per run

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 16, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        if SlowData.sleep_s:
            time.sleep(SlowData.sleep_s)
        return self.x[i]


class Net(pl.LightningModule):
    def __init__(self, stop_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)
        self.stop_at = stop_at
        self.first_batch: float | None = None

    def training_step(self, batch, batch_idx):
        if self.first_batch is None:
            self.first_batch = time.perf_counter()
            if self.stop_at is None:
                self.trainer.should_stop = True  # one trained batch is what is measured
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Crash(Exception):
    pass


class CrashAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Crash


class TrainStart(pl.Callback):
    def __init__(self) -> None:
        self.at: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.at = time.perf_counter()


def trainer(callbacks: list, max_steps: int = -1) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, max_steps=max_steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, callbacks=callbacks)


def recover(root: Path, **kwargs) -> RecoverCallback:
    return RecoverCallback(fileroot=root, experiment_name="bench", trial_name="ff", user="u", **kwargs)


def measure(name: str, root: Path | None, n: int, fast_forward: str | None) -> dict:
    pl.seed_everything(0, verbose=False)
    module, start_cb = Net(), TrainStart()
    callbacks: list = [start_cb]
    if root is not None:
        callbacks.append(recover(root, freq_steps=10**9, fast_forward=fast_forward))
    t = trainer(callbacks)
    loader = DataLoader(SlowData(n), batch_size=1, shuffle=True)
    start = time.perf_counter()
    t.fit(module, loader)
    return {"name": name, "to_train_start_s": start_cb.at - start, "to_first_batch_s": module.first_batch - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=10_000)
    p.add_argument("--at", type=float, default=0.9)
    p.add_argument("--getitem-ms", type=float, default=2.0)
    p.add_argument("--root", default=None, help="scratch folder (default: /dev/shm if present, else the temp dir)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each row (medians are reported)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    base = Path(args.root or tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    at = int(args.batches * args.at)

    # The checkpoint: trained to `at` of the epoch, then a crash (no sleep: quick to make).
    pl.seed_everything(0, verbose=False)
    made = time.perf_counter()
    t = trainer([CrashAt(at + 1), recover(base / "ckpt", freq_steps=at)])
    try:
        t.fit(Net(stop_at=at), DataLoader(SlowData(args.batches), batch_size=1, shuffle=True))
    except Crash:
        pass
    made = time.perf_counter() - made

    SlowData.sleep_s = args.getitem_ms / 1000
    runs: dict[str, list[dict]] = {"fresh": [], "resume_sampler": [], "resume_replay": []}
    for rep in range(args.repeats):  # interleaved; each resume from a fresh copy of the checkpoint
        for name, mode in (("fresh", None), ("resume_sampler", "sampler"), ("resume_replay", "replay")):
            root = None
            if mode is not None:
                root = base / f"{name}{rep}"
                shutil.copytree(base / "ckpt", root)
            runs[name].append(measure(name, root, args.batches, mode))
    rows = [{"name": name, "repeats": len(found),
             **{key: statistics.median(r[key] for r in found) for key in ("to_train_start_s", "to_first_batch_s")}}
            for name, found in runs.items()]
    fresh = rows[0]
    for row in rows:
        row["load_s"] = row["to_train_start_s"] - fresh["to_train_start_s"]
        row["vs_fresh"] = row["to_first_batch_s"] / fresh["to_first_batch_s"]
    target = 1.5 * fresh["to_first_batch_s"] + rows[1]["load_s"]
    print(f"epoch of {args.batches} batches, resumed after {at} ({args.at:.0%}), __getitem__ {args.getitem_ms} ms; "
          f"checkpoint folder {base} (making it took {made:.1f}s); medians of {args.repeats}")
    print(f"{'run':<16}{'to_train_start_s':>18}{'to_first_batch_s':>18}{'load_s':>10}{'x fresh':>10}")
    for row in rows:
        print(f"{row['name']:<16}{row['to_train_start_s']:>18.3f}{row['to_first_batch_s']:>18.3f}"
              f"{row['load_s']:>10.3f}{row['vs_fresh']:>10.2f}")
    ok = rows[1]["to_first_batch_s"] <= target
    print(f"target resume_sampler <= 1.5 x fresh + load = {target:.3f}s: {'met' if ok else 'NOT met'}")
    result = {"machine": {"python": sys.version.split()[0], "torch": torch.__version__, "lightning": pl.__version__,
                          "platform": platform.platform(), "cpus": os.cpu_count(), "root": str(base)},
              "batches": args.batches, "resumed_after": at, "getitem_ms": args.getitem_ms, "rows": rows,
              "target_s": target, "target_met": ok}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
