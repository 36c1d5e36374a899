"""The demo's task and model: a character-level tokenizer, sums of two numbers as text, a tiny
Llama in a LightningModule, greedy generation from an export."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.utils.data import Dataset


if TYPE_CHECKING:
    pass
from areal_lightning.tools.demo.config import CHARS, DemoTrainConfig, SPECIAL_TOKENS


def build_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast`` for digits, ``+`` and ``=`` (adds ``<bos>``)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


class AdditionDataset(Dataset):
    """``num_samples`` strings ``"a+b=c"`` with ``0 <= a, b < max_operand``, tokenised and padded."""

    def __init__(self, tokenizer: Any, num_samples: int, max_operand: int, seed: int) -> None:
        rng = random.Random(seed)
        texts = []
        for _ in range(num_samples):
            a, b = rng.randrange(max_operand), rng.randrange(max_operand)
            texts.append(f"{a}+{b}={a + b}")
        ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        self.seq_len = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id
        self.input_ids = torch.tensor([x + [pad] * (self.seq_len - len(x)) for x in ids])
        self.attention_mask = (self.input_ids != pad).long()
        # Learn the answer only: the operands are random, so predicting them is noise.
        eq = tokenizer.convert_tokens_to_ids("=")
        answer = (self.input_ids == eq).long().cumsum(dim=1) - (self.input_ids == eq).long()
        self.labels = self.input_ids.masked_fill((answer == 0) | (self.attention_mask == 0), -100)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


_CLASSES: dict[str, type] = {}


def _tiny_causal_lm_class() -> type:
    """``TinyCausalLM``, defined on first use: importing this module does not import Lightning
    (the demo's parent process only starts workers, reads files and generates)."""
    if "TinyCausalLM" in _CLASSES:
        return _CLASSES["TinyCausalLM"]
    import lightning.pytorch as pl

    class TinyCausalLM(pl.LightningModule):
        """A LightningModule holding a tiny ``LlamaForCausalLM`` as ``self.model`` and its ``tokenizer``."""

        def __init__(self, tokenizer: Any, cfg: DemoTrainConfig, seq_len: int = 16) -> None:
            super().__init__()
            from transformers import LlamaConfig, LlamaForCausalLM

            self.tokenizer = tokenizer
            self.lr = cfg.lr
            mcfg = LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.hidden_size * 2,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_heads,
                max_position_embeddings=max(32, seq_len * 2),
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                tie_word_embeddings=False,
            )
            self.model = LlamaForCausalLM(mcfg)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

    # picklable by name: the package re-exports it (its module __getattr__)
    TinyCausalLM.__module__, TinyCausalLM.__qualname__ = "areal_lightning.tools.demo", "TinyCausalLM"
    _CLASSES["TinyCausalLM"] = TinyCausalLM
    return TinyCausalLM

def generate(model_dir: Path, prompts: Sequence[str]) -> list[str]:
    """Load an export with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and complete ``prompts`` greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            gen = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
            outs.append(tok.decode(gen[0], skip_special_tokens=True))
    return outs
