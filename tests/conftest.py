"""Shared fixtures: tiny real transformers models (built from configs, never downloaded)."""

from __future__ import annotations

import os
import signal
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")

VOCAB = 16


def tiny_llama() -> Any:
    """A 2-layer Llama with a 16-token vocabulary (a few thousand parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
    )


def tiny_gpt2() -> Any:
    """A 1-layer GPT-2 with tied input/output embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    )


class LMModule(pl.LightningModule):
    """Holds a ``PreTrainedModel`` as ``self.model`` (and optionally ``self.tokenizer``)."""

    def __init__(self, model: Any, tokenizer: Any = None, lr: float = 1e-2) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Crash(Exception):
    """Raised by :class:`CrashAt`: an in-process stand-in for a crash (a SIGKILL elsewhere)."""


class CrashAt(pl.Callback):
    """Raises :class:`Crash` at the end of the batch where ``global_step == step`` (put it before
    the checkpoint callbacks: it fires before that step's saves)."""

    def __init__(self, step: int, kill: bool = False) -> None:
        self.step, self.kill = step, kill

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            if self.kill:  # a real crash: this process is SIGKILLed
                os.kill(os.getpid(), signal.SIGKILL)
            raise Crash(f"crash at step {self.step}")


def token_loader(n_batches: int = 8, batch_size: int = 4, seq_len: int = 8, seed: int = 0) -> DataLoader:
    """A deterministic loader of random token ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n_batches * batch_size, seq_len), generator=g)
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=False)


def make_trainer(callbacks: list, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


@pytest.fixture
def tokenizer() -> Any:
    from areal_lightning.tools.demo import build_tokenizer

    return build_tokenizer()
