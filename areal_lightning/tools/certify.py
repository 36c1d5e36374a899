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

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from areal_lightning._fault import ENV_VAR as FAULT_ENV
from areal_lightning._fault import POINTS, TRACE_ENV_VAR
from areal_lightning.errors import AreaLightningError, CheckpointCorruptError
from areal_lightning.layout import (
    CHECKPOINT_INFO,
    HF_INDEX,
    LEFTOVER_PREFIXES,
    LOCK_FILE,
    OLD_PREFIX,
    RECOVER_CHECKPOINT,
    RECOVER_INFO,
    STEP_INFO,
    TMP_PREFIX,
    parse_export_name,
)

__all__ = [
    "ENV_MODE", "ENV_ROOT", "ENV_LOSSES", "LossRecorder", "record_loss", "certify", "CertifyUsageError",
    "expected_resume", "leftovers", "check_exports", "run_group",
]

ENV_MODE = "AREAL_LIGHTNING_CERTIFY_MODE"
ENV_ROOT = "AREAL_LIGHTNING_CERTIFY_ROOT"
ENV_LOSSES = "AREAL_LIGHTNING_CERTIFY_LOSSES"
PLACEHOLDERS = ("{root}", "{mode}", "{losses}")
END_CHECK = "after the last run: "
_RESUMED = re.compile(r"RecoverCallback: resumed from (\S+) after global step (\d+)")


class CertifyUsageError(AreaLightningError, ValueError):
    """Bad arguments to ``certify`` (exit code 2)."""


# ---------------------------------------------------------------------------------------
# The loss protocol (used inside the user's training process)
# ---------------------------------------------------------------------------------------


def record_loss(step: int, loss: Any, rank: int = 0) -> None:
    """Append ``{"step", "loss", "rank"}`` to ``$AREAL_LIGHTNING_CERTIFY_LOSSES`` (no-op when unset).

    ``loss`` may be a float, a 0-d tensor or any JSON value; floats and tensors are stored
    as ``float.hex()`` (bitwise comparable). One ``write`` per line on an ``O_APPEND`` file,
    so a SIGKILL never leaves half a line and several ranks may share the file.
    """
    path = os.environ.get(ENV_LOSSES)
    if not path:
        return
    if hasattr(loss, "item"):
        loss = loss.item()
    if isinstance(loss, float):
        loss = loss.hex()
    line = json.dumps({"step": int(step), "loss": loss, "rank": int(rank)}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


_LOSS_RECORDER: type | None = None


def _loss_recorder_class() -> type:
    global _LOSS_RECORDER
    if _LOSS_RECORDER is None:
        import lightning.pytorch as pl

        class LossRecorder(pl.Callback):
            """Records the training loss of every optimizer step for ``areal-lightning certify``.

            Add it to the Trainer's callbacks; it writes nothing unless the run is started by
            ``certify`` (``$AREAL_LIGHTNING_CERTIFY_LOSSES`` set). The step is
            ``trainer.global_step`` after the step (1-based), the rank ``trainer.global_rank``,
            the loss the one ``training_step`` returned (divided by ``accumulate_grad_batches``,
            as Lightning reports it; with gradient accumulation the last micro-batch's).
            It runs before ``RecoverCallback`` saves the step (that callback runs last).
            """

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                   batch_idx: int) -> None:
                loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
                if loss is not None:
                    record_loss(trainer.global_step, loss, trainer.global_rank)

        _LOSS_RECORDER = LossRecorder
    return _LOSS_RECORDER


def __getattr__(name: str) -> Any:  # LossRecorder without importing Lightning for the CLI
    if name == "LossRecorder":
        return _loss_recorder_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def read_losses(path: Path) -> dict[tuple[int, int], set[Any]]:
    """``{(rank, step): {loss, ...}}`` of a losses file (a step replayed after a resume adds to the set)."""
    out: dict[tuple[int, int], set[Any]] = {}
    if not path.is_file():
        return out
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = (int(row.get("rank", 0)), int(row["step"]))
            loss = json.dumps(row["loss"], sort_keys=True)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{n}: not a loss record {{\"step\", \"loss\"[, \"rank\"]}}: "
                             f"{line[:200]!r}") from exc
        out.setdefault(key, set()).add(loss)
    return out


# ---------------------------------------------------------------------------------------
# Running a command as a process group
# ---------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """How one run of the command ended."""

    rc: int | None
    killed: bool = False  # the injected kill fired (a kill line in the trace)
    killed_by: str = ""  # "point pid hit"
    timed_out: bool = False
    wall_s: float = 0.0
    log: str = ""  # stdout + stderr file

    def output(self) -> str:
        try:
            return Path(self.log).read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 1500) -> str:
        return self.output()[-n:]


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_group(argv: Sequence[str], env: dict[str, str], log: Path, timeout: float,
              trace: Path | None = None, poll_s: float = 0.05) -> RunResult:
    """Run ``argv`` as a new session (its own process group) with output to ``log``.

    The whole group is SIGKILLed when a ``kill`` line appears in ``trace`` (one process hit
    the injected kill: the others, e.g. the other DDP ranks, die with it, as on a lost
    node), on timeout, and when the leader exits (stray children such as a surviving rank
    or dataloader workers). The leader is reaped only after the group is killed, so its
    process-group id cannot be reused meanwhile.
    """
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    result = RunResult(rc=None, log=str(log))
    offset, pending = 0, b""
    try:
        while True:
            if trace is not None and not result.killed and trace.exists():
                with open(trace, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    parts = line.decode(errors="replace").split("\t")
                    if len(parts) == 4 and parts[3] == "kill":
                        result.killed, result.killed_by = True, " ".join(parts[:3])
                if result.killed:
                    _killpg(proc.pid)
            exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if exited is not None:
                _killpg(proc.pid)  # stragglers; the leader is a zombie, its pgid still reserved
                break
            if time.monotonic() - start > timeout:
                result.timed_out = True
                _killpg(proc.pid)
                break
            time.sleep(poll_s)
    finally:
        if proc.poll() is None:
            _killpg(proc.pid)
        result.rc = proc.wait()
        result.wall_s = time.monotonic() - start
    if trace is not None and not result.killed and trace.exists():  # a kill line written just before the exit
        for line in trace.read_text(errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) == 4 and parts[3] == "kill":
                result.killed, result.killed_by = True, " ".join(parts[:3])
    return result


def _trace_counts(trace: Path) -> dict[str, int]:
    """Hits of each point in a trace: the largest count of any one process."""
    per: dict[tuple[str, str], int] = {}
    if trace.exists():
        for line in trace.read_text(errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) == 4 and parts[2].isdigit():
                key = (parts[0], parts[1])
                per[key] = max(per.get(key, 0), int(parts[2]))
    counts: dict[str, int] = {}
    for (point, _pid), hits in per.items():
        counts[point] = max(counts.get(point, 0), hits)
    return counts


# ---------------------------------------------------------------------------------------
# What is on disk
# ---------------------------------------------------------------------------------------


def find_trials(root: Path) -> list[Path]:
    """Trial folders below ``root``: those holding a ``.lock``, ``recover_info/`` or a temporary recover_info."""
    found = set()
    if root.is_dir():
        for path in root.rglob("*"):
            if path.name in (LOCK_FILE, RECOVER_INFO) or path.name.startswith(
                    (f"{TMP_PREFIX}{RECOVER_INFO}-", f"{OLD_PREFIX}{RECOVER_INFO}-")):
                found.add(path.parent)
    return sorted(found)


def _step_of(info_dir: Path) -> int:
    return int(json.loads((info_dir / STEP_INFO).read_text())["global_step"])


def expected_resume(trial: Path) -> int | None:
    """The global step (0-based, as in ``step_info.json``) a start of ``trial`` must resume after.

    Read-only, from the documented commit protocol (deliberately not through
    :class:`~areal_lightning.commit.recover_store.RecoverStore`, the code being certified:
    an oracle that shares the code it checks cannot catch its bugs; it shares only the
    names of :mod:`areal_lightning.layout`): the new pair of an interrupted swap (its complete
    ``.tmp-recover_info-{gen}`` exists and the swap had begun: the old checkpoint or info was
    moved aside, or the new checkpoint is no longer at its temporary name), else the
    committed ``recover_info/`` (with its ``checkpoint_info.json``), else ``None`` (a fresh start).
    """
    tmp_info, old_info = f"{TMP_PREFIX}{RECOVER_INFO}-", f"{OLD_PREFIX}{RECOVER_INFO}-"
    tmp_ckpt, old_ckpt = f"{TMP_PREFIX}{RECOVER_CHECKPOINT}-", f"{OLD_PREFIX}{RECOVER_CHECKPOINT}-"
    pending: list[tuple[int, int]] = []
    for tmp in trial.glob(tmp_info + "*"):
        gen = tmp.name[len(tmp_info):]
        if not (tmp / CHECKPOINT_INFO).is_file():
            continue
        moved_aside = (trial / f"{old_info}{gen}").exists() or any(trial.glob(f"*/{old_ckpt}{gen}"))
        in_place = not any(trial.glob(f"*/{tmp_ckpt}{gen}"))
        if moved_aside or in_place:
            pending.append((_step_of(tmp), int(gen.partition("-")[0])))
    if pending:
        return max(pending, key=lambda p: p[1])[0]
    info = trial / RECOVER_INFO
    if (info / CHECKPOINT_INFO).is_file():
        return _step_of(info)
    return None


def leftovers(trial: Path) -> list[str]:
    """Temporary / trash / old files and folders left in ``trial`` (relative paths)."""
    return sorted(str(p.relative_to(trial)) for p in trial.rglob("*") if p.name.startswith(LEFTOVER_PREFIXES))


def _exports(trial: Path) -> dict[str, Path]:
    out = {}
    for model in trial.iterdir() if trial.is_dir() else ():
        if model.is_dir() and not model.name.startswith(".") and model.name != RECOVER_INFO:
            for child in model.iterdir():
                if child.is_dir() and parse_export_name(child.name) is not None:
                    out[f"{model.name}/{child.name}"] = child
    return out


def _load_export(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    json.loads((path / "config.json").read_text())
    index = path / HF_INDEX
    if index.is_file():
        for name in set(json.loads(index.read_text())["weight_map"].values()):
            if not (path / name).is_file():
                raise CheckpointCorruptError(f"{path / name} (named by {index.name}) is missing")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointCorruptError(f"{path} holds no *.safetensors")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def check_exports(trial: Path, reference: Path | None) -> tuple[int, list[str]]:
    """Load every final-named HF export of ``trial``; compare with the same trial of the reference.

    Returns (number of exports, problems).
    """
    import torch

    problems: list[str] = []
    mine = _exports(trial)
    theirs = _exports(reference) if reference is not None else None
    if theirs is not None and set(mine) != set(theirs):
        problems.append(f"exports {sorted(mine)} != reference {sorted(theirs)}")
    for rel, path in sorted(mine.items()):
        try:
            tensors = _load_export(path)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            problems.append(f"{rel} does not load: {exc}")
            continue
        if theirs is not None and rel in theirs:
            try:
                ref = _load_export(theirs[rel])
            except Exception as exc:  # noqa: BLE001
                problems.append(f"reference {rel} does not load: {exc}")
                continue
            if set(ref) != set(tensors):
                problems.append(f"{rel}: tensors {sorted(set(tensors) ^ set(ref))} differ from the reference's")
            elif not all(tensors[k].dtype == ref[k].dtype and torch.equal(tensors[k], ref[k]) for k in ref):
                bad = [k for k in ref if not torch.equal(tensors[k], ref[k])]
                problems.append(f"{rel}: weights differ from the reference's export ({', '.join(bad[:3])})")
    return len(mine), problems


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------


@dataclass
class Reference:
    """The uninterrupted run of one mode."""

    mode: str
    dir: Path
    ok: bool = False
    error: str = ""
    counts: dict[str, int] = field(default_factory=dict)
    losses: dict[tuple[int, int], set[Any]] = field(default_factory=dict)
    trials: list[str] = field(default_factory=list)  # relative to root
    step_info: dict[str, Any] = field(default_factory=dict)  # per trial
    wall_s: float = 0.0

    @property
    def root(self) -> Path:
        return self.dir / "root"


@dataclass
class Case:
    """One fault point x mode and what happened to it."""

    point: str
    mode: str
    nth: int | None = None  # the hit that was killed (given with P@N / --nth, else chosen)
    hits: int = 0  # hits of the point in the reference (largest per process)
    status: str = "pending"  # pass | fail | not reached | error
    killed: bool = False
    killed_by: str = ""  # "point pid hit" of the process that hit the kill
    expected_resume: int | None = None  # global step of the last committed checkpoint after the kill
    resumed_from: list[int] = field(default_factory=list)  # from the rerun's log line, one per rank
    exact: str = ""
    leftovers: list[str] = field(default_factory=list)
    exports: str = ""
    reasons: list[str] = field(default_factory=list)
    wall_s: float = 0.0  # the run killed at this point
    dir: str = ""
    sequence: str = ""  # the folder (case or chain) its runs used
    link: int = 0  # the run of that sequence killed at this point (1-based)
    explicit_nth: bool = field(default=False, repr=False)
    requeued: int = field(default=0, repr=False)


def _substitute(command: Sequence[str], root: Path, mode: str, losses: Path) -> list[str]:
    values = {"{root}": str(root), "{mode}": mode, "{losses}": str(losses)}
    out = []
    for arg in command:
        for key, value in values.items():
            arg = arg.replace(key, value)
        out.append(arg)
    return out


def _env(root: Path, mode: str, losses: Path, fault: str | None, trace: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, TRACE_ENV_VAR)}
    env.update({ENV_ROOT: str(root), ENV_MODE: mode, ENV_LOSSES: str(losses)})
    if fault:
        env[FAULT_ENV] = fault
    if trace is not None:
        env[TRACE_ENV_VAR] = str(trace)
    return env


def _loss_problem(got: dict[tuple[int, int], set[Any]], want: dict[tuple[int, int], set[Any]],
                  complete: bool) -> str | None:
    """Every recorded loss equals the reference's (and, if ``complete``, every reference step was trained)."""
    for key in sorted(got):
        if key not in want:
            return f"rank {key[0]} trained step {key[1]}, which the reference never trained"
        if got[key] != want[key]:
            return f"rank {key[0]} step {key[1]}: losses {sorted(got[key])} != reference {sorted(want[key])}"
    if complete:
        missing = sorted(set(want) - set(got))
        if missing:
            return f"(rank, step) {missing[:5]}{' ...' if len(missing) > 5 else ''} never trained"
    return None


def _merge(parts: list[dict[tuple[int, int], set[Any]]]) -> dict[tuple[int, int], set[Any]]:
    out: dict[tuple[int, int], set[Any]] = {}
    for part in parts:
        for key, losses in part.items():
            out.setdefault(key, set()).update(losses)
    return out


class Certifier:
    """Runs the references and the cases (see the module doc).

    The runs of a *sequence* share one ``{root}``: run 1 is killed at the first case's
    point, run 2 resumes from that kill (checked) and is killed at the next case's point
    (``chain=True``), ..., and a last run without a fault finishes the training, after
    which leftovers, exports, the final ``step_info.json`` and the coverage of all steps are
    checked. Without ``chain`` every case is its own sequence (killed run + clean rerun).
    """

    def __init__(self, command: Sequence[str], points: dict[str, list[tuple[str, int | None]]], modes: list[str], *,
                 timeout: float, jobs: int, workdir: Path, keep: bool, nth: int | None, chain: bool,
                 echo: Callable[[str], None]) -> None:
        self.command, self.points, self.modes = list(command), points, modes
        self.timeout, self.jobs, self.workdir, self.keep, self.nth = timeout, jobs, workdir, keep, nth
        self.chain = chain
        self.echo = echo
        self.references: dict[str, Reference] = {}
        self.cases: list[Case] = []
        self.sequences: list[dict[str, Any]] = []
        self.phases: dict[str, float] = {}
        self._lock = threading.Lock()
        self._done = self._total = 0

    # -- reference ------------------------------------------------------------------------

    def reference(self, mode: str) -> Reference:
        ref = Reference(mode, self.workdir / mode / "reference")
        ref.root.mkdir(parents=True)
        losses, trace = ref.dir / "losses.jsonl", ref.dir / "trace.tsv"
        argv = _substitute(self.command, ref.root, mode, losses)
        run = run_group(argv, _env(ref.root, mode, losses, "*:trace", trace), ref.dir / "output.log", self.timeout)
        ref.wall_s = run.wall_s
        if run.timed_out or run.rc != 0:
            ref.error = (f"the uninterrupted run {'timed out' if run.timed_out else f'exited with {run.rc}'} "
                         f"(log {run.log}):\n{run.tail()}")
            return ref
        try:
            ref.losses = read_losses(losses)
        except ValueError as exc:
            ref.error = str(exc)
            return ref
        trials = find_trials(ref.root)
        if not ref.losses:
            ref.error = ("the command recorded no losses: add areal_lightning.tools.certify.LossRecorder() to the "
                         "Trainer's callbacks, or append {\"step\", \"loss\"} JSON lines to {losses} "
                         f"(${ENV_LOSSES})")
        elif not trials:
            ref.error = (f"the command wrote no trial below {{root}} ({ref.root}): pass {{root}} (or ${ENV_ROOT}) as "
                         "RecoverCallback's fileroot")
        elif any(len(v) != 1 for v in ref.losses.values()):
            ref.error = "the uninterrupted run recorded a step twice (with --keep: see its losses.jsonl)"
        else:
            ref.ok = True
            ref.trials = [str(t.relative_to(ref.root)) for t in trials]
            ref.counts = _trace_counts(trace)
            for t in trials:
                info = t / RECOVER_INFO / STEP_INFO
                ref.step_info[str(t.relative_to(ref.root))] = json.loads(info.read_text()) if info.is_file() else None
            left = [f"{rel}/{x}" for rel, t in zip(ref.trials, trials) for x in leftovers(t)]
            if left:
                ref.ok, ref.error = False, f"the uninterrupted run itself left temporary files: {left}"
        return ref

    # -- sequences ------------------------------------------------------------------------

    def _resume_problem(self, case: Case, output: str) -> str | None:
        case.resumed_from = [int(m.group(2)) for m in _RESUMED.finditer(output)]
        if case.expected_resume is None:
            if case.resumed_from:
                return f"resumed after global step {case.resumed_from} although nothing was committed"
            return None
        if not case.resumed_from:
            return (f"started fresh although the checkpoint after global step {case.expected_resume} was "
                    "committed (no 'RecoverCallback: resumed from' line)")
        if set(case.resumed_from) != {case.expected_resume}:
            return (f"resumed after global step {sorted(set(case.resumed_from))}, but the last committed "
                    f"checkpoint is after global step {case.expected_resume}")
        return None

    def _end_checks(self, root: Path, ref: Reference, losses: dict[tuple[int, int], set[Any]]) -> dict[str, Any]:
        problems: list[str] = []
        problem = _loss_problem(losses, ref.losses, complete=True)
        if problem:
            problems.append(f"losses: {problem}")
        for rel, want in ref.step_info.items():
            info = root / rel / RECOVER_INFO / STEP_INFO
            have = json.loads(info.read_text()) if info.is_file() else None
            if have != want:
                problems.append(f"final {rel}/recover_info/step_info.json {have} != the reference's {want}")
        left: list[str] = []
        n_exports, export_problems = 0, []
        for rel in sorted(set(ref.trials) | {str(t.relative_to(root)) for t in find_trials(root)}):
            left += [f"{rel}/{x}" for x in leftovers(root / rel)]
            n, found = check_exports(root / rel, ref.root / rel if rel in ref.trials else None)
            n_exports += n
            export_problems += found
        if left:
            problems.append(f"left after the rerun: {left}")
        problems += export_problems
        exports = "none" if n_exports == 0 and not export_problems else (
            f"{n_exports} ok" if not export_problems else f"{n_exports}: BAD")
        return {"problems": problems, "leftovers": left, "exports": exports, "losses_ok": problem is None}

    def _finish(self, case: Case, status: str, reason: str | None = None) -> None:
        if reason:
            case.reasons.append(reason)
        case.status = status
        with self._lock:
            self._done += 1
            self.echo(f"[{self._done}/{self._total}] {case.point} ({case.mode}): {case.status.upper()}"
                      + (f" — {case.reasons[0][:300]}" if case.reasons and case.status != "pass" else "")
                      + (f" ({case.wall_s:.1f}s)" if case.wall_s else ""))

    def run_sequence(self, mode: str, cases: list[Case], tag: str) -> list[Case]:
        """Run one sequence (see the class doc); return the cases to try again in a new one."""
        ref = self.references[mode]
        if not ref.ok:
            for c in cases:
                self._finish(c, "error", f"the reference run ({mode}) failed: {ref.error.splitlines()[0]}")
            return []
        cdir = self.workdir / mode / tag
        root = cdir / "root"
        pending, requeue = list(cases), []
        killed: list[Case] = []  # cases killed in this sequence, in order
        # Killed cases whose resume no run has shown yet: normally the last one; more when a
        # run was killed before it resumed (e.g. while rolling an interrupted swap forward).
        awaiting: list[Case] = []
        per_run: list[dict[tuple[int, int], set[Any]]] = []
        seen: set[tuple[int, int]] = set()
        index, started = 0, time.monotonic()

        def again(c: Case) -> None:
            c.requeued += 1
            if not c.explicit_nth:
                c.nth = None
            c.sequence, c.dir, c.link, c.wall_s = "", "", 0, 0.0
            requeue.append(c)

        while True:
            case = None
            while pending:
                c = pending.pop(0)
                c.hits = ref.counts.get(c.point, 0)
                if not c.explicit_nth and c.hits == 0 and index == 0:
                    # A fresh run does what the reference did. (After a kill, a rerun may reach
                    # points the reference never does, e.g. re-exporting a step: tried with @1.)
                    self._finish(c, "not reached", "the uninterrupted run never reached this point")
                    continue
                case = c
                break
            if case is None and not awaiting:
                return requeue
            if index == 0:
                root.mkdir(parents=True)
            index += 1
            fault = None
            if case is not None:
                if not case.explicit_nth:
                    case.nth = self.nth if self.nth is not None else (
                        max((case.hits + 1) // 2, 1) if index == 1 else 1)
                case.sequence, case.link, case.dir = tag, index, str(cdir)
                fault = f"*:trace,{case.point}:kill@{case.nth}"
            losses = cdir / f"run{index}.losses.jsonl"
            trace = cdir / f"run{index}.trace.tsv" if fault else None
            argv = _substitute(self.command, root, mode, losses)
            run = run_group(argv, _env(root, mode, losses, fault, trace), cdir / f"run{index}.log", self.timeout,
                            trace)
            try:
                recorded = read_losses(losses)
                bad_losses = _loss_problem(recorded, ref.losses, complete=False)
            except ValueError as exc:
                recorded, bad_losses = {}, str(exc)
            per_run.append(recorded)
            broken = run.timed_out or (not run.killed and run.rc != 0)
            what = "timed out" if run.timed_out else f"exited with {run.rc}"
            output = run.output()
            if case is not None:
                case.wall_s = run.wall_s
            # This run restarted after the previous kill(s): check where it resumed.
            if awaiting:
                if broken:
                    for c in awaiting:
                        self._finish(c, "fail", f"the rerun {what} (log {run.log}):\n{run.tail()}")
                    awaiting = []
                elif not run.killed or recorded or _RESUMED.search(output):
                    replayed = len(set(recorded) & seen)
                    for c in awaiting:
                        for problem in (self._resume_problem(c, output),
                                        f"losses of the rerun: {bad_losses}" if bad_losses else None):
                            if problem:
                                c.reasons.append(problem)
                        c.exact = ("yes" if not bad_losses else "NO") + f" ({replayed} replayed)"
                    awaiting = []
                # else: killed before it resumed; the next run must resume where they expect
            elif case is not None and bad_losses and not broken:
                case.reasons.append(f"losses before the kill: {bad_losses}")
            seen |= set(recorded)
            if broken:
                if case is not None:
                    if index == 1:
                        self._finish(case, "fail", f"the run with the fault {what} before the fault fired "
                                                   f"(log {run.log}):\n{run.tail()}")
                    else:
                        again(case)
                for c in killed:
                    if c.status == "pending":
                        self._finish(c, "fail", f"end checks not run: run {index} of sequence {tag} {what}")
                requeue += pending
                break
            if run.killed:
                assert case is not None
                case.killed, case.killed_by = True, run.killed_by
                main = root / ref.trials[0]
                case.expected_resume = expected_resume(main) if main.is_dir() else None
                killed.append(case)
                awaiting.append(case)
                continue
            # The run finished (exit 0); with a fault, its point was not reached after the resume.
            if case is not None:
                if index == 1 or case.requeued >= 1 or (case.hits == 0 and not case.explicit_nth):
                    self._finish(case, "not reached", f"the run exited 0 before the point's hit {case.nth}"
                                 if case.hits else "not reached by the uninterrupted run nor after a kill")
                else:
                    again(case)
            end = self._end_checks(root, ref, _merge(per_run))
            for c in killed:
                c.leftovers, c.exports = end["leftovers"], end["exports"]
                c.reasons += [f"{END_CHECK}{p}" for p in end["problems"]]
                if not end["losses_ok"]:
                    c.exact = "NO"
                self._finish(c, "fail" if c.reasons else "pass")
            requeue += pending
            break
        with self._lock:
            self.sequences.append({"mode": mode, "sequence": tag, "runs": index,
                                   "wall_s": round(time.monotonic() - started, 2),
                                   "points": [c.point for c in killed]})
        if not self.keep and killed and all(c.status == "pass" for c in killed):
            import shutil

            shutil.rmtree(cdir, ignore_errors=True)
        return requeue

    def _worker(self, mode: str, cases: list[Case], tag: str) -> None:
        n = 0
        while cases:
            n += 1
            cases = self.run_sequence(mode, cases, tag if n == 1 else f"{tag}-{n}")

    # -- all ------------------------------------------------------------------------------

    def run(self) -> None:
        self.cases = [Case(point, mode, nth, explicit_nth=nth is not None)
                      for mode in self.modes for point, nth in self.points[mode]]
        self._total = len(self.cases)
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            for ref in pool.map(self.reference, self.modes):
                self.references[ref.mode] = ref
                self.echo(f"reference ({ref.mode}): " + (
                    f"ok, {len(ref.losses)} steps, {sum(1 for p, _ in self.points[ref.mode] if ref.counts.get(p))}/"
                    f"{len(self.points[ref.mode])} points reached ({ref.wall_s:.1f}s)" if ref.ok
                    else f"FAILED: {ref.error}"))
            tasks = []
            for mode in self.modes:
                mine = [c for c in self.cases if c.mode == mode]
                if self.chain:  # contiguous groups, in the order given
                    size = -(-len(mine) // self.jobs)
                    groups = [mine[j * size:(j + 1) * size] for j in range(self.jobs)]
                    tasks += [(mode, g, f"chain{j + 1}") for j, g in enumerate(groups) if g]
                else:
                    tasks += [(mode, [c], c.point) for c in mine]
            self.phases["references_s"] = round(time.monotonic() - start, 2)
            list(pool.map(lambda t: self._worker(*t), tasks))
            self.phases["cases_s"] = round(time.monotonic() - start - self.phases["references_s"], 2)
            if self.chain:
                self._attribute(pool)
                self.phases["attribution_s"] = round(time.monotonic() - start - self.phases["references_s"]
                                                     - self.phases["cases_s"], 2)

    def _attribute(self, pool: ThreadPoolExecutor) -> None:
        """Chained cases that failed only the end checks (which cannot tell which kill of the
        chain caused the problem) run again one by one, unchained; each takes that verdict.
        If all of them pass alone, they stay failed: the problem needs consecutive kills."""
        suspects = [c for c in self.cases
                    if c.status == "fail" and c.reasons and all(r.startswith(END_CHECK) for r in c.reasons)]
        if not suspects:
            return
        self.echo(f"{len(suspects)} chained case(s) failed only the checks after the last run; running them "
                  "alone to find which kill caused it")
        alone = [Case(c.point, c.mode, c.nth if c.explicit_nth else None, explicit_nth=c.explicit_nth)
                 for c in suspects]
        with self._lock:
            self._done, self._total = 0, len(alone)
        list(pool.map(lambda c: self._worker(c.mode, [c], f"{c.point}-alone"), alone))
        if all(a.status == "pass" for a in alone):
            for c in suspects:
                c.reasons.append("each of the points of this chain passes when killed alone: the problem needs "
                                 f"several consecutive kills (sequence {c.sequence})")
            return
        for c, a in zip(suspects, alone):
            note = f"chained in {c.sequence}, the checks after the last run failed; run alone it is {a.status}"
            for name in ("status", "nth", "killed", "killed_by", "expected_resume", "resumed_from", "exact",
                         "leftovers", "exports", "reasons", "wall_s", "dir", "sequence", "link"):
                setattr(c, name, getattr(a, name))
            c.reasons = c.reasons + [note] if c.status != "pass" else [note]


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def _resumed_text(case: Case) -> str:
    if case.status in ("not reached", "error") or not case.killed:
        return "–"
    got = sorted(set(case.resumed_from))
    have = "fresh" if not got else ",".join(str(s) for s in got)
    if len(case.resumed_from) > 1:
        have += f" ×{len(case.resumed_from)}"
    want = "fresh" if case.expected_resume is None else str(case.expected_resume)
    return have if (got == [case.expected_resume] or (not got and case.expected_resume is None)) \
        else f"{have} (want {want})"


def render(cases: list[Case], console: Any = None) -> None:
    """Print the certification table (rich)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(width=None if os.isatty(1) else 200, highlight=False)
    table = Table(title="areal-lightning certify: SIGKILL at each fault point, then the same command again")
    chained = any(c.link > 1 for c in cases)
    for col in ("point", "mode", "kill at", *(("run",) if chained else ()), "killed?", "resumed after step",
                "exact?", "leftovers", "exports", "verdict"):
        table.add_column(col, overflow="fold")
    style = {"pass": "green", "fail": "bold red", "error": "bold red", "not reached": "yellow"}
    for c in cases:
        table.add_row(
            c.point, c.mode,
            f"{c.nth}/{c.hits}" if c.nth else "–",
            *(("alone" if c.sequence.endswith("-alone") else f"{c.sequence} #{c.link}" if c.link else "–",)
              if chained else ()),
            "yes" if c.killed else "no",
            _resumed_text(c),
            c.exact or "–",
            ("none" if not c.leftovers else f"{len(c.leftovers)}: {c.leftovers[0]}") if c.killed else "–",
            c.exports or "–",
            f"[{style.get(c.status, '')}]{c.status.upper()}[/]",
        )
    console.print(table)
    for c in cases:
        if c.status in ("fail", "error"):
            console.print(Text.assemble((f"{c.point} ({c.mode})", "bold red"), ": " + "\n  ".join(c.reasons)
                                        + (f"\n  kept: {c.dir}" if c.dir else "")))


def _parse_points(text: str) -> list[tuple[str, int | None]]:
    if text.strip() == "all":
        return [(p, None) for p in POINTS]
    out: list[tuple[str, int | None]] = []
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        point, _, nth = entry.partition("@")
        if point not in POINTS:
            raise CertifyUsageError(f"--points: unknown fault point {point!r}; known: {', '.join(POINTS)}")
        if nth and (not nth.isdigit() or int(nth) < 1):
            raise CertifyUsageError(f"--points: {entry!r}: @N must be an integer >= 1")
        out.append((point, int(nth) if nth else None))
    if not out:
        raise CertifyUsageError("--points: no point given")
    return out


def _points_per_mode(points: str | Sequence[str], modes: list[str]) -> dict[str, list[tuple[str, int | None]]]:
    """``--points`` values: ``all`` or ``P1,P2[@N]`` for every mode, or ``MODE=...`` for one mode."""
    specs = [points] if isinstance(points, str) else list(points) or ["all"]
    common: list[tuple[str, int | None]] | None = None
    per: dict[str, list[tuple[str, int | None]]] = {}
    for spec in specs:
        mode, sep, rest = spec.partition("=")
        if sep:
            if mode.strip() not in modes:
                raise CertifyUsageError(f"--points {spec!r}: mode {mode.strip()!r} is not one of --modes {modes}")
            per[mode.strip()] = _parse_points(rest)
        else:
            common = _parse_points(spec)
    out = {}
    for mode in modes:
        if mode in per:
            out[mode] = per[mode]
        elif common is not None or not per:
            out[mode] = common if common is not None else _parse_points("all")
        else:
            out[mode] = []  # --points given for other modes only
    return out


def certify(command: Sequence[str], *, points: str | Sequence[str] = "all", modes: str = "sync,async",
            timeout: float = 600,
            jobs: int = 1, nth: int | None = None, workdir: str | None = None, keep: bool = False,
            json_path: str | None = None, strict: bool = False, chain: bool = False,
            echo: Callable[[str], None] | None = None, console: Any = None) -> int:
    """Run the certification (see the module doc); print the table; return the exit code."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CertifyUsageError("no training command given; usage: areal-lightning certify [options] -- <command ...>")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    if not mode_list or any(ch in m for m in mode_list for ch in "{}/ =") or len(set(mode_list)) != len(mode_list):
        raise CertifyUsageError(f"--modes: expected a comma-separated list such as sync,async, got {modes!r}")
    point_lists = _points_per_mode(points, mode_list)
    mode_list = [m for m in mode_list if point_lists[m]]
    if not mode_list:
        raise CertifyUsageError("--points: no point given")
    if timeout <= 0 or jobs < 1 or (nth is not None and nth < 1):
        raise CertifyUsageError("--timeout must be > 0, --jobs >= 1, --nth >= 1")
    echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not any("{root}" in arg for arg in command):
        echo(f"note: the command has no {{root}} placeholder; it must read ${ENV_ROOT} as RecoverCallback's fileroot")
    if workdir is None:
        work = Path(tempfile.mkdtemp(prefix="areal-certify-"))
    else:
        work = Path(workdir)
        if work.exists() and any(work.iterdir()):
            raise CertifyUsageError(f"--workdir {work} is not empty")
        work.mkdir(parents=True, exist_ok=True)
    n_cases = sum(len(point_lists[m]) for m in mode_list)
    echo(f"certify: {n_cases} case(s) ({', '.join(f'{m}: {len(point_lists[m])}' for m in mode_list)}) of: "
         f"{shlex.join(command)}  "
         f"(work folder {work}, {jobs} job(s){', chained' if chain else ''})")
    start = time.monotonic()
    cert = Certifier(command, point_lists, mode_list, timeout=timeout, jobs=jobs, workdir=work, keep=keep, nth=nth,
                     chain=chain, echo=echo)
    cert.run()
    wall = time.monotonic() - start
    render(cert.cases, console)
    counts = {s: sum(1 for c in cert.cases if c.status == s) for s in ("pass", "fail", "error", "not reached")}
    failed = counts["fail"] + counts["error"] + sum(1 for r in cert.references.values() if not r.ok)
    summary = (f"{counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, "
               f"{counts['not reached']} not reached, in {wall:.1f}s")
    echo(summary)
    if json_path:
        doc = {
            "command": command, "modes": mode_list, "wall_s": round(wall, 2), "summary": counts,
            "references": {m: {"ok": r.ok, "error": r.error, "steps": len(r.losses), "trials": r.trials,
                               "points_reached": r.counts, "wall_s": round(r.wall_s, 2)}
                           for m, r in cert.references.items()},
            "chain": chain, "phases": cert.phases, "sequences": cert.sequences,
            "cases": [{**{k: v for k, v in asdict(c).items() if k not in ("explicit_nth", "requeued")},
                       "wall_s": round(c.wall_s, 2)} for c in cert.cases],
        }
        Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
    if not keep and not failed:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if failed:
        return 1
    if strict and counts["not reached"]:
        return 1
    return 0
