"""Multi-process HF export runs for ``tests/test_hf_distributed.py`` (one process per rank).

    LOCAL_RANK=r NODE_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python tests/scripts/hf_distributed_train.py --out DIR --cases JSON

The test starts one process per rank itself (as ``torchrun`` would), so Lightning neither
spawns nor kills ranks and each rank reports its own outcome. ``--cases`` is a JSON list;
each case is one ``trainer.fit`` on 2 CPU ranks (gloo), run in order in the same processes:

    {"strategy": "fsdp" | "fsdp1" | "ddp", "arch": "llama" | "gpt2", "mode": "sync" | "async",
     "method": "gather" | "dcp", "max_shard_size": int | null, "max_keep": int | null,
     "extra_buffers": bool, "compiled": bool, "fault": "point[@N]" | null}

``fsdp`` is Lightning's ``ModelParallelStrategy`` with ``fully_shard`` applied to every
decoder layer and to the model root in ``configure_model``; ``fsdp1`` is Lightning's
``FSDPStrategy`` (torch FSDP1, on CPU through ``tests/fsdp1_cpu.py``) auto-wrapping every
decoder layer; ``extra_buffers`` registers
persistent int64, bool and 0-dim buffers (which DCP cannot consolidate); ``compiled``
``torch.compile``s the model in ``configure_model`` (after sharding; eager backend). For case ``i`` rank
0 writes ``DIR/case{i}/ref/step{G}.safetensors``: the full weights after global step G
(0-based), gathered in the same run, after the export of that step was taken. Every rank
writes ``DIR/case{i}/rank{r}.json``: whether the fit raised (type and message), what
``HFSaverCallback.save`` returned on that rank, the threads exports were published in,
the resolved mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (fsdp1_cpu)
from torch.utils.data import DataLoader, TensorDataset

from areal_lightning import HFSaverCallback
from areal_lightning._fault import ENV_VAR, reset_fault_counts
from areal_lightning.capture.compiled import plain_name

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 100


def build_model(arch: str) -> Any:
    """A tiny transformers model from a config (same weights on every rank)."""
    torch.manual_seed(0)
    if arch == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=True))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0))


def add_extra_buffers(model: Any) -> None:
    """Persistent int64, bool and 0-dim buffers (DCP's consolidation cannot write these)."""
    inner = model.base_model
    inner.register_buffer("areal_test_ids", torch.arange(7, dtype=torch.int64))
    inner.register_buffer("areal_test_mask", torch.tensor([True, False, True]))
    inner.register_buffer("areal_test_scale", torch.tensor(0.5))


def decoder_layers(model: Any) -> Any:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


class LM(pl.LightningModule):
    def __init__(self, arch: str, fsdp: bool, extra_buffers: bool, compiled: bool = False) -> None:
        super().__init__()
        from areal_lightning.tools.demo import build_tokenizer

        self.model = build_model(arch)
        self.tokenizer = build_tokenizer()
        self.fsdp, self.compiled = fsdp, compiled
        if extra_buffers:
            add_extra_buffers(self.model)

    def configure_model(self) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in decoder_layers(self.model):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        if self.compiled:
            self.model = torch.compile(self.model, backend="eager")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Reference(pl.Callback):
    """After the saver: the full weights after each step, gathered in the same run (rank 0 writes)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: LM, outputs: Any, batch: Any, batch_idx: int) -> None:
        from safetensors.torch import save_file
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.tensor import DTensor

        if isinstance(trainer.strategy.model, FullyShardedDataParallel):  # FSDP1: all ranks take part
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
            state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        else:
            state = {plain_name(k): v for k, v in pl_module.model.state_dict().items()}  # (torch.compile)
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().contiguous()
                for k, v in state.items()}
        if trainer.is_global_zero:
            self.folder.mkdir(parents=True, exist_ok=True)
            save_file(full, str(self.folder / f"step{trainer.global_step - 1}.safetensors"))


class Recording(HFSaverCallback):
    """HFSaverCallback that also records what ``save`` returned on this rank and in which
    thread each export was published."""

    returned: list[str | None]
    published_in: list[str]

    def save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path | None:
        out = super().save(trainer, pl_module)
        self.returned.append(str(out) if out is not None else None)
        return out

    def _published(self, final: Path, start: float, step: int, blocked: float | None) -> None:
        self.published_in.append(threading.current_thread().name)
        super()._published(final, start, step, blocked)


def run_case(index: int, case: dict[str, Any], out: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    rank = int(os.environ["LOCAL_RANK"])
    folder = out / f"case{index}"
    fsdp = case["strategy"] == "fsdp"
    reset_fault_counts()
    if case.get("fault"):
        os.environ[ENV_VAR] = case["fault"]
    saver = Recording(fileroot=folder / "root", experiment_name="e", trial_name="t", user="u", mode=case["mode"],
                      freq_steps=2, freq_epochs=1, sharded_method=case.get("method", "gather"),
                      max_shard_size=case.get("max_shard_size") or "5GB", max_keep=case.get("max_keep"))
    saver.returned, saver.published_in = [], []
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randint(3, VOCAB, (32, 8), generator=g)), batch_size=4, shuffle=False)
    if case["strategy"] == "fsdp1":
        from fsdp1_cpu import CPUFSDPStrategy
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        strategy = CPUFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer, GPT2Block})
    elif fsdp:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = "ddp"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[saver, Reference(folder / "ref")])
    result: dict[str, Any] = {"error": None, "error_type": None}
    try:
        trainer.fit(LM(case["arch"], fsdp, case.get("extra_buffers", False), case.get("compiled", False)), data)
    except BaseException as exc:  # reported, then the next case runs
        result.update(error=f"{exc}\n{traceback.format_exc()[-3000:]}", error_type=type(exc).__name__)
    finally:
        os.environ.pop(ENV_VAR, None)
    result.update(returned=saver.returned, published_in=saver.published_in, resolved_mode=saver.resolved_mode,
                  model_dir=str(saver.model_dir))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(result, indent=2))


def main() -> None:
    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True, help="JSON list of cases")
    args = p.parse_args()
    for index, case in enumerate(json.loads(args.cases)):
        run_case(index, case, Path(args.out))


if __name__ == "__main__":
    main()
