"""The demo job: a tiny Llama learns addition (``"17+25=42"``) while HFSaverCallback exports it.

Nothing is downloaded: the model is built from a ``LlamaConfig`` and the character-level
tokenizer with the ``tokenizers`` library (wrapped as ``PreTrainedTokenizerFast``, so a real
``tokenizer.json`` is exported). Run it with ``areal-lightning demo [--config FILE] [key=value ...]``.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from areal_lightning.config import (
    ConfigError,
    ExperimentConfig,
    SaverConfig,
    load_config,
)
from areal_lightning.lightning import callbacks_from_config

__all__ = ["DemoConfig", "DemoTrainConfig", "build_tokenizer", "AdditionDataset", "TinyCausalLM", "run_demo"]

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789+="


@dataclass
class DemoTrainConfig:
    """Training settings of the demo (the ``train:`` section of ``configs/demo.yaml``)."""

    seed: int = 0
    max_epochs: int = 8
    max_steps: int = -1
    num_samples: int = 4096
    batch_size: int = 64
    lr: float = 1e-3
    max_operand: int = 50
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_generations: int = 4
    accelerator: str = "cpu"
    devices: int = 1
    progress_bar: bool = True

    def validate(self, prefix: str = "train") -> "DemoTrainConfig":
        """Check ranges. Returns ``self``."""
        for name in ("max_epochs", "num_samples", "batch_size", "max_operand", "hidden_size", "num_layers",
                     "num_heads", "devices"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}.{name}", f"expected a positive integer, got {getattr(self, name)}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"{prefix}.max_steps", f"expected -1 (no limit) or a positive integer, got {self.max_steps}")
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr", f"expected a positive number, got {self.lr}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"{prefix}.hidden_size", f"must be a multiple of num_heads={self.num_heads}")
        if self.num_generations < 0:
            raise ConfigError(f"{prefix}.num_generations", f"expected >= 0, got {self.num_generations}")
        return self


@dataclass
class DemoConfig(ExperimentConfig):
    """The demo's whole config: the experiment (paths, ``saver:``, ``recover:``) plus ``train:``."""

    experiment_name: str = "demo"
    saver: SaverConfig = field(default_factory=lambda: SaverConfig(freq_epochs=2, freq_steps=100, max_keep=3))
    train: DemoTrainConfig = field(default_factory=DemoTrainConfig)

    def validate(self) -> "DemoConfig":
        """Validate the experiment part and ``train:``."""
        super().validate()
        self.train.validate()
        return self


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


def run_demo(config: Any = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Train the demo model with the callbacks of ``config``; return a summary dict.

    ``config`` is a YAML path, dict, ``DemoConfig`` or ``None`` (built-in defaults);
    ``overrides`` are dotlist entries (``train.max_epochs=1``).
    """
    cfg: DemoConfig = load_config(config, overrides, schema=DemoConfig)
    t = cfg.train
    pl.seed_everything(t.seed, workers=True, verbose=False)
    tokenizer = build_tokenizer()
    data = AdditionDataset(tokenizer, t.num_samples, t.max_operand, t.seed)
    loader = DataLoader(data, batch_size=t.batch_size, shuffle=True)
    module = TinyCausalLM(tokenizer, t, seq_len=data.seq_len)
    callbacks = callbacks_from_config(cfg, strict=False)
    trainer = pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(module, loader)
    summary: dict[str, Any] = {"global_step": trainer.global_step, "exports": [], "generations": []}
    savers = [c for c in callbacks if hasattr(c, "layout")]
    if savers and trainer.is_global_zero:
        saver = savers[0]
        summary["trial_dir"] = str(saver.layout.trial_dir)
        summary["exports"] = [str(p) for _, p in saver.layout.list_exports(saver.name)]
        if summary["exports"] and t.num_generations:
            rng = random.Random(t.seed + 1)
            pairs = [(rng.randrange(t.max_operand), rng.randrange(t.max_operand)) for _ in range(t.num_generations)]
            prompts = [f"{a}+{b}=" for a, b in pairs]
            summary["generations"] = list(zip(prompts, generate(Path(summary["exports"][-1]), prompts)))
            summary["expected"] = [str(a + b) for a, b in pairs]
    return summary
