"""A LoRA Llama trained with HFSaverCallback(peft_export=...) and RecoverCallback, on 1 or 2
CPU ranks (``strategy="ddp"``, gloo; Lightning starts the second rank).

    python tests/scripts/train_peft.py --root DIR [--devices 2] [--export both] [--mode async]

Rank 0 writes ``DIR/live_logits.pt``: the live model's logits on a fixed input after the last
step (the last export is of that step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from areal_lightning import HFSaverCallback, RecoverCallback  # noqa: E402
from tests.conftest import LMModule, tiny_llama  # noqa: E402


def main() -> None:
    import peft
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--export", default="both")
    p.add_argument("--mode", default="sync")
    args = p.parse_args()
    root = Path(args.root)
    base_dir = root / "base"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not base_dir.exists():
        tiny_llama().save_pretrained(base_dir)
    pl.seed_everything(0, verbose=False)
    where = dict(fileroot=root, experiment_name="e", trial_name="t", user="u")
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=args.devices,
                         strategy="ddp" if args.devices > 1 else "auto", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[RecoverCallback(**where, freq_steps=4),
                                    HFSaverCallback(**where, freq_steps=4, mode=args.mode, peft_export=args.export)])
    while not (base_dir / "model.safetensors").exists():  # rank 1 (launched by Lightning) waits for rank 0's base
        time.sleep(0.1)
    torch.manual_seed(1)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                lora_dropout=0.1, init_lora_weights="gaussian"))
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randint(3, 16, (32, 8), generator=g)), batch_size=2)
    module = LMModule(model)
    trainer.fit(module, data)
    if trainer.is_global_zero:
        model.eval()
        with torch.no_grad():
            torch.save(model(input_ids=torch.arange(3, 11).view(1, 8)).logits, root / "live_logits.pt")


if __name__ == "__main__":
    main()
