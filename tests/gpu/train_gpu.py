"""GPU training job for tests/gpu: a small MLP with dropout, AdamW, ``strategy="fsdp"`` or
``"ddp"`` on up to 2 GPUs (NCCL), RecoverCallback with sync or async (pinned staging) saves;
``--memory``: the memory tier too (a slot every step, on {root}/memory or ``--memory-root``), with ``--batchnorm``
a BatchNorm layer (buffers the next forward changes) and an EMA buffer updated in the module's
own hook, ``--precision`` as Lightning's.

Writes ``losses.rank{r}.jsonl`` (one line per step, float.hex) and ``report.rank{r}.json``
(backend, whether the async stager's host buffers are pinned, whether the memory tier's slots
are page-locked, the time each save point held training) into --root.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from areal_lightning import RecoverCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from harness.callbacks import KillAt  # noqa: E402

warnings.filterwarnings("ignore")


class Net(pl.LightningModule):
    def __init__(self, root: Path, batchnorm: bool = False) -> None:
        super().__init__()
        norm = [torch.nn.BatchNorm1d(256)] if batchnorm else []
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), *norm, torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(256, 1))
        self.register_buffer("ema", torch.zeros(()))
        self.root = root

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.ema.mul_(0.9).add_(0.1 * outputs["loss"].detach().float())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        with open(self.root / f"losses.rank{self.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": self.global_step + 1, "loss": loss.item().hex()}) + "\n")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Report(pl.Callback):
    def __init__(self) -> None:
        self.memory: dict[str, object] = {"pinned": None, "copy_s": []}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        recover = next(cb for cb in trainer.callbacks if isinstance(cb, RecoverCallback))
        tier = recover._session.memory if recover._session is not None else None
        if tier is not None and tier.last_copy_s:  # the previous step's save point (this one's is after the hooks)
            self.memory["pinned"] = tier.pinned
            self.memory["copy_s"].append(tier.last_copy_s)

    def on_train_end(self, trainer, pl_module) -> None:
        io = next(cb for cb in trainer.callbacks if isinstance(cb, RecoverCallback)).checkpoint_io  # the recover IO
        stager = io.engine.stager._stager  # the engine's long-lived DefaultStager (saves DCP plans)
        pinned = None
        if io.engine.staging_buffers is not None:  # saves that need no plan (one process)
            pinned = all(b.is_pinned() for b in io.engine.staging_buffers.values() if b.nbytes >= 1024)
        elif stager is not None:
            cache = stager._state_dict_stager._cached_storage_mapping  # source storage -> host buffer
            buffers = [b for b in cache.values() if b.nbytes() >= 1024]
            pinned = bool(buffers) and all(b.is_pinned() for b in buffers)
        report = {"backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
                  "pinned_staging": pinned, "io_mode": io.resolved_mode, "strategy": type(trainer.strategy).__name__,
                  "devices": trainer.num_devices, "gpu": torch.cuda.get_device_name(), "memory": self.memory}
        (pl_module.root / f"report.rank{trainer.global_rank}.json").write_text(json.dumps(report))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="fsdp", choices=["fsdp", "ddp"])
    p.add_argument("--io-mode", default="async")
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--memory", action="store_true", help="the memory tier, a slot every step, in {root}/memory")
    p.add_argument("--memory-root", default=None, help="the memory tier's root instead (a tmpfs folder)")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--precision", default="32-true")
    args = p.parse_args()
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0, workers=True, verbose=False)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 64, generator=g), torch.randn(512, 1, generator=g))
    recover = RecoverCallback(fileroot=root, experiment_name="exp", trial_name="t", user="u", freq_steps=5,
                              io_mode=args.io_mode, memory={"root": args.memory_root or str(root / "memory")} if args.memory else None)
    callbacks = [recover, Report()]
    if args.kill_at_step is not None:
        callbacks.insert(0, KillAt(args.kill_at_step, settle=recover if args.memory else None))
    trainer = pl.Trainer(max_epochs=2, accelerator="gpu", devices=args.devices, strategy=args.strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, deterministic=True, precision=args.precision)
    trainer.fit(Net(root, args.batchnorm), DataLoader(data, batch_size=16, shuffle=True))


if __name__ == "__main__":
    main()
