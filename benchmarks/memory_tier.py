"""The memory tier of RecoverCallback: what training waits for each step, and what a resume gains.

Usage::

    python benchmarks/memory_tier.py --json benchmarks/results/memory_tier.json
        [--hidden 512 --layers 8 --vocab 32000]   # a Llama of about 50M parameters (the default)
        [--steps 8] [--ranks 2] [--no-moto]

A real Lightning ``Trainer`` (CPU) trains a Llama built from its config, with ``RecoverCallback``:

1. **blocked**: one process, the memory tier on ``/dev/shm`` every step (each run in a fresh
   process, the shared tier's final save on ``/dev/shm`` too: see :func:`child_runs`). Per step, what the save
   point held training for the tier (the copy of the state into its slot, plus any wait for a
   slot: the stall), and the wait before the next optimizer step for the slot's seal (written
   in the background meanwhile; on CUDA also the device copy's checksums), read from the callback's
   ``checkpoint/memory/*`` metrics, against the peer: a host copy of the same tensors
   (``copy_`` into buffers made once) at every step's start, in the same run (so in the same
   conditions as the save point), and one ``memcpy`` of the same bytes after the run. Also the step time with and without the tier.
2. **stall**: ``--ranks`` DDP ranks (gloo), the tier every step and the shared tier every 4
   steps (copied from the slots, on ``/dev/shm``): the stall as a share of the step, and the step time against
   the same run without the tier.
3. **resume**: a run crashed after step 6 (tier every step, shared tier every 4 steps on
   ``--workdir`` disk): the time from ``fit`` to the first trained batch of the rerun when it
   resumes from the memory tier, from the shared tier on disk, and from the shared tier in a
   moto S3 bucket; and the steps trained twice in each (each run in a fresh process).

Medians; a table and JSON. The disk here is noisy: the tier itself is on ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_json  # noqa: E402

WHERE = dict(experiment_name="bench", trial_name="t", user="bench")


def make_module(args: argparse.Namespace) -> Any:
    import lightning.pytorch as pl
    from transformers import LlamaConfig, LlamaForCausalLM

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(LlamaConfig(
                vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                max_position_embeddings=64, tie_word_embeddings=False))
            self.step_s: list[float] = []
            self._t = 0.0

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._t = time.perf_counter()
            if not hasattr(self, "first_batch_at"):
                self.first_batch_at = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.step_s.append(time.perf_counter() - self._t)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return LM()


def loader(args: argparse.Namespace, n: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randint(0, args.vocab, (n * args.batch, args.seq), generator=g)),
                      batch_size=args.batch)


class Metrics:
    """A logger keeping every logged metric (the memory tier's per-step numbers)."""

    def __new__(cls) -> Any:
        from lightning.pytorch.loggers.logger import Logger

        class _Metrics(Logger):
            def __init__(self) -> None:
                super().__init__()
                self.rows: list[dict[str, float]] = []

            name = "metrics"
            version = 0

            def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
                self.rows.append(dict(metrics))

            def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
                pass

        return _Metrics()


def fit(args: argparse.Namespace, root: Path, *, memory: bool, steps: int, devices: int = 1,
        freq_steps: int | None = None, crash_after: int | None = None, fileroot: str | None = None,
        storage_options: dict[str, Any] | None = None, peer_copy: bool = False) -> dict[str, Any]:
    import lightning.pytorch as pl

    from areal_lightning import RecoverCallback

    class Crash(Exception):
        pass

    class CrashAfter(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if crash_after is not None and trainer.global_step == crash_after + 1:
                raise Crash()

    class PeerCopy(pl.Callback):
        """The peer, in the same conditions as the tier's save point: at each batch start (before
        the step's own timer starts; the state the last save point copied), a host copy of
        every tensor of the model and the optimizers into buffers made once. Only in the runs
        that measure it (``peer_copy``): a resumed run's first batch would wait for its first
        copy into fresh buffers (0.3-0.5 s here, counted as resume time before this was fixed)."""

        def __init__(self) -> None:
            self.buffers: list[torch.Tensor] | None = None
            self.copy_s: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, *a: Any) -> None:
            if not peer_copy or trainer.global_step == 0:
                return
            state = [t.detach() for t in pl_module.state_dict().values()] + [
                v for opt in trainer.optimizers for st in opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.numel()]
            if self.buffers is None:
                self.buffers = [torch.empty_like(t) for t in state]
            start = time.perf_counter()
            for b, t in zip(self.buffers, state):
                b.copy_(t)
            self.copy_s.append(time.perf_counter() - start)

    peer = PeerCopy()

    pl.seed_everything(0, verbose=False)
    module = make_module(args)
    metrics = Metrics()
    recover = RecoverCallback(fileroot=fileroot or str(root), **WHERE, freq_steps=freq_steps,
                              storage_options=storage_options,
                              memory={"root": str(Path(args.shm) / root.name)} if memory else None)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         max_steps=steps, callbacks=[CrashAfter(), peer, recover], logger=metrics,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1)
    start = time.perf_counter()
    try:
        trainer.fit(module, loader(args, steps + 2))
    except Crash:
        pass
    first = getattr(module, "first_batch_at", start) - start
    state = [t for t in module.state_dict().values()] + [
        v for opt in trainer.optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    trained = (recover.resumed_from.global_step + 1) if recover.resumed_from is not None else 0
    return {"rank": trainer.global_rank, "step_s": module.step_s, "rows": metrics.rows, "first_batch_s": first,
            "state": state, "resumed_after": trained, "peer_copy_s": peer.copy_s}


def host_copy_s(state: list[torch.Tensor], repeats: int = 5) -> tuple[float, float, int]:
    """Median seconds of ``copy_`` of every tensor into buffers made once, and of one memcpy of the same bytes."""
    state = [t.detach() for t in state if t.numel()]
    buffers = [torch.empty_like(t) for t in state]
    nbytes = sum(t.numel() * t.element_size() for t in state)
    flat_src = torch.empty(nbytes, dtype=torch.uint8)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8)
    flat_src.fill_(1)
    flat_dst.fill_(1)
    copies, memcpys = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b, t in zip(buffers, state):
            b.copy_(t)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        flat_dst.copy_(flat_src)
        memcpys.append(time.perf_counter() - t0)
    return statistics.median(copies), statistics.median(memcpys), nbytes


def child_runs(args: argparse.Namespace, work: Path, ranks: int, freq_steps: int | None) -> dict[bool, dict[str, Any]]:
    """The run without and with the tier, each in a fresh process (``ranks`` DDP ranks when > 1):
    a run right after another in one process has slow steps for seconds (the kernel busy with the
    memory the first one freed: measured, not explained), which is no cost of the tier."""
    out = {}
    for memory in (False, True):
        result = work / f"child_{ranks}_{memory}.json"
        cmd = [sys.executable, __file__, "--_child", str(result), "--hidden", str(args.hidden), "--layers",
               str(args.layers), "--vocab", str(args.vocab), "--steps", str(args.steps), "--ranks", str(ranks),
               "--workdir", str(work), "--shm", args.shm, "--seq", str(args.seq), "--batch", str(args.batch)]
        cmd += ["--_memory"] if memory else []
        cmd += ["--_freq-steps", str(freq_steps)] if freq_steps else []
        subprocess.run(cmd, check=True, timeout=3600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out[memory] = json.loads(result.read_text())
    return out


def blocked(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One process: what the tier holds each step against a host copy of the same state."""
    runs = child_runs(args, work, 1, None)
    on, off = runs[True], runs[False]
    return {"state_mb": on["state_mb"], "blocked_s": on["blocked_s"], "stall_s": on["stall_s"],
            "host_copy_s": on["host_copy_s"], "memcpy_s": on["memcpy_s"],
            "blocked_vs_host_copy": on["blocked_s"] / on["host_copy_s"],
            "blocked_vs_memcpy": on["blocked_s"] / on["memcpy_s"],
            "optimizer_wait_s": on["wait_s"], "held_s": on["blocked_s"] + on["wait_s"],
            "held_vs_host_copy": (on["blocked_s"] + on["wait_s"]) / on["host_copy_s"],
            "step_s_off": off["step_s"], "step_s_on": on["step_s"]}


def stall(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``--ranks`` DDP ranks, the shared tier every 4 steps copied from the slots."""
    runs = child_runs(args, work, args.ranks, 4)
    on, off = runs[True], runs[False]
    return {"ranks": args.ranks, "step_s_off": off["step_s"], "step_s_on": on["step_s"],
            "stall_s": on["stall_s"], "stall_share": on["stall_s"] / on["step_s"] if on["step_s"] else 0.0,
            "blocked_s": on["blocked_s"], "overhead": on["step_s"] / off["step_s"] - 1}


def child(args: argparse.Namespace) -> None:
    name = f"child_{args.ranks}_{args._memory}"
    result = fit(args, Path(args.workdir) / name, memory=args._memory, steps=args.steps, devices=args.ranks,
                 freq_steps=args._freq_steps, fileroot=str(Path(args.shm) / "shared" / name), peer_copy=args._memory)
    rows = [r for r in result["rows"] if "checkpoint/memory/blocked_s" in r][1:]  # the first maps the slot files
    waits = [r["checkpoint/memory/optimizer_wait_s"] for r in result["rows"]
             if "checkpoint/memory/optimizer_wait_s" in r][1:]
    doc = {"step_s": statistics.median(result["step_s"][1:]),
           "stall_s": statistics.mean(r["checkpoint/memory/stall_s"] for r in rows) if rows else 0.0,
           "blocked_s": statistics.median(r["checkpoint/memory/blocked_s"] for r in rows) if rows else 0.0,
           "wait_s": statistics.median(waits) if waits else 0.0}
    if args._memory:
        _, memcpy_s, nbytes = host_copy_s(result["state"])
        copy_s = statistics.median(result["peer_copy_s"][1:])  # the first fills fresh buffers
        doc.update(host_copy_s=copy_s, memcpy_s=memcpy_s, state_mb=nbytes / 1e6)
    if result["rank"] == 0:
        Path(args._child).write_text(json.dumps(doc))


def resume(args: argparse.Namespace, work: Path, moto: bool) -> dict[str, Any]:
    """Each case: a run crashed after step 6, then its rerun, each in a fresh process (so that no
    case pays the others' first-use costs: imports, the first load)."""
    out: dict[str, Any] = {}
    cases = [("memory", None), ("shared disk", None)]
    server = None
    options = None
    if moto:
        from objectstore import start_moto

        server, endpoint = start_moto()
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                     region_name="us-east-1").create_bucket(Bucket="bench")
        options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench",
                   "client_kwargs": {"region_name": "us-east-1"}}
        cases.append(("shared moto s3", "s3://bench/memory-tier"))
    try:
        for name, fileroot in cases:
            root = work / f"resume_{name.replace(' ', '_')}"
            for phase in ("crash", "rerun"):
                if phase == "rerun" and name != "memory":
                    shutil.rmtree(Path(args.shm) / root.name)  # the node and its tier lost
                result = work / f"{root.name}_{phase}.json"
                cmd = [sys.executable, __file__, "--_resume", json.dumps(
                           {"root": str(root), "phase": phase, "fileroot": fileroot,
                            "storage_options": options if fileroot else None, "result": str(result)}),
                       "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
                       "--steps", str(args.steps), "--shm", args.shm, "--seq", str(args.seq), "--batch", str(args.batch)]
                subprocess.run(cmd, check=True, timeout=3600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rerun = json.loads(result.read_text())
            out[name] = {"first_batch_s": rerun["first_batch_s"], "resumed_after_step": rerun["resumed_after"],
                         "steps_trained_twice": 7 - rerun["resumed_after"]}
    finally:
        if server is not None:
            server.kill()
            server.wait()
    return out


def resume_child(args: argparse.Namespace) -> None:
    case = json.loads(args._resume)
    common = dict(memory=True, freq_steps=4, fileroot=case["fileroot"], storage_options=case["storage_options"])
    if case["phase"] == "crash":
        result = fit(args, Path(case["root"]), steps=args.steps, crash_after=6, **common)
    else:
        result = fit(args, Path(case["root"]), steps=8, **common)
    Path(case["result"]).write_text(json.dumps({"first_batch_s": result["first_batch_s"],
                                                "resumed_after": result["resumed_after"]}))


def report(doc: dict[str, Any]) -> str:
    b, s, r = doc["blocked"], doc.get("stall"), doc["resume"]
    lines = [f"state {b['state_mb']:.0f} MB (model + AdamW), one process, the tier on /dev/shm every step",
             f"{'measure':<44}{'seconds':>10}{'ratio':>10}",
             f"{'blocked per step (copy into the slot + stall)':<44}{b['blocked_s']:>10.4f}",
             f"{'  peer: host copy of the same tensors':<44}{b['host_copy_s']:>10.4f}{b['blocked_vs_host_copy']:>10.2f}",
             f"{'  peer: one memcpy of the same bytes':<44}{b['memcpy_s']:>10.4f}{b['blocked_vs_memcpy']:>10.2f}",
             f"{'wait before the next optimizer step (seal)':<44}{b['optimizer_wait_s']:>10.4f}",
             f"{'held per step: save point + that wait':<44}{b['held_s']:>10.4f}{b['held_vs_host_copy']:>10.2f}",
             f"{'step without / with the tier':<44}{b['step_s_off']:>10.3f}{b['step_s_on'] / b['step_s_off']:>10.2f}"]
    if s:
        lines += [f"{s['ranks']} DDP ranks, shared tier every 4 steps copied from the slots:",
                  f"{'  stall per step (mean) / share of a step':<44}{s['stall_s']:>10.4f}{s['stall_share']:>10.3f}",
                  f"{'  step without / with the tier':<44}{s['step_s_off']:>10.3f}{1 + s['overhead']:>10.2f}"]
    lines.append("resume after a crash at step 7 (tier every step, shared tier every 4):")
    base = r["memory"]["first_batch_s"]
    for name, row in r.items():
        lines.append(f"{'  from ' + name + ' to the first batch':<44}{row['first_batch_s']:>10.3f}"
                     f"{row['first_batch_s'] / base:>10.2f}   steps trained twice: {row['steps_trained_twice']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=2, help="DDP ranks of the stall measure (0: skip it)")
    parser.add_argument("--no-moto", action="store_true", help="skip the resume from a moto S3 bucket")
    parser.add_argument("--workdir", default=None, help="where the shared tier's temporary folder goes (default: /tmp)")
    parser.add_argument("--shm", default="/dev/shm/areal-bench-memory-tier", help="the memory tier's root")
    parser.add_argument("--_child", dest="_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--_resume", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_freq-steps", dest="_freq_steps", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args._child:
        child(args)
        return
    if args._resume:
        resume_child(args)
        return
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-memory-tier-", dir=args.workdir))  # removed at the end
    try:
        doc: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "json"}}
        doc["config"]["json"] = str(args.json) if args.json else None
        doc["blocked"] = blocked(args, work)
        if args.ranks > 1:
            doc["stall"] = stall(args, work)
        doc["resume"] = resume(args, work, moto=not args.no_moto)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for name in ("child_1_False", "child_1_True", f"child_{args.ranks}_False", f"child_{args.ranks}_True",
                     "resume_memory", "resume_shared_disk", "resume_shared_moto_s3", "shared"):
            # the folders this run made (not the root itself)
            shutil.rmtree(Path(args.shm) / name, ignore_errors=True)
    print(report(doc))
    write_json(args.json, doc)


if __name__ == "__main__":
    main()
