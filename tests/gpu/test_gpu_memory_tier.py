"""GPU checks of the memory tier's CUDA path (issue 38), one prepared script:

    python -m pytest tests/gpu/test_gpu_memory_tier.py -rs -s -n 0    # prints a table

* the slot's pages are page-locked for CUDA and the device-to-host copy runs on a side stream:
  a save point returns once the copies are queued;
* ordering: the step's own last changes, still queued behind GPU work at the save point, are
  in the slot (the copy waits for the training stream); a buffer changed by the next step's
  first kernel (as BatchNorm's statistics are) and the parameters / optimizer states changed
  by the next optimizer step are in the slot as they were at the save point; each change is
  queued right before or after the save, so a copy not ordered where it must be reads other
  values and the test fails;
* a real training job (BatchNorm, an EMA buffer updated in the module's own hook, bf16-mixed,
  AdamW) killed with SIGKILL resumes from the memory tier bit for bit.

Measured and printed (never asserted): the time a save point holds training, the wait before
the next optimizer step, against a synchronous copy of the same state into a page-locked host
buffer and into pageable memory (what the tier did before on CUDA).

Skipped, with the reason printed, where no GPU exists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness.losses import last_losses

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: the memory tier's page-locked slots and its copy stream run on GPUs only "
                f"(torch {torch.__version__}, cuda available: False)", allow_module_level=True)

from areal_lightning.commit.memory_tier import MemoryTier, verify_slot  # noqa: E402
from areal_lightning.config import MemoryConfig  # noqa: E402
from areal_lightning.write.dcp import DCPEngine  # noqa: E402

SCRIPT = Path(__file__).with_name("train_gpu.py")
DEVICES = min(torch.cuda.device_count(), 2)
ROWS: list[str] = []


def row(check: str, result: str) -> None:
    ROWS.append(f"| {check} | {result} |")
    print("\n".join(["", "| memory tier on CUDA | result |", "|---|---|", *ROWS]))


@pytest.fixture
def shm(tmp_path):
    """A folder on tmpfs (where the tier lives by default), else ``tmp_path``."""
    base = Path("/dev/shm")
    if not base.is_dir() or shutil.disk_usage(base).free < (4 << 30):
        yield tmp_path
        return
    folder = base / f"areal-gpu-test-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _forward_like() -> None:
    """About as much GPU work as a small step's forward and backward, on the current stream."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(40):
        a = torch.tanh(a @ a * 1e-3)


@pytest.mark.parametrize("where", ["tmpfs", "disk"])
def test_the_device_copy_is_queued_on_a_side_stream_into_locked_slot_pages_and_waited_for_where_it_must(
        shm, tmp_path, caplog, where) -> None:
    scale = 1 if where == "tmpfs" else 8  # on disk: a smaller state (the copies are synchronous there)
    torch.manual_seed(0)
    buffer = torch.randn((64 << 20) // scale, device="cuda")  # 256 MB: a buffer the next forward changes
    weight = torch.randn((128 << 20) // scale, device="cuda")  # 512 MB: a parameter
    moment = torch.randn((128 << 20) // scale, device="cuda")  # 512 MB: an optimizer state
    late = {weight.untyped_storage().data_ptr(), moment.untyped_storage().data_ptr()}
    checkpoint = {"state_dict": {"bn.running_mean": buffer, "w": weight}, "optimizer_states": [{"exp_avg": moment}],
                  "epoch": 0}
    nbytes = sum(t.numel() * t.element_size() for t in (buffer, weight, moment))
    folder = (shm if where == "tmpfs" else tmp_path) / "tier"
    tier = MemoryTier(MemoryConfig(enabled=True, slots=2).validate(), folder, 0)
    engine = DCPEngine(collective=False)
    blocked, waited = [], []
    try:
        for step in range(1, 5):
            # this step's last changes, still queued behind GPU work when the save point comes: the
            # copy must wait for them (the copy stream waits for the training stream)
            _forward_like()
            for tensor in (buffer, weight, moment):
                tensor.add_(0.5)
            expected = {name: t.clone() for name, t in (("buffer", buffer), ("weight", weight), ("moment", moment))}
            start = time.perf_counter()
            tier.write(checkpoint, global_step=step, world_size=1, lineage=None, info={"step": step},
                       late=lambda t: t.untyped_storage().data_ptr() in late)
            blocked.append(time.perf_counter() - start)
            buffer.add_(1.0)  # the next step's first kernel changes a buffer (BatchNorm's statistics)
            _forward_like()
            wait = tier.wait_sealed()  # RecoverCallback's on_before_optimizer_step
            assert wait is not None, "a device copy must be pending until the optimizer step"
            waited.append(wait)
            weight.add_(1.0)  # the optimizer step
            moment.mul_(0.5)
            seal = tier.held()[0]
            assert seal.global_step == step
            assert verify_slot(seal)[0] is None
            saved = engine.load(seal.path)
            assert torch.equal(saved["state_dict"]["bn.running_mean"], expected["buffer"].cpu()), step
            assert torch.equal(saved["state_dict"]["w"], expected["weight"].cpu()), step
            assert torch.equal(saved["optimizer_states"][0]["exp_avg"], expected["moment"].cpu()), step
        if where == "tmpfs":
            assert tier.pinned is True, "the slot's pages were not page-locked for CUDA (cudaHostRegister refused)"
        else:  # a kernel that refuses to lock a disk file's mapping: synchronous copies, said once
            assert isinstance(tier.pinned, bool)
            warned = [r for r in caplog.records if "could not page-lock" in r.getMessage()]
            assert len(warned) == (0 if tier.pinned else 1), warned
            row("slot on a disk folder", f"page-locked: {tier.pinned}; {'no warning' if tier.pinned else 'warned once'};"
                f" save point held {min(blocked[1:]) * 1e3:.1f} ms for {nbytes / 1e9:.2f} GB, slot exact")
            return
    finally:
        engine.close()
        tier.close()
    # peers: the same bytes copied synchronously into a page-locked buffer, and into pageable memory
    sources = [buffer, weight, moment]
    pinned = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True) for t in sources]
    pageable = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8) for t in sources]
    peers = {}
    for name, targets in (("pinned", pinned), ("pageable", pageable)):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for target, source in zip(targets, sources):
                target.copy_(source.view(-1).view(torch.uint8), non_blocking=name == "pinned")
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peers[name] = min(times)
    steady_block, steady_wait = min(blocked[1:]), min(waited[1:])
    row(f"state copied per save ({nbytes / 1e9:.2f} GB, 3 tensors)", f"slot page-locked: {tier.pinned}")
    row("save point holds training (first save: page-locks the slot)", f"{blocked[0] * 1e3:.1f} ms")
    row("save point holds training (later saves, min)", f"{steady_block * 1e3:.2f} ms = "
        f"{steady_block / peers['pinned']:.3f}x a synchronous copy into pinned memory")
    row("wait before the optimizer step (after ~a forward's GPU work; min)", f"{steady_wait * 1e3:.1f} ms")
    row("peer: synchronous D2H into pinned memory / into pageable memory",
        f"{peers['pinned'] * 1e3:.1f} ms ({nbytes / peers['pinned'] / 1e9:.1f} GB/s) / {peers['pageable'] * 1e3:.1f} ms")
    row("held per step, save + wait, vs the pageable copy the tier made before",
        f"{(steady_block + steady_wait) / peers['pageable']:.3f}x")


def _train(root: Path, tier: Path, *args: str) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--devices", str(DEVICES),
                           "--strategy", "ddp", "--memory", "--memory-root", str(tier), "--batchnorm",
                           "--precision", "bf16-mixed", *args],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    print(f"memory tier {' '.join(args) or 'uninterrupted'}: rc={proc.returncode} in {time.perf_counter() - start:.1f}s")
    return proc


def test_a_sigkilled_gpu_job_resumes_from_the_memory_tier_bit_for_bit(tmp_path, shm) -> None:
    ref = tmp_path / "ref"
    done = _train(ref, shm / "ref")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    killed = _train(run, shm / "run", "--kill-at-step", "13")  # before step 13's save point: step 12 is the newest slot
    assert killed.returncode == -9, killed.stderr[-3000:]
    report = json.loads((ref / "report.rank0.json").read_text())
    resumed = _train(run, shm / "run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the log counts steps from 0: "after global step 11" is after 12 optimizer steps
    assert "resuming from the memory tier" in resumed.stderr and "after global step 11 " in resumed.stderr, \
        resumed.stderr[-3000:]
    for rank in range(DEVICES):
        want, got = last_losses(ref / f"losses.rank{rank}.jsonl"), last_losses(run / f"losses.rank{rank}.jsonl")
        assert want and got == want, f"rank {rank}: losses differ from the uninterrupted run's"
    memory = report["memory"]
    assert memory["pinned"] is True, (report, done.stderr[-3000:])  # the tier on tmpfs: its slots page-locked
    copies = sorted(memory["copy_s"])
    row(f"SIGKILL at step 13, {DEVICES} GPU(s) DDP, BatchNorm + EMA + bf16-mixed",
        "resumed from the memory tier after step 12, losses bit for bit")
    row("training job: save point held (median)", f"{copies[len(copies) // 2] * 1e3:.2f} ms")
