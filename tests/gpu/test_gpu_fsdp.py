"""GPU checks: ``strategy="fsdp"`` (FSDP1) with the bridge, pinned-memory async staging and
NCCL, on whatever GPUs exist (1 or 2 ranks). Skipped, with the reason printed, without CUDA.

    python -m pytest tests/gpu -rs        # on a GPU machine; prints timings

Each case is a real training subprocess (tests/gpu/train_gpu.py) killed with SIGKILL and
started again with the same command; the per-step losses of every rank must equal an
uninterrupted run's bit for bit, and every rank must have written its own shard files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.losses import last_losses
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: FSDP1 (strategy='fsdp'), NCCL and pinned-memory staging run on GPUs only "
                f"(torch {torch.__version__}, cuda available: False)", allow_module_level=True)

SCRIPT = Path(__file__).with_name("train_gpu.py")
DEVICES = min(torch.cuda.device_count(), 2)


def train(root: Path, *args: str) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--devices", str(DEVICES), *args],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    print(f"{' '.join(args) or 'uninterrupted'}: rc={proc.returncode} in {time.perf_counter() - start:.1f}s")
    return proc


def losses(root: Path, rank: int) -> dict[int, str]:
    return last_losses(root / f"losses.rank{rank}.jsonl")  # a recomputed step must be equal anyway


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
@pytest.mark.parametrize("io_mode", ["async", "sync"])
def test_gpu_sigkill_resume_is_exact_with_pinned_staging(tmp_path, strategy, io_mode) -> None:
    args = ("--strategy", strategy, "--io-mode", io_mode)
    ref = tmp_path / "ref"
    assert train(ref, *args).returncode == 0
    run = tmp_path / "run"
    killed = train(run, *args, "--kill-at-step", "11")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = train(run, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("RecoverCallback: resumed from") == DEVICES
    ckpt = run / "checkpoints/u/exp/t/default/recover_checkpoint"
    for rank in range(DEVICES):
        assert list(ckpt.glob(f"__{rank}_*.distcp")), f"rank {rank} wrote no shard"
        for step, loss in losses(ref, rank).items():
            assert losses(run, rank)[step] == loss, f"rank {rank} step {step}"
    report = json.loads((run / "report.rank0.json").read_text())
    assert report["backend"] == "nccl"
    if io_mode == "async":
        assert report["pinned_staging"] is True  # host buffers of the stager are page-locked
    print(json.dumps(report))
