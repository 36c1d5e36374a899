"""Exit-code stress: many short 2-rank training jobs, every process must exit with its expected code.

    python tests/stress/exit_stress.py --out DIR [--rounds N] [--parallel P] [--kinds K,K,...] [--json FILE]

A job is two ranks of a real Lightning run (a tiny Llama fine-tuned with ``RecoverCallback`` and
``HFSaverCallback``) that ends in one of three ways, each with its exit code:

* ``normal``: training finishes; both ranks exit 0;
* ``preempt``: rank 1 gets SIGTERM after step 5; every rank checkpoints that step and exits 75;
* ``exception``: ``training_step`` raises on both ranks at step 5 (a user error); both exit 1.

Kinds are ``{ddp,fsdp1}-{sync,async}-{normal,preempt,exception}``; each round runs every kind
once. A process that ends any other way (SIGABRT after a finished run: ``terminate called
without an active exception``; a hang, killed after ``--timeout``) is a failure. Each rank also
records, in its last atexit hook, the native threads still alive just before the interpreter
finalizes (``threads_at_exit`` in the JSON).

Imports cost more than these jobs, so this process imports torch, Lightning, transformers and
areal_lightning once and forks each rank from itself (torchrun-style environment variables, so
Lightning launches nothing). A forked rank returns from :func:`main` and runs its job as the body
of this script, ending through the normal interpreter exit: atexit handlers, thread shutdown and
finalization -- the path on which the aborts happened.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (fsdp1_cpu)
from fsdp1_cpu import CPUFSDPStrategy  # noqa: E402
from harness.callbacks import SignalAt  # noqa: E402

from areal_lightning import HFSaverCallback, RecoverCallback  # noqa: E402

EXPECTED = {"normal": 0, "preempt": 75, "exception": 1}
KINDS = [f"{s}-{io}-{end}" for s in ("ddp", "fsdp1") for io in ("sync", "async") for end in EXPECTED]
STEP = 5  # the step after which a job is preempted or fails


@dataclass
class Job:
    """One rank of one job (what a forked child runs)."""

    kind: str
    rank: int
    root: Path

    @property
    def strategy(self) -> str:
        return self.kind.split("-")[0]

    @property
    def io(self) -> str:
        return self.kind.split("-")[1]

    @property
    def end(self) -> str:
        return self.kind.split("-")[2]


class LM(pl.LightningModule):
    def __init__(self, fail_at: int | None) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16, bos_token_id=1, eos_token_id=2, pad_token_id=0))
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError(f"user error at step {self.global_step}")
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run_job(job: Job) -> None:
    """The body of one rank's training script."""
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randint(3, 16, (64, 8), generator=g)), batch_size=4, shuffle=True)
    paths = dict(fileroot=job.root, experiment_name="stress", trial_name="t", user="u")
    callbacks: list[pl.Callback] = [
        HFSaverCallback(**paths, freq_steps=4, mode=job.io),
        RecoverCallback(**paths, freq_steps=2, io_mode=job.io),
    ]
    if job.end == "preempt" and job.rank == 1:
        callbacks.insert(0, SignalAt(STEP))
    strategy = CPUFSDPStrategy() if job.strategy == "fsdp1" else "ddp"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(LM(STEP if job.end == "exception" else None), loader)


def _threads() -> dict[str, int]:
    """This process's native threads by name (``pt_gloo_runloop``: a gloo group's worker)."""
    names = collections.Counter()
    for task in Path("/proc/self/task").iterdir():
        try:
            names[(task / "comm").read_text().strip()] += 1
        except OSError:  # ended meanwhile
            pass
    return dict(names)


def _record_exit_state(job: Job) -> None:
    """At exit, after every atexit hook registered later (areal_lightning's among them): the
    threads still alive while the interpreter is about to finalize."""
    (job.root / f"rank{job.rank}.exit.json").write_text(json.dumps({"threads": _threads()}))


def _fork_rank(job: Job, port: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    # The child: a rank of a torchrun-style launch, its output in its own log.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(job.rank),
                      LOCAL_RANK=str(job.rank), NODE_RANK="0", LOCAL_WORLD_SIZE="2")
    log = os.open(job.root / f"rank{job.rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    atexit.register(_record_exit_state, job)  # before any hook of the job: runs after them
    raise _RunJob(job)


class _RunJob(BaseException):
    """Unwinds a forked child out of the parent's loop, to run its job as the script's body."""

    def __init__(self, job: Job) -> None:
        self.job = job


@dataclass
class _Running:
    """A job in flight: its two forked ranks."""

    kind: str
    round: int
    root: Path
    pids: dict[int, int]
    start: float
    codes: dict[int, int | str]

    def poll(self, timeout: float) -> bool:
        """Collect the exit codes of ranks that ended (negative: the signal); kill the rest as
        ``"hang"`` once ``timeout`` has passed. True when both ranks are done."""
        for rank, pid in self.pids.items():
            if rank not in self.codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[rank] = os.waitstatus_to_exitcode(status)
        if len(self.codes) < len(self.pids) and time.monotonic() > self.start + timeout:
            for rank, pid in self.pids.items():
                if rank not in self.codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    self.codes[rank] = "hang"
        return len(self.codes) == len(self.pids)

    def result(self) -> dict:
        want = EXPECTED[self.kind.split("-")[2]]
        at_exit = {}
        for rank in self.pids:
            state = self.root / f"rank{rank}.exit.json"
            at_exit[rank] = json.loads(state.read_text())["threads"] if state.is_file() else None
        return {"kind": self.kind, "round": self.round, "codes": self.codes, "expected": want,
                "ok": all(c == want for c in self.codes.values()),
                "seconds": round(time.monotonic() - self.start, 2), "dir": str(self.root), "threads_at_exit": at_exit}


def stress(out: Path, kinds: list[str], rounds: int, timeout: float, parallel: int = 1) -> dict:
    """Run ``rounds`` x ``kinds`` jobs, ``parallel`` at a time; the summary (see the module doc)."""
    queue = [(r, kind) for r in range(rounds) for kind in kinds]
    running: list[_Running] = []
    results = []
    began = time.monotonic()
    while queue or running:
        while queue and len(running) < parallel:
            r, kind = queue.pop(0)
            root = out / f"{r:03d}-{kind}"
            root.mkdir(parents=True)
            port = find_free_network_port()
            running.append(_Running(kind, r, root, {rank: _fork_rank(Job(kind, rank, root), port) for rank in (0, 1)},
                                    time.monotonic(), {}))
        for job in [j for j in running if j.poll(timeout)]:
            running.remove(job)
            res = job.result()
            results.append(res)
            print(f"{job.kind:24s} round {job.round:3d}: exit codes {job.codes} (expected {res['expected']}) "
                  f"{'ok' if res['ok'] else 'FAILED'} in {res['seconds']:.1f}s", flush=True)
        time.sleep(0.02)
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for res in results:
        for code in res["codes"].values():
            by_kind[res["kind"]][str(code)] += 1
    failed = [res for res in results if not res["ok"]]
    aborts = sum(1 for res in results for c in res["codes"].values() if c == -signal.SIGABRT)
    summary = {"jobs": len(results), "processes": 2 * len(results), "parallel": parallel,
               "failed_jobs": len(failed), "aborted_processes": aborts,
               "by_kind": {k: dict(v) for k, v in by_kind.items()}, "failures": failed,
               "seconds": round(time.monotonic() - began, 1), "all": results}
    print(f"\n{'kind':24s} {'jobs':>5s}  exit codes (count)")
    for kind in kinds:
        n = sum(1 for res in results if res["kind"] == kind)
        print(f"{kind:24s} {n:5d}  {dict(by_kind[kind])}")
    print(f"\n{len(results)} jobs ({parallel} at a time), {2 * len(results)} processes: {len(failed)} jobs failed, "
          f"{aborts} processes aborted (SIGABRT), {summary['seconds']:.0f}s")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="a new folder for the jobs' trials and logs")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a job may take before it counts as a hang")
    p.add_argument("--parallel", type=int, default=1, help="jobs at a time (2: four processes on 2 cores)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        p.error(f"--kinds: unknown {', '.join(unknown)}; allowed: {', '.join(KINDS)}")
    summary = stress(args.out, kinds, args.rounds, args.timeout, args.parallel)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if summary["failed_jobs"] == 0 else 1


if __name__ == "__main__":
    forked: Job | None = None
    try:
        code = main()
    except _RunJob as child:  # a forked rank
        forked = child.job
    if forked is not None:
        run_job(forked)  # its job is this script's body; its exit the normal one of a script
    else:
        sys.exit(code)
