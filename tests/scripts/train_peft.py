"""A LoRA Llama (frozen base) trained with HFSaverCallback(peft_export=...) and RecoverCallback,
on one process or on 2 CPU ranks (gloo; Lightning starts the second rank).

    python tests/scripts/train_peft.py --root DIR [--devices 2] [--strategy ddp|fsdp1|fsdp2]
        [--export adapter|merged|both|none] [--mode sync|async] [--kill-at-step N] [--compile]
        [--method gather|dcp]

``fsdp1`` is Lightning's ``FSDPStrategy`` (``tests/fsdp1_cpu``, ``use_orig_params=True``, one
unit per decoder layer); ``fsdp2`` is ``ModelParallelStrategy`` with ``fully_shard`` on every
decoder layer and on the PEFT model (``configure_model``). Each rank appends one JSON line per
optimizer step to ``DIR/losses.rank{r}`` (``{"step", "loss" (hex)}``). ``--kill-at-step N``
SIGKILLs every rank at the end of step N (before that step's saves). ``--compile``:
``torch.compile`` the PEFT model in ``configure_model`` (after FSDP2's sharding). The validation after each
epoch (every rank takes part under FSDP) writes on rank 0 ``DIR/live_logits.pt``: the live
model's logits on a fixed input after the epoch's last step, of which the last export is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (fsdp1_cpu)

from areal_lightning import HFSaverCallback, RecoverCallback  # noqa: E402
from tests.conftest import CrashAt, LMModule, tiny_llama  # noqa: E402

warnings.filterwarnings("ignore")
PROBE = torch.arange(3, 11).view(1, 8)


class LoRAModule(LMModule):
    def __init__(self, model: torch.nn.Module, losses: Path, fsdp2: bool, compiled: bool) -> None:
        super().__init__(model)
        self.losses_path, self.fsdp2, self.compiled = losses, fsdp2, compiled

    def configure_model(self) -> None:
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.get_base_model().model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        if self.compiled:  # after sharding, as torch recommends (eager backend: see tests/test_compile.py)
            self.model = torch.compile(self.model, backend="eager")

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        with open(f"{self.losses_path}.rank{self.global_rank}", "a") as f:
            f.write(json.dumps({"step": self.trainer.global_step + 1, "loss": loss.item().hex()}) + "\n")
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch  # the probe, after each epoch's last step (of which the epoch's last export is)
        logits = self.model(input_ids=ids).logits
        if self.trainer.is_global_zero:
            torch.save(logits, self.losses_path.parent / "live_logits.pt")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def strategy(name: str, devices: int):
    if name == "fsdp1":
        from fsdp1_cpu import CPUFSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return CPUFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, use_orig_params=True)
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return name if devices > 1 else "auto"


def main() -> None:
    import peft
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp1", "fsdp2"])
    p.add_argument("--export", default="both")
    p.add_argument("--mode", default="sync")
    p.add_argument("--kill-at-step", type=int)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--method", default="gather")
    args = p.parse_args()
    root = Path(args.root)
    base_dir = root / "base"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not base_dir.exists():
        tiny_llama().save_pretrained(base_dir)
    pl.seed_everything(0, verbose=False)
    where = dict(fileroot=root, experiment_name="e", trial_name="t", user="u")
    callbacks: list = [CrashAt(args.kill_at_step, kill=True)] if args.kill_at_step else []
    callbacks.append(RecoverCallback(**where, freq_steps=4))
    if args.export != "none":
        callbacks.append(HFSaverCallback(**where, freq_steps=4, mode=args.mode, peft_export=args.export,
                                        sharded_method=args.method))
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=args.devices,
                         strategy=strategy(args.strategy, args.devices), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=callbacks)
    while not (base_dir / "model.safetensors").exists():  # rank 1 (launched by Lightning) waits for rank 0's base
        time.sleep(0.1)
    torch.manual_seed(1)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.1, init_lora_weights="gaussian"))
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randint(3, 16, (32, 8), generator=g)), batch_size=2)
    module = LoRAModule(model, root / "losses", fsdp2=args.strategy == "fsdp2", compiled=args.compile)
    trainer.fit(module, data, DataLoader(TensorDataset(PROBE)))


if __name__ == "__main__":
    main()
