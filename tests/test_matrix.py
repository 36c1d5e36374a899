"""Resume matrix: for each training configuration, a run interrupted at some step and started
again with the same code and the same RecoverCallback trial trains exactly like a run that
never stopped, bit for bit.

Each case runs three fits of the job of ``tests/scripts/train_matrix.py`` (dropout, AdamW + a
per-step LR scheduler, shuffled data; ``pl.seed_everything(0)`` before each): the
uninterrupted reference (shared by the cases that train identically), a run stopped at the
end of the batch where ``trainer.global_step == crash_at`` (an exception from a callback placed
before RecoverCallback, or a real SIGKILL of the process group for the subprocess cases), and
the resumed run (new Trainer, new module, same RecoverCallback arguments). Compared:

* the per-batch training losses ``(epoch, batch_idx, global_step, loss.hex())``: there is a k
  with ``reference == interrupted[:k] + resumed`` (resumed non-empty), and the resumed run's
  first batch is the one right after the recover checkpoint's step;
* every record of a real in-memory ``Logger`` (``train_loss`` per step, ``train_loss_avg``
  aggregated per epoch, ``val_loss`` per validation): the same prefix/suffix check, and the
  resumed run's first record is the first one the reference logged after the moment the
  checkpoint was taken (so a validation that was due after the checkpointed batch must be run
  by the resumed run). Only the package's own wall-clock telemetry (``checkpoint/*``: save
  durations, checkpoint age) is left out of the comparison;
* with ModelCheckpoint + EarlyStopping: best score, kept checkpoints, files, wait count.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness.refcache import environment_key, shared
from tests.harness.stacks import native_stacks
from tests.scripts import train_matrix as tm

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(tm.__file__)
Job = tm.Job


def T(**kwargs: Any) -> tuple:
    """Trainer kwargs of a Job (hashable)."""
    return tuple(sorted(kwargs.items()))


@dataclass(frozen=True)
class Case:
    job: Job
    crash_at: int | None  # None: the first run finishes (see first_epochs)
    ckpt: int  # global step of the recover checkpoint the resumed run must continue from
    first_epochs: int | None = None  # max_epochs of the interrupted run (default: the job's)


# 40 samples, batch 4: 10 batches per epoch; 2 epochs unless told; validation of 4 batches at
# the end of each epoch unless told; recover checkpoint every 4 steps unless told.
CASES: dict[str, Case] = {
    # validation due at the very step of the recover checkpoint (mid-epoch), crash 2 steps later
    "val-check-interval-int-at-checkpoint": Case(Job(trainer=T(val_check_interval=5), freq_steps=5), 7, 5),
    "val-check-interval-0.5-at-checkpoint": Case(Job(trainer=T(val_check_interval=0.5), freq_steps=5), 7, 5),
    # epoch-end validation, checkpoint at the end of epoch 1, crash in epoch 2
    "epoch-end-val-freq-epochs-1": Case(Job(freq_steps=None, freq_epochs=1), 13, 10),
    "check-val-every-2-epochs": Case(Job(trainer=T(check_val_every_n_epoch=2)), 14, 12),
    "limit-val-batches-2": Case(Job(trainer=T(limit_val_batches=2, val_check_interval=3)), 9, 8),
    "sanity-check-on": Case(Job(trainer=T(num_sanity_val_steps=2)), 6, 4),
    "sanity-check-off": Case(Job(trainer=T(num_sanity_val_steps=0)), 6, 4),
    "accumulate-grad-batches-2": Case(Job(trainer=T(accumulate_grad_batches=2), freq_steps=3), 7, 6),
    # two optimizer steps per batch: global_step 2, 4, ...; checkpoint after batch 3 of epoch 1
    "manual-optimization-actor-critic": Case(Job(manual=True), 10, 8),
    "precision-bf16-mixed": Case(Job(trainer=T(precision="bf16-mixed")), 6, 4),
    # async recover saves written by the checkpoint process (and by a thread, the default)
    **{f"async-{executor}-executor": Case(Job(io_mode="async", async_executor=executor), 7, 4)
       for executor in ("thread", "process")},
    "gradient-clip-val-0.5": Case(Job(trainer=T(gradient_clip_val=0.5)), 6, 4),
    "max-steps-13": Case(Job(epochs=3, trainer=T(max_steps=13)), 10, 8),
    "limit-train-batches-6": Case(Job(epochs=3, trainer=T(limit_train_batches=6)), 9, 8),
    "two-train-loaders-dict": Case(Job(loaders="dict2"), 7, 4),
    # validation every 4 batches (ModelCheckpoint / EarlyStopping act there), checkpoint every 6
    # steps: resumed from step 6, no ModelCheckpoint save between the checkpoint and the crash
    "model-checkpoint-early-stopping": Case(Job(mc_es=True, epochs=3, trainer=T(val_check_interval=4), freq_steps=6),
                                            7, 6),
    "iterable-dataset-no-len": Case(Job(data="iterable"), 6, 4),
    "iterable-dataset-no-len-own-state-dict": Case(Job(data="iterable_stateful"), 6, 4),
    "iterable-dataset-no-len-own-state-dict-stateful-dataloader": Case(Job(data="iterable_stateful_sdl"), 6, 4),
    "workers-0": Case(Job(workers=0), 7, 4),
    "workers-0-augmentation": Case(Job(workers=0, data="augment"), 7, 4),
    "workers-2": Case(Job(workers=2), 7, 4),
    "workers-2-augmentation-replay": Case(Job(workers=2, data="augment", fast_forward="replay"), 7, 4),
    # augmentation drawn from each worker's own RNG streams (torch, random and NumPy in each sample),
    # default fast-forward: checkpoint after an odd number of batches of epoch 1 (batch 5 goes to
    # worker 1: the resumed workers carry each other's streams), after the first batch of epoch 2,
    # and (persistent workers, whose streams continue across epochs) at the end of epoch 1; 3 epochs,
    # so an epoch after the resumed one is compared too
    **{f"workers-{w}{'-persistent' if persistent else ''}-augmentation-torch-random-numpy-{where}":
       Case(Job(workers=w, persistent=persistent, data="augment", augment_rng="all", epochs=3, **job), crash, ckpt)
       for w, persistent in ((0, False), (2, False), (2, True))
       for where, job, crash, ckpt in (("mid-epoch", dict(freq_steps=5), 7, 5),
                                       ("first-batch-of-epoch", dict(freq_steps=11), 13, 11))
       if w or where == "mid-epoch"},
    # torchdata's StatefulDataLoader restores its position and worker order, not its workers' streams
    **{f"stateful-dataloader-workers-2-augmentation-torch-random-numpy-{where}":
       Case(Job(workers=2, sdl=True, data="augment", augment_rng="all", epochs=3, freq_steps=freq), crash, ckpt)
       for where, freq, crash, ckpt in (("mid-epoch", 5, 7, 5), ("first-batch-of-epoch", 11, 13, 11))},
    # a worker_init_fn seeding NumPy itself, prefetch_factor=4, two loaders with workers (one cycled)
    "workers-2-augmentation-numpy-own-worker-init-fn": Case(
        Job(workers=2, data="augment", augment_rng="numpy", worker_init=True, freq_steps=5), 7, 5),
    "workers-3-prefetch-4-augmentation-torch": Case(Job(workers=3, prefetch=4, data="augment", freq_steps=5), 7, 5),
    "workers-2-two-loaders-augmentation-torch": Case(Job(workers=2, loaders="dict2", data="augment", freq_steps=5),
                                                     7, 5),
    "workers-2-persistent-augmentation-torch-random-numpy-epoch-end": Case(
        Job(workers=2, persistent=True, data="augment", augment_rng="all", epochs=3, freq_steps=None, freq_epochs=1),
        13, 10),
    "datamodule": Case(Job(loaders="datamodule"), 7, 4),
    # the memory tier (a slot every step; the shared tier every 3 or 4 steps, copied from the
    # slots): the crash at step c resumes from the slot of the step before (newer than the shared
    # tier's), in the kind of script users write
    "memory-tier-datamodule-validation-accumulate-2-bf16-mixed": Case(Job(
        loaders="datamodule", memory=True, freq_steps=4,
        trainer=T(accumulate_grad_batches=2, precision="bf16-mixed", val_check_interval=4)), 7, 6),
    "memory-tier-workers-2-persistent-augmentation-torch-random-numpy": Case(Job(
        workers=2, persistent=True, data="augment", augment_rng="all", epochs=3, memory=True, freq_steps=5), 13, 12),
    "memory-tier-manual-optimization-actor-critic": Case(Job(manual=True, memory=True, freq_steps=6), 10, 8),
    "memory-tier-every-hook-batchnorm-model-checkpoint-early-stopping": Case(Job(
        hooks=True, bn=True, mc_es=True, memory=True, trainer=T(val_check_interval=4)), 7, 6),
    # the first run trains 2 epochs and finishes (final checkpoint after step 20); the resumed run
    # has max_epochs=3 and must train epoch 3 like a 3-epoch run
    "resume-with-larger-max-epochs": Case(Job(epochs=3, freq_steps=3), None, 20, first_epochs=2),
}

# SIGKILL of a real process (tests/scripts/train_matrix.py), then the same command again.
KILL_CASES: dict[str, Case] = {
    # validation every 3 batches: the one after step 9 ran between the checkpoint and the kill
    "sigkill-single-process-validation": Case(Job(trainer=T(val_check_interval=3)), 10, 8),
    # async saves written by the checkpoint process, which dies with the training process
    "sigkill-single-process-async-process-executor": Case(
        Job(trainer=T(val_check_interval=3), io_mode="async", async_executor="process"), 10, 8),
    # 2 ranks: 5 batches per epoch and rank, 3 epochs, epoch-end validation; checkpoint after
    # step 6 (the first batch of epoch 2), killed at step 7. Each rank with 2 persistent workers
    # drawing augmentation noise, so the resumed workers carry each other's streams, into epoch 3
    # (a DDP run without workers is this case less the workers: it is not run on its own)
    "sigkill-ddp-2-ranks-workers-augmentation": Case(
        Job(devices=2, epochs=3, freq_steps=3, workers=2, persistent=True, data="augment"), 7, 6),
    # the same with the memory tier: killed at step 8, resumed from the slots of step 7
    "sigkill-ddp-2-ranks-memory-tier-workers-augmentation": Case(
        Job(devices=2, epochs=3, freq_steps=3, workers=2, persistent=True, data="augment", memory=True), 8, 7),
}


# -- what is compared ---------------------------------------------------------------------------

LOOP_EVENTS = ("batch_start", "val_start", "val_end", "epoch_end", "train_end")


def losses(trace: list[list]) -> list[list]:
    return [e[1:] for e in trace if e[0] == "loss"]


def metrics(trace: list[list]) -> list[list]:
    """Logger records without the package's wall-clock telemetry (``checkpoint/*``)."""
    out = []
    for e in trace:
        if e[0] != "metric":
            continue
        items = [kv for kv in e[2] if not kv[0].startswith("checkpoint/")]
        if {k for k, _ in items} - {"epoch"}:
            out.append([e[1], items])
    return out


def first_diff(want: list, got: list) -> int | None:
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


def _at(seq: list, i: int) -> Any:
    return seq[i] if i < len(seq) else "<nothing>"


def resume_point(ref: list[list], interrupted: list[list], ckpt: int) -> tuple[int, int] | str:
    """(losses, logger records) the reference had produced when the checkpoint the resumed run
    continues from was taken: at the first loop event after the one that preceded the
    interrupted run's save (a save right after a batch end is followed by the validation due
    there, which the resumed run must then run; a save after that validation is not)."""
    saves = [i for i, e in enumerate(interrupted) if e[:2] == ["ev", "save"]]
    if not saves:
        return "the interrupted run saved no recover checkpoint"
    i = saves[-1]
    if interrupted[i][4] != ckpt:
        return f"the interrupted run's last save was at global step {interrupted[i][4]}, not {ckpt}"
    anchor = next(e for e in reversed(interrupted[:i]) if e[0] == "ev" and e[1] not in ("save", "train_end"))
    if anchor not in ref:
        return f"the reference has no loop event {anchor}"
    j = ref.index(anchor)
    q = next((n for n in range(j + 1, len(ref)) if ref[n][0] == "ev" and ref[n][1] in LOOP_EVENTS), len(ref))
    return len(losses(ref[:q])), len(metrics(ref[:q]))


def check_stream(what: str, ref: list, interrupted: list, resumed: list, k_expected: int | None,
                 first_what: str) -> list[str]:
    """The prefix/suffix checks of one stream; returns the problems found."""
    problems = []
    d = first_diff(ref, interrupted[:len(ref)])
    if d is not None and d < len(interrupted):
        problems.append(f"{what}: the interrupted run already differs from the reference at item {d} "
                        f"(reference {_at(ref, d)}, interrupted {_at(interrupted, d)})")
    k = len(ref) - len(resumed)
    if not resumed:
        problems.append(f"{what}: the resumed run produced none")
    elif not (0 <= k <= len(interrupted) and interrupted[:k] == ref[:k] and resumed == ref[k:]):
        problems.append(f"{what}: no k with reference == interrupted[:k] + resumed (reference {len(ref)}, "
                        f"interrupted {len(interrupted)}, resumed {len(resumed)} items)")
    if k_expected is not None:
        want = ref[k_expected:]
        d = first_diff(want, resumed)
        if d is not None:
            problems.append(f"{what}: resumed item {d} (reference item {k_expected + d}) is {_at(resumed, d)}, "
                            f"the reference has {_at(want, d)}" + (f" [{first_what}]" if d == 0 else ""))
    return problems


def without(stream: list[list], key: str) -> list[list]:
    out = []
    for step, items in stream:
        items = [kv for kv in items if kv[0] != key]
        if {k for k, _ in items} - {"epoch"}:
            out.append([step, items])
    return out


def compare(case: Case, ref: list[list], ref_result: dict, interrupted: list[list], resumed: list[list],
            resumed_result: dict, where: str = "") -> list[str]:
    problems: list[str] = []
    resumed_from = resumed_result["resumed_from"]
    if resumed_from is None:
        return [f"{where}the second run did not resume"]
    ckpt = resumed_from["global_step"] + 1
    if ckpt != case.ckpt:
        problems.append(f"{where}resumed from the checkpoint of step {ckpt}, the case expects step {case.ckpt}")
    point = resume_point(ref, interrupted, ckpt)
    if isinstance(point, str):
        problems.append(where + point)
        point = (None, None)
    ref_l = losses(ref)
    k_loss = next((i for i, r in enumerate(ref_l) if r[2] >= ckpt), len(ref_l))  # first batch after the step
    if point[0] is not None and point[0] != k_loss:
        problems.append(f"{where}losses: {point[0]} batches trained when the checkpoint was taken, but the first "
                        f"batch with global_step >= {ckpt} is batch {k_loss}")
    problems += [where + p for p in check_stream(
        "losses", ref_l, losses(interrupted), losses(resumed), k_loss,
        f"the first resumed batch must be the one right after the checkpoint of step {ckpt}")]
    ref_m, int_m, res_m = metrics(ref), metrics(interrupted), metrics(resumed)
    metric_problems = check_stream("logged metrics", ref_m, int_m, res_m, point[1],
                                   "the first record the reference logged after the checkpoint was taken")
    if metric_problems:
        # Diagnosis only (the comparison above stands): does anything but the epoch aggregate differ?
        rest = check_stream("logged metrics without train_loss_avg", without(ref_m, "train_loss_avg"),
                            without(int_m, "train_loss_avg"), without(res_m, "train_loss_avg"), None, "")
        metric_problems += rest or ["logged metrics without train_loss_avg: equal"]
    problems += [where + p for p in metric_problems]
    for key in ("global_step", "current_epoch", "model_checkpoint", "early_stopping", "hook_state"):
        if ref_result.get(key) != resumed_result.get(key):
            problems.append(f"{where}{key}: resumed run ends with {resumed_result.get(key)}, "
                            f"the reference with {ref_result.get(key)}")
    ref_w, res_w = ref_result.get("weights") or {}, resumed_result.get("weights") or {}
    differ = sorted(k for k in ref_w.keys() | res_w.keys() if ref_w.get(k) != res_w.get(k))
    if differ:
        problems.append(f"{where}final weights and buffers: {len(differ)} of {len(ref_w)} tensors differ: {differ}")
    return problems


# -- in-process cases ---------------------------------------------------------------------------

_REFERENCES: dict[Job, tuple[list[list], dict]] = {}


def reference(job: Job, tmp_path_factory) -> tuple[list[list], dict]:
    """The uninterrupted run (once per training configuration and suite run, shared by the
    workers: tests/harness/refcache.py)."""
    key = job.training_key()
    if key not in _REFERENCES:
        def produce(root: Path) -> tuple[list[list], dict]:
            trace = tm.Trace()
            out = tm.fit(job, root, trace)
            return trace.items, out

        _REFERENCES[key] = shared(tmp_path_factory, {"matrix-in-process": key.to_json(), "env": environment_key()},
                                  produce)[1]
    return _REFERENCES[key]


@pytest.mark.parametrize("name", list(CASES))
def test_interrupted_run_resumes_bit_for_bit(name, tmp_path, tmp_path_factory) -> None:
    case = CASES[name]
    ref, ref_result = reference(case.job, tmp_path_factory)
    interrupted = tm.Trace()
    if case.crash_at is None:
        tm.fit(case.job, tmp_path, interrupted, epochs=case.first_epochs)
    else:
        with pytest.raises(tm.Crash):
            tm.fit(case.job, tmp_path, interrupted, crash_at=case.crash_at, epochs=case.first_epochs)
    resumed = tm.Trace()
    resumed_result = tm.fit(case.job, tmp_path, resumed)
    problems = compare(case, ref, ref_result, interrupted.items, resumed.items, resumed_result)
    assert not problems, "\n".join(problems)


# -- SIGKILL of real processes ------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _command(job: Job, root: Path, trace: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--job", job.to_json(), "--root", str(root), "--trace", str(trace), *extra]


def script_run(job: Job, root: Path, trace: Path) -> list[dict]:
    with open(root / f"{trace.name}.log", "w+") as log:
        proc = subprocess.Popen(_command(job, root, trace), stdout=subprocess.DEVNULL, stderr=log, cwd=REPO,
                                env=_env(), start_new_session=True)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            stacks = native_stacks(proc.pid)  # what each process of the hung job is doing
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"the job did not end in 300 s; its processes:\n{stacks}") from None
        log.seek(0)
        assert proc.returncode == 0, log.read()[-4000:]
    return [json.loads(Path(f"{trace}.result.rank{r}.json").read_text()) for r in range(job.devices)]


def script_run_killed(job: Job, root: Path, trace: Path, step: int) -> None:
    """Start the job, wait until every rank is paused at the end of ``step``, SIGKILL them all."""
    with open(root / "killed.log", "w") as log:
        proc = subprocess.Popen(_command(job, root, trace, "--crash-at", str(step), "--crash-mode", "pause"),
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=_env(), start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not all(Path(f"{trace}.paused.rank{r}").exists() for r in range(job.devices)):
                assert proc.poll() is None, (root / "killed.log").read_text()[-4000:]
                assert time.monotonic() < deadline, f"the job never reached the kill step:\n{native_stacks(proc.pid)}"
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # every rank (Lightning's DDP launcher children too)
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


_SCRIPT_REFERENCES: dict[Job, list[tuple[list[list], dict]]] = {}  # per rank: (trace, result)


@pytest.mark.slow
@pytest.mark.parametrize("name", [  # one case in fresh interpreters (the others: forks of the test fork server)
    pytest.param(n, marks=pytest.mark.fresh_interpreter) if n == "sigkill-ddp-2-ranks-workers-augmentation" else n
    for n in KILL_CASES])
def test_sigkilled_process_resumes_bit_for_bit(name, tmp_path, tmp_path_factory) -> None:
    run_kill_case(KILL_CASES[name], tmp_path, tmp_path_factory)


def run_kill_case(case: Case, tmp_path: Path, tmp_path_factory) -> None:
    """Reference (per rank), the run SIGKILLed at ``case.crash_at``, the same command again: compared."""
    if case.job.devices == 1:  # the in-process reference (same code, same single process: bit for bit)
        refs = [reference(case.job, tmp_path_factory)]
    else:
        key = case.job.training_key()
        if key not in _SCRIPT_REFERENCES:
            def produce(root: Path) -> list[tuple[list[list], dict]]:
                results = script_run(case.job, root, root / "trace")
                return [(tm.Trace.read(root / "trace", r), results[r]) for r in range(case.job.devices)]

            _SCRIPT_REFERENCES[key] = shared(tmp_path_factory, {"matrix-script": key.to_json(), "env": environment_key()},
                                             produce)[1]
        refs = _SCRIPT_REFERENCES[key]
    script_run_killed(case.job, tmp_path, tmp_path / "killed", case.crash_at)
    resumed_results = script_run(case.job, tmp_path, tmp_path / "resumed")
    problems: list[str] = []
    for r, (ref, ref_result) in enumerate(refs):
        problems += compare(case, ref, ref_result, tm.Trace.read(tmp_path / "killed", r),
                            tm.Trace.read(tmp_path / "resumed", r), resumed_results[r],
                            where=f"rank {r}: " if case.job.devices > 1 else "")
    assert not problems, "\n".join(problems)
