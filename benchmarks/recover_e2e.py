"""End to end: what a recover checkpoint costs a real Trainer, against Lightning's own and the disk.

Usage::

    python benchmarks/recover_e2e.py [--mb 64] [--width 1024] [--roots /dev/shm/recover_e2e,/tmp/recover_e2e]
                                     [--worlds 1,2] [--json FILE]

A real ``Trainer`` trains a model of ``--mb`` MB of fp32 weights (``Linear`` layers of
``--width`` x ``--width``: 1024, 4 MB each; 64 makes the same bytes 256 times as many
tensors, the fixed costs per tensor of a save) with Adam (checkpoint = weights + 2 moments =
3x) on ``accelerator="cpu"``; with 2 ranks,
``strategy="ddp"`` on gloo, launched by ``torchrun``. It saves every ``--every`` steps
with, in turn:

  recover_sync      ``RecoverCallback(io_mode="sync")``
  recover_async     ``RecoverCallback(io_mode="async")``
  modelcheckpoint   Lightning's ``ModelCheckpoint(save_top_k=0, save_last=True)`` (``torch.save``;
                    it does not fsync, so its "durable" time is only its write time)

and compares with, in the same process:

  raw_write         one ``write`` + ``fsync`` of as many bytes as the recover checkpoint holds
  host_copy         a copy of the model and optimizer tensors into preallocated host buffers
                    (the floor of an async save's blocked time)

Per save (median over the saves after the first, whose one-time costs are shown apart):
``blocked_s``, the extra time of the two steps from the save's step on, against steps
without a save (an async save's staging wait falls into the next step); ``durable_s``, until
the checkpoint is durable and published (``checkpoint/recover/write_s`` of the telemetry);
``read_mb``, what each rank read during those steps (``rchar`` of ``/proc/self/io``:
a save should read nothing). Per resume (a new process, same command): ``resume_s`` from
``trainer.fit`` to the first trained batch, and ``read_mb`` per rank in that time; ``fresh``
is the same for a start without a checkpoint (``--one-process``, for a quick smoke run such as
CI's, resumes in the process that saved instead). Ratios: ``durable / raw_write``,
``resume / modelcheckpoint``'s, async ``blocked / host_copy``. A table and JSON.
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

METHODS = ("recover_sync", "recover_async", "modelcheckpoint")


def _rchar() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# ------------------------------------------------------------------------------------------
# worker (one process per rank; imports torch and Lightning only here)


def _worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import Logger
    from torch.utils.data import DataLoader, TensorDataset

    from areal_lightning import RecoverCallback

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            n = max(1, round(args.mb * 2**20 / (args.width * args.width * 4)))
            self.layers = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(n)])

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.layers(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-5)

    class Capture(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict[str, float]] = []

        name = "capture"
        version = 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append(dict(metrics))

        def log_hyperparams(self, *a: Any, **k: Any) -> None:
            pass

    class Probe(Callback):
        def __init__(self, stop_after_first: bool = False) -> None:
            self.t: list[float] = []
            self.rchar: list[int] = []
            self.steps: list[int] = []
            self.fit_called = 0.0
            self.rchar_called = 0
            self.stop_after_first = stop_after_first

        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            self.t.append(time.perf_counter())
            self.rchar.append(_rchar())
            self.steps.append(trainer.global_step)
            if self.stop_after_first:
                trainer.should_stop = True

    steps = args.every * args.saves + 2

    def trainer_for(method: str, root: Path, probe: Probe, max_steps: int, logger: Any) -> tuple[Any, list]:
        callbacks: list[Any] = [probe]
        if method.startswith("recover"):
            callbacks.append(RecoverCallback(fileroot=str(root), experiment_name="bench", trial_name="t", user="u",
                                             freq_steps=args.every, io_mode=method.split("_")[1]))
        elif method == "modelcheckpoint":
            callbacks.append(ModelCheckpoint(dirpath=str(root / "mc"), save_top_k=0, save_last=True,
                                             every_n_train_steps=args.every))
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                             max_steps=max_steps, logger=logger, enable_checkpointing=method == "modelcheckpoint",
                             callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, limit_val_batches=0, log_every_n_steps=1)
        return trainer, callbacks

    def data() -> Any:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(4 * world * (steps + 4), args.width, generator=g)), batch_size=4)

    def run_phase(phase: str, out_prefix: str) -> None:
        out: dict[str, Any] = {"rank": rank, "world": world}
        # A resume loads a recover checkpoint the same way whether it was saved sync or async.
        for method in ("recover_sync", "modelcheckpoint", "fresh") if phase == "resume" else METHODS:
            root = Path(args.root) / (method if method != "fresh" else "fresh")
            torch.manual_seed(0)
            model = Net()
            if phase == "save":
                probe, logger = Probe(), Capture()
                trainer, callbacks = trainer_for(method, root, probe, steps, logger)
                trainer.fit(model, data())
                out[method] = {"t": probe.t, "rchar": probe.rchar, "steps": probe.steps,
                               "durable_s": [r["checkpoint/recover/write_s"] for r in logger.rows
                                             if "checkpoint/recover/write_s" in r],
                               "telemetry_blocked_s": [r["checkpoint/recover/blocked_s"] for r in logger.rows
                                                       if "checkpoint/recover/blocked_s" in r],
                               "hash_s": [r["checkpoint/recover/hash_s"] for r in logger.rows
                                          if "checkpoint/recover/hash_s" in r]}
                if method == "recover_sync" and rank == 0:
                    ckpt = root / "checkpoints/u/bench/t/default/recover_checkpoint"
                    out["ckpt_bytes"] = sum(p.stat().st_size for p in ckpt.iterdir())
                    opt = trainer.optimizers[0]
                    tensors = [p.data for p in model.parameters()] + [
                        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
                    buffers = [torch.empty_like(t) for t in tensors]
                    for b, t in zip(buffers, tensors):
                        b.copy_(t)  # touch the pages once, as a reused staging buffer is
                    times = []
                    for _ in range(3):
                        start = time.perf_counter()
                        for b, t in zip(buffers, tensors):
                            b.copy_(t)
                        times.append(time.perf_counter() - start)
                    out["host_copy_s"] = statistics.median(times)
                    del buffers
            else:
                probe = Probe(stop_after_first=True)
                trainer, _ = trainer_for(method if method != "fresh" else "none", root, probe, steps + 4, False)
                ckpt_path = str(root / "mc" / "last.ckpt") if method == "modelcheckpoint" else None
                start, rchar = time.perf_counter(), _rchar()
                trainer.fit(model, data(), ckpt_path=ckpt_path)
                out[method] = {"resume_s": probe.t[0] - start, "read_bytes": probe.rchar[0] - rchar,
                               "first_step": probe.steps[0]}
        if rank == 0 and phase == "save":
            path = Path(args.root) / "raw.bin"
            payload = os.urandom(1 << 20) * max(1, out["ckpt_bytes"] >> 20)
            times, reads = [], []
            for _ in range(3):
                start = time.perf_counter()
                with open(path, "wb") as f:
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
                times.append(time.perf_counter() - start)
                start = time.perf_counter()
                with open(path, "rb") as f:
                    while f.read(64 << 20):
                        pass
                reads.append(time.perf_counter() - start)
            out["raw_write_s"], out["raw_read_s"] = statistics.median(times), statistics.median(reads)
            path.unlink()
        Path(f"{out_prefix}.rank{rank}.json").write_text(json.dumps(out))

    for phase, out_prefix in zip(args.phase.split(","), args.out.split(",")):
        run_phase(phase, out_prefix)


# ------------------------------------------------------------------------------------------
# orchestration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, argv: list[str]) -> None:
    here = str(Path(__file__).resolve())
    if world == 1:
        cmd = [sys.executable, here, *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--master-addr=127.0.0.1",
               f"--master-port={_free_port()}", here, *argv]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]) + os.pathsep +
           os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    print(f"[{world} rank(s), {argv[argv.index('--phase') + 1]}: {time.perf_counter() - start:.1f}s]", file=sys.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def _save_rows(ranks: list[dict[str, Any]], every: int) -> dict[str, dict[str, Any]]:
    rows = {}
    for method in METHODS:
        per_rank = [r[method] for r in ranks]
        t, steps = per_rank[0]["t"], per_rank[0]["steps"]
        saves = [i for i, s in enumerate(steps) if i > 0 and s % every == 0 and i + 1 < len(t)]
        # batch i-1 ended with global_step == s: the save ran between t[i-1] and t[i]
        window = {j for i in saves for j in (i - 1, i)}
        normal = [t[j + 1] - t[j] for j in range(1, len(t) - 1) if j not in window]
        base = statistics.median(normal) if normal else 0.0
        blocked = [t[i + 1] - t[i - 1] - 2 * base for i in saves]
        read = [max(r["rchar"][i + 1] - r["rchar"][i - 1] for r in per_rank) for i in saves]
        durable = per_rank[0]["durable_s"] if method.startswith("recover") else blocked
        later = slice(1, None) if len(blocked) > 1 else slice(None)
        rows[method] = {
            "saves": len(blocked), "blocked_s": statistics.median(blocked[later]), "first_blocked_s": blocked[0],
            "durable_s": statistics.median(durable[later]) if durable else None,
            "telemetry_blocked_s": statistics.median(per_rank[0]["telemetry_blocked_s"][later] or [0.0])
            if method.startswith("recover") else None,
            "hash_s": statistics.median(per_rank[0]["hash_s"][later] or [0.0]) if method.startswith("recover") else None,
            "save_read_mb_per_rank": max(read[later]) / 1e6, "step_s": base,
        }
    return rows


def _measure(root: Path, world: int, args: argparse.Namespace) -> dict[str, Any]:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    common = ["--worker", "--root", str(root), "--mb", str(args.mb), "--width", str(args.width),
              "--every", str(args.every), "--saves", str(args.saves)]
    if args.one_process:  # a smoke run: the resume in the same (warm) process as the saves
        _launch(world, [*common, "--phase", "save,resume", "--out", f"{root / 'save'},{root / 'resume'}"])
    else:
        _launch(world, [*common, "--phase", "save", "--out", str(root / "save")])
        _launch(world, [*common, "--phase", "resume", "--out", str(root / "resume")])
    save = [json.loads((root / f"save.rank{r}.json").read_text()) for r in range(world)]
    resume = [json.loads((root / f"resume.rank{r}.json").read_text()) for r in range(world)]
    rows = _save_rows(save, args.every)
    head = save[0]
    for method in METHODS:
        key = "recover_sync" if method.startswith("recover") else method
        rows[method]["resume_s"] = max(r[key]["resume_s"] for r in resume)
        rows[method]["resume_read_mb_per_rank"] = [r[key]["read_bytes"] / 1e6 for r in resume]
    fresh = {"resume_s": max(r["fresh"]["resume_s"] for r in resume),
             "resume_read_mb_per_rank": [r["fresh"]["read_bytes"] / 1e6 for r in resume]}
    for method, row in rows.items():
        row["durable_vs_raw_write"] = row["durable_s"] / head["raw_write_s"] if row["durable_s"] else None
        row["resume_vs_modelcheckpoint"] = row["resume_s"] / rows["modelcheckpoint"]["resume_s"]
    rows["recover_async"]["blocked_vs_host_copy"] = rows["recover_async"]["blocked_s"] / head["host_copy_s"]
    shutil.rmtree(root, ignore_errors=True)
    return {"root": str(root), "world": world, "ckpt_mb": head["ckpt_bytes"] / 1e6, "raw_write_s": head["raw_write_s"],
            "raw_read_s": head["raw_read_s"], "host_copy_s": head["host_copy_s"], "fresh": fresh, "rows": rows}


def _print(result: dict[str, Any]) -> None:
    print(f"\n{result['root']}  world={result['world']}  checkpoint {result['ckpt_mb']:.0f} MB  raw write+fsync "
          f"{result['raw_write_s']:.3f}s  raw read {result['raw_read_s']:.3f}s  host copy {result['host_copy_s']:.3f}s  "
          f"fresh start {result['fresh']['resume_s']:.2f}s")
    print(f"{'method':<16} {'blocked s':>9} {'1st':>6} {'durable s':>9} {'/raw':>5} {'hash s':>6} {'save read MB':>12} "
          f"{'resume s':>8} {'/MC':>5} {'resume read MB/rank':>20}")
    for method, r in result["rows"].items():
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(f"{method:<16} {r['blocked_s']:>9.3f} {r['first_blocked_s']:>6.2f} {fmt(r['durable_s'], '>9.3f')} "
              f"{fmt(r['durable_vs_raw_write'], '>5.2f')} {fmt(r['hash_s'], '>6.3f')} {r['save_read_mb_per_rank']:>12.1f} "
              f"{r['resume_s']:>8.2f} {r['resume_vs_modelcheckpoint']:>5.2f} "
              f"{'/'.join(f'{x:.0f}' for x in r['resume_read_mb_per_rank']):>20}")
    print(f"async blocked / host copy: {result['rows']['recover_async']['blocked_vs_host_copy']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=64, help="MB of fp32 weights (the checkpoint is 3x with Adam)")
    parser.add_argument("--width", type=int, default=1024, help="each Linear layer is width x width (no bias)")
    parser.add_argument("--every", type=int, default=8, help="steps between saves (an async save is durable before the next)")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--roots", default="/dev/shm/recover_e2e,/tmp/recover_e2e")
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one-process", action="store_true",
                        help="resume in the process that saved (a quick smoke run; resume times are then warm)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0
    from _report import write_json

    results = []
    for root in args.roots.split(","):
        for world in (int(w) for w in args.worlds.split(",")):
            result = _measure(Path(root), world, args)
            _print(result)
            results.append(result)
    write_json(args.json, {"benchmark": "recover_e2e", "mb": args.mb, "width": args.width, "every": args.every,
                           "saves": args.saves,
                           "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
