"""``areal-lightning certify``: kill a training command at every fault point, rerun it, prove the resume.

Usage::

    areal-lightning certify [--points [MODE=]all|P1,P2[@N] ...] [--modes sync,async] [--json FILE]
        [--timeout S] [--jobs J] [--nth N] [--chain] [--workdir DIR] [--keep] [--strict]
        -- <training command with {root} and {mode}>

For every mode, the training command first runs once uninterrupted (the *reference*, with
every fault point traced, so certify learns which points the command reaches and how
often). Then, for every fault point x mode, it runs the command in a fresh folder with
``AREAL_LIGHTNING_FAULT=<point>:kill@N`` (SIGKILL at the N-th time a process reaches the
point; by default the middle one of the reference's hits), kills the whole process group
as soon as that happens (every rank of a multi-process run: a rank killed alone leaves the
others hanging in a collective), runs the same command again without the fault, and checks:

a. **resumed**: the rerun resumed from the last committed recover checkpoint, as the
   kill left it on disk (``recover_info/step_info.json``, or the new checkpoint of a swap
   that had begun, which the next start rolls forward), read from the
   ``RecoverCallback: resumed from ... after global step N`` log line of every rank (no
   such line when nothing had been committed: a fresh start);
b. **exact**: every per-step loss recorded by the killed run and by the rerun equals the
   reference's, bit for bit, and the two together trained exactly the reference's steps;
   the final ``recover_info/step_info.json`` equals the reference's;
c. **leftovers**: no ``.tmp-*`` / ``.trash-*`` / ``.old-*`` file or folder is left in the
   trial after the rerun (its saves clean up what the kill left);
d. **exports**: every HF export folder with a final ``epoch…globalstep…`` name loads
   (``config.json`` is JSON, every ``*.safetensors`` loads with
   ``safetensors.torch.load_file``), the set of exports is the reference's and each
   holds the reference's tensors bit for bit.

A point the reference never reaches (or a run that exits 0 without being killed) is
reported as *not reached*, never as a pass. The exit code is 1 when a reference run or any
case fails (with ``--strict`` also when a point is not reached), 2 on usage errors, else 0.

What the training command must do (the protocol):

- use ``RecoverCallback`` with ``fileroot`` = the ``{root}`` placeholder (a fresh, empty
  folder per case) — certify finds the trial(s) below it;
- take the mode from the ``{mode}`` placeholder (e.g. ``io_mode={mode}`` or
  ``--io-mode {mode}``; the value is one of ``--modes``, passed through as is);
- record one loss per optimizer step: add :class:`LossRecorder` to the Trainer's callbacks,
  or call :func:`record_loss` yourself, or append JSON lines
  ``{"step": int, "loss": float.hex(), "rank": int}`` (``rank`` optional, default 0;
  ``loss`` any JSON value compared for equality, ``float.hex()`` makes that bitwise) to the
  file named by ``{losses}``. A step recorded again after a resume must carry the same loss.

``--points`` may be repeated with a mode prefix to choose points per mode, e.g.
``--points sync=all --points async=engine.after_shard_file,hf.prune``; ``P@N`` kills at the
N-th hit of P instead of the middle one.

Placeholders ``{root}``, ``{mode}`` and ``{losses}`` are replaced in every argument of the
command (exact text, no other brace is touched); the same values are also in the
environment as ``AREAL_LIGHTNING_CERTIFY_ROOT``, ``AREAL_LIGHTNING_CERTIFY_MODE`` and
``AREAL_LIGHTNING_CERTIFY_LOSSES``. Example::

    areal-lightning certify --modes sync,async --jobs 2 --json cert.json -- \\
        python train.py --fileroot {root} --io-mode {mode}

Runs share nothing but the reference: each case gets ``{workdir}/{mode}/{point}/root``.
Folders of passing cases are deleted unless ``--keep``; failing ones are kept and named.

``--chain`` (about half the runs): the points of a mode are split into ``--jobs``
contiguous groups, each run in the order given as one *sequence* sharing one ``{root}``:
run 1 is killed at the first point (its middle hit), run 2 resumes from that kill (checked
as above) and is itself killed at the next point (its first hit after the restart), and
so on; a last run without a fault finishes the training, after which (b)'s coverage of all
steps, (c) and (d) are checked. A restart may reach points a fresh run never does (the
roll-forward of an interrupted swap, the re-export of a step), so in a sequence a point
the reference never reached is still tried; a point not reached after a restart is tried
again at the head of a new sequence. A run killed before it resumed (e.g. while rolling a
swap forward) defers the resume check to the next run. When the checks after the last run
fail, every case of the sequence is run again alone to find the kill that caused it.
"""

from __future__ import annotations

from typing import Any

from areal_lightning.tools import losses as loss_log
from areal_lightning.tools.certify.command import certify
from areal_lightning.tools.certify.disk import check_exports, expected_resume, find_trials, leftovers
from areal_lightning.tools.certify.process import RunResult, run_group
from areal_lightning.tools.certify.protocol import ENV_MODE, ENV_ROOT, END_CHECK, PLACEHOLDERS, CertifyUsageError
from areal_lightning.tools.certify.report import render
from areal_lightning.tools.losses import ENV_LOSSES, read_losses, record_loss

__all__ = [
    "ENV_MODE", "ENV_ROOT", "ENV_LOSSES", "LossRecorder", "record_loss", "read_losses", "certify", "CertifyUsageError",
    "expected_resume", "leftovers", "check_exports", "find_trials", "run_group", "RunResult", "render",
    "END_CHECK", "PLACEHOLDERS",
]


def __getattr__(name: str) -> Any:  # LossRecorder without importing Lightning for the CLI
    if name == "LossRecorder":
        return loss_log.LossRecorder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
