"""The training job of the kill-anywhere suite, written for ``areal-lightning certify``.

    python tests/fault/train_fault.py --root {root} --mode {mode} [--devices 2] [--no-hf]
        [--epochs N] [--samples N] [--freq-steps N] [--hf-freq-steps N] [--max-keep N] [--memory]

A tiny Llama (1 layer, hidden size 16, attention dropout so the RNG state matters) learns
random token sequences from a shuffled plain ``DataLoader`` with AdamW and a per-step LR
schedule: by default 2 epochs of 8 steps. ``RecoverCallback`` checkpoints every
``--freq-steps`` steps (4: one checkpoint at the end of epoch 0, where resuming must start
epoch 1 at its first step) and ``HFSaverCallback`` exports every ``--hf-freq-steps`` steps
keeping ``--max-keep`` exports (so both the recover and the HF fault points are reached,
max_keep deletions included), both in ``--mode``.
``areal_lightning.tools.certify.LossRecorder`` records every step's loss for certify.
``--devices 2``: ``strategy="ddp"`` on 2 CPU processes (gloo). ``--memory``: the memory tier
too, a slot after every step, in ``{root}/memory`` (where certify's oracle finds its seals).
"""

from __future__ import annotations

import argparse
import os
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from areal_lightning import HFSaverCallback, RecoverCallback
from areal_lightning.tools.certify import LossRecorder

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=16, attention_dropout=0.2,
            bos_token_id=1, eos_token_id=2, pad_token_id=0))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--mode", default="sync", choices=["sync", "async", "auto"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=32, help="4 per batch: 8 steps per epoch on one process")
    p.add_argument("--freq-steps", type=int, default=4)
    p.add_argument("--hf-freq-steps", type=int, default=3)
    p.add_argument("--max-keep", type=int, default=2)
    p.add_argument("--memory", action="store_true", help="the memory tier too, every step, in {root}/memory")
    args = p.parse_args()

    pl.seed_everything(0, workers=True, verbose=False)
    g = torch.Generator().manual_seed(1234)
    data = DataLoader(TensorDataset(torch.randint(3, 16, (args.samples, 8), generator=g)), batch_size=4, shuffle=True)
    where = dict(fileroot=args.root, experiment_name="exp", trial_name="t", user="u")
    memory = {"root": os.path.join(args.root, "memory")} if args.memory else None
    callbacks = [LossRecorder(), RecoverCallback(**where, freq_steps=args.freq_steps, io_mode=args.mode,
                                                 memory=memory)]
    if not args.no_hf:
        callbacks.append(HFSaverCallback(**where, mode=args.mode, freq_steps=args.hf_freq_steps,
                                         max_keep=args.max_keep))
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=args.devices,
                         strategy="ddp" if args.devices > 1 else "auto", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(TinyLM(), data)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # as torch recommends for every multi-process script
        torch.distributed.destroy_process_group()
