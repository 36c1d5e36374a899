"""The cases of a certification: the uninterrupted references, then each fault point's kill and
rerun, compared with the reference (losses bit for bit, resume step, leftovers, exports)."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from areal_lightning._fault import ENV_VAR as FAULT_ENV
from areal_lightning._fault import TRACE_ENV_VAR
from areal_lightning.tools.losses import ENV_LOSSES, read_losses  # re-exported
from areal_lightning.layout import (
    RECOVER_INFO,
    STEP_INFO,
)
from areal_lightning.tools.certify.disk import (
    check_exports,
    expected_memory_resume,
    expected_resume,
    find_trials,
    leftovers,
)
from areal_lightning.tools.certify.process import _trace_counts, run_group
from areal_lightning.tools.certify.protocol import END_CHECK, ENV_MODE, ENV_ROOT, _RESUMED


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
                    twice = [rank for rank, _ in set(recorded) & seen]  # the rank of each (rank, step) trained again
                    replayed = max((twice.count(rank) for rank in set(twice)), default=0)  # steps, on the worst rank
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
                shared = expected_resume(main) if main.is_dir() else None
                memory = expected_memory_resume(root)  # a memory tier kept below the run's root
                case.expected_resume = memory if memory is not None and (shared is None or memory >= shared) \
                    else shared
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
