"""An LLM fine-tuning job on Lightning's FSDPStrategy (torch FSDP1), on CPU ranks (gloo).

    python tests/scripts/train_fsdp1.py --root DIR --losses FILE [--devices N] [--num-nodes N]
        [--sharding FULL_SHARD|SHARD_GRAD_OP|NO_SHARD] [--io-mode auto|sync|async]
        [--hf-mode auto|sync|async] [--method gather|dcp] [--kill-at-step N] [--epochs N]
        [--freq-steps N] [--hf-freq-steps N] [--timeout S] [--fault-rank R]
        [--mixed] [--act-ckpt] [--cpu-offload] [--strategy fsdp1|fsdp2|ddp|single]
        [--fileroot URI] [--storage-options JSON] [--memory]

What a user writes: a ``LightningModule`` holding a tiny ``LlamaForCausalLM`` (built from a
config) and a tokenizer, ``auto_wrap_policy={LlamaDecoderLayer}``, a shuffled ``DataLoader``
with a validation loader, ``HFSaverCallback`` and ``RecoverCallback`` with their default
modes (``auto``), and Lightning's own launcher for ``--devices`` ranks. The strategy is
``tests/fsdp1_cpu.CPUFSDPStrategy`` (``FSDPStrategy`` given ``device_id=cpu``); with
``--strategy fsdp2`` Lightning's ``ModelParallelStrategy`` with ``fully_shard`` of every decoder
layer and the model, ``ddp`` Lightning's DDP, ``single`` one process. ``--fileroot`` gives both
callbacks another fileroot than ``--root`` (e.g. ``s3://bucket/prefix``).

Appends one JSON line per optimizer step to ``FILE.rank{r}``: ``{"step", "loss" (hex), "pid"}``.
``--kill-at-step N`` SIGKILLs every rank at the end of step N (before that step's saves).
``--fault-rank R``: the fault points named in ``TEST_FAULT`` fire on rank R only. ``--memory``:
the memory tier too (a slot every step, in ``DIR/memory``).
On an exception each rank writes ``DIR/error.rank{r}.txt`` with the error and exits 3.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (fsdp1_cpu)

# The Lightning namespace (``--namespace pytorch_lightning``; read before Lightning is imported).
NAMESPACE = sys.argv[sys.argv.index("--namespace") + 1] if "--namespace" in sys.argv else "lightning.pytorch"
os.environ["AREAL_NAMESPACE"] = NAMESPACE  # for tests/fsdp1_cpu.py
pl = importlib.import_module(NAMESPACE)

import torch  # noqa: E402
from fsdp1_cpu import CPUFSDPStrategy  # noqa: E402
from harness.callbacks import DumpState, KillAt  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from areal_lightning import HFSaverCallback, RecoverCallback  # noqa: E402

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from areal_lightning.tools.demo import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config), tokenizer


class LM(pl.LightningModule):
    def __init__(self, losses: str, fsdp2: bool = False) -> None:
        super().__init__()
        self.model, self.tokenizer = build_model()
        self.losses_path = losses
        self.fsdp2 = fsdp2

    def configure_model(self):
        if self.fsdp2:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        with open(self.losses_path, "a") as f:  # before any checkpoint of this step
            f.write(json.dumps({"step": self.trainer.global_step + 1, "loss": loss.item().hex(),
                                "pid": os.getpid()}) + "\n")
        return loss

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self.model(input_ids=ids, labels=ids).loss, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(seed: int, n: int, shuffle: bool) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 14, (n, 8), generator=g)
    return DataLoader(TensorDataset(ids), batch_size=2, shuffle=shuffle)


class GPUReport(pl.Callback):
    """``report.rank{r}.json``: backend, peak GPU memory, whether the recover stager's host
    buffers are pinned and not in shared memory (``/dev/shm``)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def on_train_end(self, trainer, pl_module) -> None:
        io = next(cb for cb in trainer.callbacks if isinstance(cb, RecoverCallback)).checkpoint_io
        stager = io.engine.stager  # the recover saves' HostStager
        probe = stager.stage_to_host({"probe": torch.ones(1024, device="cuda")})["probe"]
        report = {"backend": torch.distributed.get_backend(), "gpu": torch.cuda.get_device_name(),
                  "device": torch.cuda.current_device(),
                  "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20,
                  "pinned": probe.is_pinned(), "shared": probe.untyped_storage().is_shared()}
        Path(self.root, f"report.rank{trainer.global_rank}.json").write_text(json.dumps(report))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--namespace", default="lightning.pytorch", choices=["lightning.pytorch", "pytorch_lightning"])
    p.add_argument("--losses", required=True)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--sharding", default="FULL_SHARD")
    p.add_argument("--io-mode", default="auto")
    p.add_argument("--hf-mode", default="auto")
    p.add_argument("--method", default="gather")
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--freq-steps", type=int, default=3)
    p.add_argument("--hf-freq-steps", type=int, default=4)
    p.add_argument("--timeout", type=float, default=None, help="RecoverCallback/HFSaverCallback collective_timeout")
    p.add_argument("--fault-rank", type=int, default=None)
    p.add_argument("--mixed", action="store_true", help="bf16-mixed precision")
    p.add_argument("--act-ckpt", action="store_true", help="activation checkpointing of the decoder layers")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--dump-state", default=None, help="prefix of full model+optimizer dumps (see DumpState)")
    p.add_argument("--gpu", action="store_true", help="CUDA + NCCL with Lightning's own FSDPStrategy (tests/gpu)")
    p.add_argument("--strategy", default="fsdp1", choices=["fsdp1", "fsdp2", "ddp", "single"])
    p.add_argument("--fileroot", default=None, help="both callbacks' fileroot (default: --root)")
    p.add_argument("--lock-lease-s", type=float, default=60.0, help="RecoverCallback(lock_lease_s=...): an object store's trial lease")
    p.add_argument("--storage-options", default=None, help="JSON: both callbacks' storage_options")
    p.add_argument("--memory", action="store_true", help="the memory tier too, a slot every step, in ROOT/memory")
    args = p.parse_args()

    rank = int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK", "0"))  # global (torchrun sets RANK)
    if args.fault_rank is not None:  # the fault is in TEST_FAULT, injected on that rank only
        os.environ.pop("AREAL_LIGHTNING_FAULT", None)
        if rank == args.fault_rank:
            os.environ["AREAL_LIGHTNING_FAULT"] = os.environ["TEST_FAULT"]
    pl.seed_everything(0, workers=True, verbose=False)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    kwargs = {}
    if args.act_ckpt:
        kwargs["activation_checkpointing_policy"] = {LlamaDecoderLayer}
    if args.strategy == "fsdp2":
        strategy = pl.strategies.ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1)
    elif args.strategy in ("ddp", "single"):
        strategy = "ddp" if args.strategy == "ddp" else "auto"
        args.devices = 1 if args.strategy == "single" else args.devices
    else:
        strategy_cls = pl.strategies.FSDPStrategy if args.gpu else CPUFSDPStrategy
        strategy = strategy_cls(auto_wrap_policy={LlamaDecoderLayer}, sharding_strategy=args.sharding,
                                cpu_offload=args.cpu_offload, **kwargs)
    timeout = {} if args.timeout is None else {"collective_timeout": args.timeout}
    common = dict(fileroot=args.fileroot or args.root, experiment_name="exp", trial_name="t", user="u",
                  storage_options=json.loads(args.storage_options) if args.storage_options else None)
    hf = HFSaverCallback(**common, mode=args.hf_mode, freq_steps=args.hf_freq_steps, sharded_method=args.method,
                         **timeout)
    recover = RecoverCallback(**common, freq_steps=args.freq_steps, io_mode=args.io_mode, lock_lease_s=args.lock_lease_s,
                              memory={"root": str(Path(args.root) / "memory")} if args.memory else None, **timeout)
    callbacks = [hf, recover]
    if args.kill_at_step is not None:
        callbacks.insert(0, KillAt(args.kill_at_step))
    if args.dump_state is not None:
        callbacks.insert(0, DumpState(args.dump_state, args.freq_steps))
    if args.gpu:
        callbacks.append(GPUReport(args.root))
    trainer = pl.Trainer(max_epochs=args.epochs, accelerator="gpu" if args.gpu else "cpu", devices=args.devices,
                         num_nodes=args.num_nodes,
                         strategy=strategy,
                         precision="bf16-mixed" if args.mixed else "32-true", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, val_check_interval=5, limit_val_batches=2,
                         num_sanity_val_steps=0, deterministic=True if args.gpu else None)
    losses = f"{args.losses}.rank{trainer.global_rank}"
    module = LM(losses, fsdp2=args.strategy == "fsdp2")
    start = time.monotonic()
    try:
        trainer.fit(module, loader(1, 32, True), loader(2, 8, False))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, then a non-zero exit
        Path(args.root, f"error.rank{rank}.txt").write_text(
            f"{type(exc).__name__}: {exc}\nafter {time.monotonic() - start:.1f} s\n{traceback.format_exc()}")
        # Lightning's launcher ends the other ranks only on KeyboardInterrupt: give them 5 s to
        # end (and report: an agreement fails on every rank within milliseconds) on their own,
        # then end a stuck one (torchrun and SLURM would).
        deadline = time.monotonic() + 5
        children = getattr(trainer.strategy.launcher, "procs", [])
        for proc in children:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        if children:
            # Lightning's child-process observer (a thread of this, the launching process)
            # SIGKILLs this process once it sees a rank exit non-zero, at its next poll (every
            # 5 s): exit now, before it does, with the code the test expects, instead of after
            # the interpreter's teardown (which a loaded 2-core machine made lose that race).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
        return 3
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
