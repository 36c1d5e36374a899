"""Exact resume means every hook of the step: the recover checkpoint of step N holds the state
after everything Lightning runs for step N and before step N+1 starts.

The job of ``tests/scripts/train_matrix.py`` with ``hooks=True`` changes state in every hook of a
step: the LightningModule's ``on_train_batch_end`` (an EMA of the weights, an EMA of the loss
buffer, a logged value, a counter), its ``on_train_epoch_end`` and ``on_validation_end``
(counters), a callback placed before ``RecoverCallback`` and one placed after it (counters, and a
draw from the global torch RNG at each batch end) and a monitoring callback (an ``EarlyStopping``
whose ``on_train_epoch_end`` Lightning runs after the module's). Each case interrupts the run just
after a recover checkpoint of one kind (step trigger with a validation due at that step, epoch
trigger, seconds trigger, SIGTERM preemption mid-epoch and at an epoch's last batch), sync and
async, starts it again, and compares with the uninterrupted run bit for bit: losses, every logged
value, every parameter and buffer at the end, the module's and callbacks' states. ``bn=True`` is
Lightning's GAN example pattern: BatchNorm, and a forward in train mode at the module's epoch end.
"""

from __future__ import annotations

import pytest

from tests.scripts import train_matrix as tm
from tests.test_matrix import T, Case, compare, reference, run_kill_case

Job = tm.Job
HOOKS = dict(hooks=True, epochs=3, trainer=T(val_check_interval=5))

# (job, how the first run stops, step at which it stops, step of the checkpoint resumed from)
KINDS: dict[str, tuple[dict, str, int, int]] = {
    "step-trigger": (dict(freq_steps=4), "raise", 7, 4),
    # a validation is due after step 5 (val_check_interval=5): it belongs to the checkpoint
    "step-trigger-validation-due": (dict(freq_steps=5), "raise", 7, 5),
    "epoch-trigger": (dict(freq_steps=None, freq_epochs=1), "raise", 13, 10),
    "seconds-trigger": (dict(freq_steps=None, freq_secs=3), "raise", 8, 6),
    "preempt-mid-epoch": (dict(freq_steps=4), "preempt", 6, 6),
    "preempt-last-batch": (dict(freq_steps=4), "preempt", 10, 10),
}

CASES = {f"{kind}-{io}": (Case(Job(**HOOKS, **job, io_mode=io), at, ckpt), mode)
         for kind, (job, mode, at, ckpt) in KINDS.items() for io in ("sync", "async")}
CASES["gan-batchnorm-epoch-end"] = (Case(Job(bn=True, epochs=3, freq_steps=None, freq_epochs=1), 13, 10), "raise")


@pytest.mark.parametrize("name", list(CASES))
def test_every_hook_of_the_step_is_in_the_checkpoint(name, tmp_path, tmp_path_factory) -> None:
    case, mode = CASES[name]
    ref, ref_result = reference(case.job, tmp_path_factory)
    interrupted = tm.Trace()
    with pytest.raises(tm.Crash if mode == "raise" else SystemExit):
        tm.fit(case.job, tmp_path, interrupted, crash_at=case.crash_at, crash_mode=mode)
    resumed = tm.Trace()
    resumed_result = tm.fit(case.job, tmp_path, resumed)
    problems = compare(case, ref, ref_result, interrupted.items, resumed.items, resumed_result)
    assert not problems, "\n".join(problems)


# Real processes, SIGKILLed after a checkpoint at a step's end and after one at an epoch's end.
# 2 ranks: 5 batches per epoch and rank (hooks job: validation every 5 batches = each epoch's end).
# Each strategy once and each save point once: where the save happens does not depend on the
# strategy (the in-process cases above cover every kind), what a strategy saves does not depend
# on the trigger.
KILL_CASES = {
    f"{strategy}-2-ranks-{kind}": Case(Job(**HOOKS, devices=2, strategy=strategy, **job), at, ckpt)
    for strategy, (kind, job, at, ckpt) in (("ddp", ("step-trigger", dict(freq_steps=3), 4, 3)),
                                            ("fsdp1", ("epoch-trigger", dict(freq_steps=None, freq_epochs=1), 7, 5)))
}
KILL_CASES["single-process-async-step-trigger"] = Case(Job(**HOOKS, freq_steps=4, io_mode="async"), 7, 4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(KILL_CASES))
def test_every_hook_of_the_step_is_in_the_checkpoint_sigkill(name, tmp_path, tmp_path_factory) -> None:
    run_kill_case(KILL_CASES[name], tmp_path, tmp_path_factory)
