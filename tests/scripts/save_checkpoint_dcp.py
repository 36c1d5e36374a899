"""``trainer.save_checkpoint`` / ``fit(ckpt_path=...)`` with ``DCPCheckpointIO`` under a
2-rank strategy (no RecoverCallback): every rank writes its shard; a new Trainer resumes.

    python tests/scripts/save_checkpoint_dcp.py --root DIR --strategy ddp|fsdp2|fsdp1 --io-mode sync|async

(``fsdp1``: Lightning's ``FSDPStrategy`` on CPU through ``tests/fsdp1_cpu.py``, auto-wrapping each Linear.)

Writes DIR/ckpt (the DCP directory), DIR/saved.pt (the full state, gathered by parameter
name, right after the save) and DIR/loaded.pt (the same, right after the resume), on rank 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (fsdp1_cpu)

import lightning.pytorch as pl
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader, TensorDataset

from areal_lightning.errors import ConfigError
from areal_lightning import DCPCheckpointIO, StagingWaitCallback

warnings.filterwarnings("ignore")


def full_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(trainer.strategy.model, FullyShardedDataParallel):  # FSDP1: its root, no CPU offload on CPU
        model, optim = get_state_dict(trainer.strategy.model, trainer.optimizers,
                                      options=StateDictOptions(full_state_dict=True))
    else:
        model, optim = get_state_dict(module, trainer.optimizers, options=StateDictOptions(full_state_dict=True,
                                                                                           cpu_offload=True))
    return {"model": model, "optim": optim}


class Net(pl.LightningModule):
    def __init__(self, fsdp2: bool, root: Path) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.fsdp2, self.root = fsdp2, root

    def configure_model(self):
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_start(self) -> None:
        if self.global_step > 0:  # resumed
            state = full_state(self.trainer, self)
            if self.global_rank == 0:
                torch.save(state, self.root / "loaded.pt")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--strategy", choices=["ddp", "fsdp2", "fsdp1"], required=True)
    p.add_argument("--io-mode", default="sync")
    args = p.parse_args()
    root = Path(args.root)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))

    def trainer(epochs: int) -> pl.Trainer:
        if args.strategy == "fsdp1":
            from fsdp1_cpu import CPUFSDPStrategy

            strategy = CPUFSDPStrategy(auto_wrap_policy={torch.nn.Linear})
        elif args.strategy == "fsdp2":
            strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        else:
            strategy = "ddp"
        return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=2, strategy=strategy, logger=False,
                          plugins=[DCPCheckpointIO(args.io_mode)], callbacks=[StagingWaitCallback()],
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    pl.seed_everything(0, verbose=False)
    first = trainer(1)
    module = Net(args.strategy == "fsdp2", root)
    first.fit(module, DataLoader(data, batch_size=8, shuffle=True))
    first.save_checkpoint(root / "ckpt")
    # A path no checkpoint can have is refused on every rank, before anything is written.
    os.chdir(root)
    try:
        first.save_checkpoint("hdfs://namenode/ckpt")
    except ConfigError as exc:
        (root / f"refused.rank{first.global_rank}").write_text(str(exc))
    # No wait: async, rank 0 alone renames the save into place; the load below must wait for it.
    state = full_state(first, module)
    if first.is_global_zero:
        torch.save(state, root / "saved.pt")
    second = trainer(2)
    second.fit(Net(args.strategy == "fsdp2", root), DataLoader(data, batch_size=8, shuffle=True),
               ckpt_path=root / "ckpt")


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # as torch recommends for every multi-process script
        torch.distributed.destroy_process_group()
