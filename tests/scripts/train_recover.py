"""A small real training job for resume tests: dropout, AdamW, a per-step LR scheduler.

    python tests/scripts/train_recover.py --root DIR --losses FILE [--loader plain|stateful]
        [--workers N] [--no-shuffle] [--kill-at-step N] [--io-mode sync|async] [--freq-steps N]
        [--freq-epochs N] [--freq-secs N] [--epochs N] [--logger csv|none]
        [--devices N [--strategy ddp|fsdp2] [--rank-seed]] [--dump-state PREFIX] [--step-sleep S]

Appends one JSON line per optimizer step to --losses (``.rank{r}`` appended when --devices > 1):
{"step", "loss" (float.hex), "pid", "samples" (dataset indices of the batch)}.
--kill-at-step N sends SIGKILL to itself at the end of step N (before that step's save);
--sigterm-at-step N [--sigterm-rank R] sends SIGTERM to rank R at the end of step N (first run only);
the loss of a step is recorded in ``training_step``, so before any checkpoint of that step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

# The Lightning namespace (``--namespace pytorch_lightning``; read before Lightning is imported).
NAMESPACE = sys.argv[sys.argv.index("--namespace") + 1] if "--namespace" in sys.argv else "lightning.pytorch"
os.environ["AREAL_NAMESPACE"] = NAMESPACE  # for tests/fsdp1_cpu.py
pl = importlib.import_module(NAMESPACE)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # tests/
from harness.callbacks import DumpState, KillAt, SignalAt  # noqa: E402

from areal_lightning import RecoverCallback  # noqa: E402

warnings.filterwarnings("ignore")


class Noisy(Dataset):
    """Deterministic regression data."""

    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class Net(pl.LightningModule):
    def __init__(self, losses: str, fsdp2: bool = False, step_sleep: float = 0.0, hidden: int = 32) -> None:
        super().__init__()
        self.fsdp2 = fsdp2
        self.step_sleep = step_sleep
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(hidden, 1))
        self.losses_path = losses

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.step_sleep:  # ranks that take different times per step (seconds triggers)
            time.sleep(self.step_sleep * (self.global_rank + 1))
        self.log("train_loss", loss)
        with open(self.losses_path, "a") as f:  # written before any checkpoint of this step
            f.write(json.dumps({"step": self.trainer.global_step + 1, "loss": loss.item().hex(),
                                "pid": os.getpid(), "samples": idx.tolist()}) + "\n")
        return loss

    def configure_model(self):
        if self.fsdp2:  # FSDP2: shard each Linear and the root over the data-parallel mesh
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[3]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LimitFileSize(pl.Callback):
    """From the end of step ``step`` on, no file may grow past ``nbytes`` (a full disk)."""

    def __init__(self, step: int, nbytes: int) -> None:
        self.step, self.nbytes = step, nbytes

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            import resource

            for cb in trainer.callbacks:  # an async save still in flight completes first
                if isinstance(cb, RecoverCallback):
                    cb.wait()
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG errors instead of a signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--fileroot", default=None, help="the RecoverCallback's fileroot (default: --root; e.g. s3://...)")
    p.add_argument("--storage-options", default=None, help="JSON: the RecoverCallback's storage_options")
    p.add_argument("--hidden", type=int, default=32, help="width of the hidden layer")
    p.add_argument("--namespace", default="lightning.pytorch", choices=["lightning.pytorch", "pytorch_lightning"])
    p.add_argument("--losses", required=True)
    p.add_argument("--loader", default="plain", choices=["plain", "stateful"])
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--no-shuffle", action="store_true")
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--io-mode", default="sync")
    p.add_argument("--freq-steps", type=int, default=5)
    p.add_argument("--freq-epochs", type=int, default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--logger", default="csv", choices=["csv", "none"])
    p.add_argument("--devices", type=int, default=1, help=">1: strategy='ddp' on CPU (gloo)")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp1", "fsdp2", "single"],
                   help="ddp, or fsdp2 (fully_shard through ModelParallelStrategy); used when --devices > 1 "
                        "or --strategy is given explicitly")
    p.add_argument("--rank-seed", action="store_true", help="seed each rank differently")
    p.add_argument("--dump-state", default=None, help="prefix of full model+optimizer dumps (see DumpState)")
    p.add_argument("--dump-every", type=int, default=None, help="steps between dumps (default: --freq-steps)")
    p.add_argument("--freq-secs", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps, times (rank + 1)")
    p.add_argument("--sigterm-at-step", type=int, default=None, help="SIGTERM to itself at the end of that step")
    p.add_argument("--sigterm-rank", type=int, default=0, help="the rank --sigterm-at-step signals")
    p.add_argument("--memory", action="store_true", help="the memory tier too (a slot every step) in {root}/memory "
                   "(with --num-nodes 2: {root}/memory/node{GROUP_RANK}, each node its own)")
    p.add_argument("--replicas", type=int, default=0, help="the memory tier's peer copies (0 or 1)")
    p.add_argument("--lock-lease-s", type=float, default=60.0, help="RecoverCallback(lock_lease_s=...)")
    p.add_argument("--num-nodes", type=int, default=1, help="Trainer(num_nodes=...), under torchrun agents")
    p.add_argument("--disk-full-at-step", type=int, default=None, help="limit file sizes (RLIMIT_FSIZE) from then on")
    args = p.parse_args()

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if rank == 1 and os.environ.get("RANK1_AWS_ACCESS_KEY_ID"):  # other credentials on rank 1 (object-store tests)
        os.environ["AWS_ACCESS_KEY_ID"] = os.environ["RANK1_AWS_ACCESS_KEY_ID"]
        os.environ["AWS_SECRET_ACCESS_KEY"] = os.environ["RANK1_AWS_SECRET_ACCESS_KEY"]
    pl.seed_everything(7 * rank if args.rank_seed else 0, workers=True, verbose=False)
    losses = f"{args.losses}.rank{rank}" if args.devices > 1 else args.losses
    if args.num_nodes > 1:  # one file per global rank
        losses = f"{args.losses}.rank{os.environ['RANK']}"
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    else:
        Loader = DataLoader
    loader = Loader(Noisy(), batch_size=4, shuffle=not args.no_shuffle, num_workers=args.workers)
    recover = RecoverCallback(fileroot=args.fileroot or args.root, experiment_name="exp", trial_name="t", user="u",
                              freq_steps=args.freq_steps, freq_epochs=args.freq_epochs, freq_secs=args.freq_secs,
                              io_mode=args.io_mode, lock_lease_s=args.lock_lease_s,
                              storage_options=json.loads(args.storage_options) if args.storage_options else None,
                              memory={"root": os.path.join(args.root, "memory", *(
                                  [f"node{os.environ['GROUP_RANK']}"] if args.num_nodes > 1 else [])),
                                      "replicas": args.replicas} if args.memory else None)
    callbacks = [recover]
    if args.kill_at_step is not None:
        callbacks.insert(0, KillAt(args.kill_at_step, settle=recover if args.memory else None))
    if args.sigterm_at_step is not None:
        callbacks.insert(0, SignalAt(args.sigterm_at_step, args.sigterm_rank,
                                     os.path.join(args.root, f"signalled.rank{args.sigterm_rank}")))
    if args.dump_state is not None:
        callbacks.insert(0, DumpState(args.dump_state, args.dump_every or args.freq_steps))
    if args.disk_full_at_step is not None:
        callbacks.insert(0, LimitFileSize(args.disk_full_at_step, 4096))
    logger = (pl.loggers.CSVLogger(os.path.join(args.root, "logs"), name="run", flush_logs_every_n_steps=1)
              if args.logger == "csv" else False)
    explicit = any(a.startswith("--strategy") for a in sys.argv)
    if args.strategy == "fsdp2":
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    elif args.strategy == "fsdp1":  # Lightning's FSDPStrategy on CPU ranks, one FSDP unit per Linear
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
        from fsdp1_cpu import CPUFSDPStrategy

        strategy = CPUFSDPStrategy(auto_wrap_policy={torch.nn.Linear})
    elif args.strategy == "single":
        strategy = "auto"
    else:
        strategy = "ddp" if args.devices > 1 or explicit else "auto"
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=args.devices, logger=logger,
                         num_nodes=args.num_nodes,
                         strategy=strategy,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, log_every_n_steps=1)
    trainer.fit(Net(losses, fsdp2=args.strategy == "fsdp2", step_sleep=args.step_sleep, hidden=args.hidden), loader)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # as torch recommends for every multi-process script
        torch.distributed.destroy_process_group()
