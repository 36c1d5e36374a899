"""``run_demo``: the demo job on its defaults or a config, with or without the kill demonstration."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence


from areal_lightning.config import (
    load_config,
)
from areal_lightning.layout import TrialLayout

if TYPE_CHECKING:
    pass
from areal_lightning.tools.demo.config import DemoConfig, DemoMismatchError, MODEL_NAME
from areal_lightning.tools.demo.kill import _run_killed_and_reference
from areal_lightning.tools.demo.model import generate
from areal_lightning.tools.demo.train import _fit


def run_demo(config: Any = None, overrides: Sequence[str] = (), *, check: bool = True, echo: bool = True,
             before_resume: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Train the demo model with the callbacks of ``config``; return a summary dict.

    ``config`` is a YAML path, dict, ``DemoConfig`` or ``None`` (built-in defaults);
    ``overrides`` are dotlist entries (``train.max_epochs=1``).

    With ``kill.enabled`` the demo trains in worker processes: an uninterrupted reference
    (trial ``{trial_name}-reference``) and, side by side, the trial ``{trial_name}``, whose
    worker is SIGKILLed after ``kill.at_step`` and started again with the same command. It
    prints the per-step losses of both and a verdict; the summary then also holds
    ``killed_at_step``, ``resumed_from_step`` (steps in the recover checkpoint the restart
    resumed from), ``losses_match`` and ``exports_match`` (bools), ``verdict``, ``losses``
    (``{"before_kill", "after_resume", "reference"}``: ``{step: float.hex()}``). Both trials
    start fresh (a previous demo's folders are removed). With ``kill.enabled: false`` it trains
    once in this process (``killed_at_step`` etc. are ``None``; a rerun resumes).

    Args:
        check: raise :class:`DemoMismatchError` (after printing the verdict) when the resumed
            run differs from the reference; ``False`` returns the summary (``problems`` lists
            what differs). A worker that fails or stalls raises it either way.
        echo: print the demonstration (the CLI prints the rest of the summary).
        before_resume: called with the workers' folder after the kill, before the restart
            (tests use it to make the restart differ and see the verdict fail).
    """
    # Overrides apply on top of the demo's defaults (a section built from a partial mapping
    # would otherwise start from the generic SaverConfig / RecoverConfig defaults).
    cfg: DemoConfig = load_config(DemoConfig() if config is None else config, overrides, schema=DemoConfig)
    t = cfg.train

    def say(line: str = "") -> None:
        if echo:
            print(line, flush=True)

    summary: dict[str, Any] = {"killed_at_step": None, "resumed_from_step": None, "losses_match": None,
                               "exports_match": None}
    if cfg.kill.enabled:
        summary.update(_run_killed_and_reference(cfg, say, before_resume))
    else:
        trainer, _ = _fit(cfg)
        summary["global_step"] = trainer.global_step
    if check and summary.get("problems"):
        raise DemoMismatchError(f"{summary['verdict']} (logs and losses: {summary['work_dir']})")
    summary.update({"exports": [], "generations": []})
    layout = TrialLayout(Path(cfg.fileroot), cfg.resolved_user, cfg.experiment_name, cfg.trial_name)
    if cfg.saver.enabled:
        summary["trial_dir"] = str(layout.trial_dir)
        summary["exports"] = [str(p) for _, p in layout.list_exports(MODEL_NAME)]
        if summary["exports"] and t.num_generations:
            rng = random.Random(t.seed + 1)
            pairs = [(rng.randrange(t.max_operand), rng.randrange(t.max_operand)) for _ in range(t.num_generations)]
            prompts = [f"{a}+{b}=" for a, b in pairs]
            summary["generations"] = list(zip(prompts, generate(Path(summary["exports"][-1]), prompts)))
            summary["expected"] = [str(a + b) for a, b in pairs]
    return summary
