"""The kill demonstration (in the parent process): a worker SIGKILLed mid-run and started again
with the same command, an uninterrupted reference beside it, every per-step loss compared."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable


from areal_lightning.layout import TrialLayout

if TYPE_CHECKING:
    pass
from areal_lightning.tools.demo.config import DemoConfig, DemoMismatchError, MODEL_NAME, PAUSE_ENV, REFERENCE_SUFFIX, STALL_TIMEOUT_S, _short_list
from areal_lightning.tools.demo.train import worker_threads


@dataclass
class _Launch:
    """What one start of a worker recorded in its losses file."""

    pid: int | None = None
    losses: dict[int, str] = field(default_factory=dict)  # step (from 1) -> float.hex()
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # step -> (epoch, batch)
    resumed_after: int | None = None  # steps in the checkpoint it resumed from
    resumed_info: dict[str, Any] | None = None
    ended_at: int | None = None


def _read_launches(path: Path) -> list[_Launch]:
    """The starts recorded in a losses file, in order (a partial last line is ignored)."""
    launches: list[_Launch] = []
    if not path.is_file():
        return launches
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        event = row.get("event")
        if event == "start":
            launches.append(_Launch(pid=row.get("pid")))
            continue
        if not launches:
            launches.append(_Launch())
        cur = launches[-1]
        if event == "resumed":
            cur.resumed_after = int(row["global_step"]) + 1
            cur.resumed_info = row
        elif event == "end":
            cur.ended_at = int(row["global_step"])
        elif "step" in row:
            cur.losses[int(row["step"])] = row["loss"]
            cur.where[int(row["step"])] = (int(row.get("epoch", -1)), int(row.get("batch", -1)))
    return launches


class _Tail:
    """Reads the step lines a worker appends, incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last_step, self.last_seen = path, 0, 0, time.monotonic()

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.last_step
        end = chunk.rfind(b"\n")
        if end >= 0:
            self.offset += end + 1
            for line in chunk[:end].splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if "step" in row:
                    self.last_step = int(row["step"])
                    self.last_seen = time.monotonic()
        return self.last_step


class _Worker:
    """One worker command (the same command for the first start and the restart)."""

    def __init__(self, label: str, command: list[str], log_path: Path, losses: Path) -> None:
        self.label, self.command, self.log_path, self.losses = label, command, log_path, losses
        self.proc: subprocess.Popen | None = None
        self.tail = _Tail(losses)
        self.starts = 0

    def start(self, pause_at: int | None = None) -> None:
        """Start the command; ``pause_at``: the worker stops itself after that step (see :data:`PAUSE_ENV`)."""
        env = dict(os.environ)
        env.pop(PAUSE_ENV, None)
        if pause_at is not None:
            env[PAUSE_ENV] = str(pause_at)
        # The worker imports the same areal_lightning as this process, wherever it was found.
        pkg_root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        with open(self.log_path, "ab") as logf:
            logf.write(f"=== start {self.starts + 1}: {' '.join(self.command)}\n".encode())
            logf.flush()
            # Its own process group: the SIGKILL reaches every process of the run.
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.starts += 1
        self.tail.last_seen = time.monotonic()

    def paused(self) -> bool:
        """Whether the worker has stopped itself (SIGSTOP): read without reaping it."""
        if self.proc is None:
            return False
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return info is not None and info.si_code == os.CLD_STOPPED

    def sigkill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def check(self) -> int | None:
        """The exit code once it ended (a failure raises), else ``None``; a stalled worker is killed."""
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is None:
            self.tail.poll()
            if time.monotonic() - self.tail.last_seen > STALL_TIMEOUT_S:
                self.sigkill()
                raise DemoMismatchError(f"{self.label}: no training step for {STALL_TIMEOUT_S:.0f} s; killed it. "
                                        f"Its log: {self.log_path}\n{self.log_tail()}")
            return None
        if rc != 0:
            raise DemoMismatchError(f"{self.label}: the worker failed with exit code {rc}. Its log: "
                                    f"{self.log_path}\n{self.log_tail()}")
        return rc

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _durable_resume_step(trial_dir: Path) -> int | None:
    """Steps (from 1) in the recover checkpoint a start of ``trial_dir`` must resume from, read
    from disk by ``certify``'s independent oracle (the commit protocol), or ``None``."""
    from areal_lightning.tools.certify import expected_resume

    step = expected_resume(trial_dir)
    return None if step is None else step + 1


def _fmt(hexloss: str | None) -> str:
    # 9 significant digits tell every two float32 values apart.
    return "-" if hexloss is None else f"{float.fromhex(hexloss):.9g}"


def _same_files(a: Path, b: Path) -> tuple[bool, int]:
    """Are the two folders' files byte-identical? ``(equal, number of files)``."""
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    if fa != fb:
        return False, len(fa)
    return all((a / p).read_bytes() == (b / p).read_bytes() for p in fa), len(fa)


def compare_runs(reference: dict[int, str], before_kill: dict[int, str], after_resume: dict[int, str],
                 resumed_from: int, killed_at: int, total: int) -> dict[str, Any]:
    """Compare the killed + resumed run with the uninterrupted reference, loss by loss (bits).

    ``before_kill``: the first start's losses (steps 1..killed_at); ``after_resume``: the
    restart's (resumed_from+1..total); ``reference``: the uninterrupted run's (1..total).
    Returns ``{"match": bool, "differ": [steps], "missing": [steps], "replay_match": bool,
    "groups": [(first, last, label, equal, count)]}``.
    """
    combined = {s: v for s, v in before_kill.items() if s <= resumed_from}
    combined.update(after_resume)
    steps = range(1, total + 1)
    missing = [s for s in steps if s not in combined or s not in reference]
    differ = [s for s in steps if s in combined and s in reference and combined[s] != reference[s]]
    replayed = range(resumed_from + 1, killed_at + 1)
    replay_differ = [s for s in replayed if before_kill.get(s) is None or before_kill.get(s) != after_resume.get(s)]
    groups = []
    for lo, hi, label in ((1, resumed_from, "first start, before the kill, vs reference"),
                          (resumed_from + 1, killed_at,
                           "trained twice (before the kill, again after the resume) vs reference"),
                          (killed_at + 1, total, "after the resume vs reference")):
        if hi >= lo:
            span = range(lo, hi + 1)
            equal = sum(1 for s in span if s in combined and combined[s] == reference.get(s)
                        and (s not in replayed or before_kill.get(s) == combined[s]))
            groups.append((lo, hi, label, equal, len(span)))
    extra = sorted(set(after_resume) - set(steps)) + sorted(set(reference) - set(steps))
    return {"match": not missing and not differ and not replay_differ and not extra and len(combined) == total,
            "differ": differ, "missing": missing, "replay_differ": replay_differ, "replay_match": not replay_differ,
            "groups": groups, "combined": combined}


def _table_steps(resumed_from: int, killed_at: int, total: int) -> list[int | None]:
    """The rows of the table: around the checkpoint, around the kill, the last step (None = '...')."""
    want = [resumed_from, resumed_from + 1, resumed_from + 2, killed_at - 1, killed_at, killed_at + 1,
            killed_at + 2, total]
    rows: list[int | None] = []
    for s in sorted({s for s in want if 1 <= s <= total}):
        if rows and rows[-1] is not None and s > rows[-1] + 1:
            rows.append(None)
        rows.append(s)
    return rows


def _print_table(say: Callable[[str], None], reference: dict[int, str], before: dict[int, str],
                 after: dict[int, str], resumed_from: int, killed_at: int, total: int) -> None:
    say(f"  {'step':>6}  {'loss before kill':>16}  {'after resume':>14}  {'reference':>14}")
    for s in _table_steps(resumed_from, killed_at, total):
        if s is None:
            say(f"  {'...':>6}")
            continue
        b, a, r = before.get(s), after.get(s), reference.get(s)
        run = a if a is not None else b
        same = run is not None and run == r and (a is None or b is None or a == b)
        notes = ["same bits" if same else "DIFFERENT"]
        if s == resumed_from:
            notes.append("<- recover checkpoint; resumed from here")
        if s == killed_at:
            notes.append("<- SIGKILL here")
        if s == total:
            notes.append("<- last step")
        say(f"  {s:>6}  {_fmt(b):>16}  {_fmt(a):>14}  {_fmt(r):>14}  {'  '.join(notes)}")


def _run_killed_and_reference(cfg: DemoConfig, say: Callable[[str], None],
                              before_resume: Callable[[Path], None] | None) -> dict[str, Any]:
    """Train ``cfg`` side by side as the reference and as the run that gets killed; compare."""
    t0 = time.monotonic()

    def note(msg: str) -> None:
        say(f"demo [{time.monotonic() - t0:5.1f}s] {msg}")

    t = cfg.train
    total, kill_at, ckpts = t.total_steps, cfg.kill_step(), cfg.recover_steps()
    ref_cfg = dataclasses.replace(cfg, trial_name=cfg.trial_name + REFERENCE_SUFFIX)
    layouts = {name: TrialLayout(Path(c.fileroot), c.resolved_user, c.experiment_name, c.trial_name)
               for name, c in (("run", cfg), ("ref", ref_cfg))}
    for layout in layouts.values():
        if layout.trial_dir.exists():  # a previous demo's trial would resume (and do nothing)
            note(f"removing the previous demo trial {layout.trial_dir}")
            shutil.rmtree(layout.trial_dir)
    work = Path(tempfile.mkdtemp(prefix="areal-lightning-demo-"))
    threads = worker_threads()
    workers = {}
    for name, c in (("run", cfg), ("ref", ref_cfg)):
        conf = dataclasses.asdict(c)
        conf["train"]["progress_bar"] = False
        (work / f"{name}.json").write_text(json.dumps(conf, indent=1))
        command = [sys.executable, "-m", "areal_lightning.tools.demo", "--worker", str(work / f"{name}.json"),
                   "--losses", str(work / f"{name}-losses.jsonl"), "--threads", str(threads)]
        workers[name] = _Worker(f"{c.trial_name} worker", command, work / f"{name}.log", work / f"{name}-losses.jsonl")
    run, ref = workers["run"], workers["ref"]
    run_dir, ref_dir = layouts["run"].trial_dir, layouts["ref"].trial_dir
    note(f"training {total} steps twice, side by side, in two worker processes ({threads} thread(s) each):")
    say(f"  {ref_dir}  never interrupted (the reference)")
    say(f"  {run_dir}  recover checkpoints after steps {_short_list(ckpts) or '(seconds trigger)'}; "
        f"SIGKILLed after step {kill_at}, then started again with the same command:")
    say(f"    {' '.join(run.command)}")
    ok, shown = False, [time.monotonic()]

    def progress() -> None:  # a line every 15 s while the workers train
        if time.monotonic() - shown[0] >= 15:
            shown[0] = time.monotonic()
            at = [f"{c.trial_name} at step {w.tail.last_step}/{total}" if w.tail.last_step else
                  f"{c.trial_name} starting (imports, setup{', resume' if w.starts > 1 else ''})"
                  for c, w in ((cfg, run), (ref_cfg, ref))]
            note(", ".join(at))

    try:
        ref.start()
        run.start(pause_at=kill_at)
        # 1. the first start, until it stops itself right after the kill step (a recover checkpoint durable)
        while not run.paused():
            ref.check()
            if run.check() is not None:
                raise DemoMismatchError(f"{run.label} finished all {total} steps before it could be killed (no recover "
                                        f"checkpoint was durable after step {kill_at}); lower kill.at_step")
            progress()
            time.sleep(0.01)
        run.tail.poll()
        note(f"{cfg.trial_name}: the worker stopped itself after step {run.tail.last_step}, as asked (a step "
             "boundary chosen in advance)")
        pid = run.proc.pid  # type: ignore[union-attr]
        run.sigkill()
        rc_killed = run.proc.returncode  # type: ignore[union-attr]
        first = _read_launches(run.losses)[-1]
        killed_at = max(first.losses, default=0)
        epoch, batch = first.where.get(killed_at, (-1, -1))
        durable = _durable_resume_step(run_dir)  # what a restart must resume from, read after the kill
        later = [c for c in ckpts if c > (durable or 0)]
        between = durable is not None and killed_at > durable and killed_at not in ckpts
        where = "mid-epoch" if batch + 1 < t.steps_per_epoch else "at the end of the epoch"
        note(f"{cfg.trial_name}: SIGKILL -> pid {pid} (exit code {rc_killed}) after step {killed_at}, {where} "
             f"(epoch {epoch}, batch {batch + 1} of {t.steps_per_epoch}), between the recover checkpoints after steps "
             f"{durable} (durable) and {later[0] if later else '-'}" if between else
             f"{cfg.trial_name}: SIGKILL -> pid {pid} (exit code {rc_killed}) after step {killed_at}, {where}; the last "
             f"durable recover checkpoint is the one after step {durable}")
        if before_resume is not None:
            before_resume(work)
        # 2. the same command again: it must resume from that checkpoint and finish
        note(f"{cfg.trial_name}: starting the same command again")
        run.start()
        run.tail.last_step = 0  # until the restart records its first step
        while run.check() is None:
            ref.check()
            progress()
            time.sleep(0.05)
        while ref.check() is None:
            progress()
            time.sleep(0.05)
        launches = _read_launches(run.losses)
        second = launches[-1] if len(launches) >= 2 else _Launch()
        ref_launches = _read_launches(ref.losses)
        reference = ref_launches[-1].losses if ref_launches else {}
        resumed_from = second.resumed_after
        info = second.resumed_info or {}
        if resumed_from is None:
            note(f"{cfg.trial_name}: the restarted worker did NOT resume from a recover checkpoint (it started afresh)")
            resumed_from = 0
        else:
            note(f"{cfg.trial_name}: resumed from the recover checkpoint after step {resumed_from} "
                 f"(recover_info/step_info.json: epoch {info.get('epoch')}, epoch_step {info.get('epoch_step')}, "
                 f"global_step {info.get('global_step')}), trained steps {resumed_from + 1}-{killed_at} again, "
                 f"finished at step {second.ended_at}")
        cmp = compare_runs(reference, first.losses, second.losses, resumed_from, killed_at, total)
        say("")
        say("Per-step training loss, killed + resumed run vs the uninterrupted reference (compared as float bits):")
        _print_table(say, reference, first.losses, second.losses, resumed_from, killed_at, total)
        for lo, hi, label, equal, count in cmp["groups"]:
            say(f"  steps {lo:>4}-{hi:<4} {label}: {equal}/{count} bit-identical")
        # 3. the final HF exports of both trials, byte for byte
        run_exports = [p for _, p in layouts["run"].list_exports(MODEL_NAME)]
        ref_exports = [p for _, p in layouts["ref"].list_exports(MODEL_NAME)]
        exports_match: bool | None = None
        if run_exports or ref_exports:
            exports_match, nfiles = False, 0
            if [p.name for p in run_exports] == [p.name for p in ref_exports]:
                exports_match, nfiles = _same_files(run_exports[-1], ref_exports[-1])
            say(f"  final HF export {run_exports[-1].name if run_exports else '-'}: "
                + (f"{nfiles} files byte-identical to the reference's" if exports_match
                   else "DIFFERENT from the reference's (or other exports)"))
        checks = [
            (rc_killed == -signal.SIGKILL, f"the worker was not ended by SIGKILL (exit code {rc_killed})"),
            (second.resumed_after is not None and resumed_from == durable,
             f"the restart resumed after step {second.resumed_after}, but the durable recover checkpoint is the one "
             f"after step {durable}"),
            (resumed_from < killed_at, f"the kill (after step {killed_at}) came no later than the checkpoint "
                                       f"(after step {resumed_from})"),
            (second.ended_at == total, f"the resumed run ended at step {second.ended_at}, not {total}"),
            (cmp["match"], f"{len(cmp['differ'])} of {total} per-step losses differ from the uninterrupted run's "
                           f"(first at steps {cmp['differ'][:3]}), {len(cmp['missing'])} missing, "
                           f"{len(cmp['replay_differ'])} of the steps trained twice differ"),
            (exports_match is not False, "the final HF export differs from the reference's"),
        ]
        problems = [msg for good, msg in checks if not good]
        if not problems:
            verdict = (f"VERDICT: PASS - killed after step {killed_at}, resumed from the checkpoint after step "
                       f"{resumed_from}: all {total} per-step losses are bit-for-bit those of the uninterrupted run"
                       + (", and so is the final HF export" if exports_match else ""))
        else:
            verdict = "VERDICT: FAIL - " + "; ".join(problems)
        say(verdict)
        say("")
        ok = not problems
        return {
            "killed_at_step": killed_at, "killed_epoch": epoch, "killed_batch": batch,
            "killed_signal": -rc_killed if rc_killed is not None and rc_killed < 0 else None,
            "killed_between_checkpoints": between, "durable_checkpoint_step": durable,
            "resumed_from_step": second.resumed_after, "resumed_step_info": info,
            "losses_match": bool(cmp["match"]), "exports_match": exports_match,
            "verdict": verdict, "problems": problems, "global_step": second.ended_at or 0,
            "reference_trial_dir": str(ref_dir), "work_dir": str(work), "worker_command": run.command,
            "losses": {"before_kill": first.losses, "after_resume": second.losses, "reference": reference},
        }
    finally:
        for w in workers.values():
            w.sigkill()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            note(f"the workers' logs and losses are kept in {work}")
