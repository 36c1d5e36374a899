"""Resume (Lightning): which recover checkpoint a start continues from, and the loggers' versions.

* :func:`plan_resume` (rank 0): finish an interrupted swap, read and validate
  ``recover_info/``, check the run is the same one (experiment, trial, strategy family),
  check every file's presence and size and ``.metadata``'s checksum against the manifest
  (the data itself is verified by each rank as it loads it); the result is a :class:`ResumePlan` or ``None``
  (a fresh start). :func:`agreed_plan` gives every rank rank 0's plan, or its error.
* :func:`continue_logger_versions`: point each logger back at the version the checkpointed
  run logged into (Lightning made a new empty one before any callback ran).
"""

from __future__ import annotations

import csv
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_lightning.collective import CheckpointGroup
from areal_lightning.commit.recover_store import RecoverStore
from areal_lightning.config import ExperimentConfig
from areal_lightning.errors import RecoverMismatchError, start_fresh
from areal_lightning.layout import CHECKPOINT_INFO
from areal_lightning.lightning._internals import can_redirect_logger, redirect_logger
from areal_lightning.lightning.bridge import SHARDED_STRATEGY_NAMES, is_sharded

__all__ = ["ResumePlan", "plan_resume", "agreed_plan", "continue_logger_versions", "strategy_family"]

log = logging.getLogger(__name__)


@dataclass
class ResumePlan:
    """The recover checkpoint a start continues from (validated and verified)."""

    path: Path
    info: dict[str, dict[str, Any]]
    checked_bytes: int
    """Bytes rank 0 read to check the files before loading (``.metadata``; all of a
    checkpoint of an earlier version, whose items carry no checksums)."""
    check_s: float


def strategy_family(strategy: Any) -> str:
    """``sharded`` (FSDP, ModelParallel: optimizer state keyed by parameter name) or
    ``replicated`` (single device, DDP: keyed by parameter index)."""
    return "sharded" if is_sharded(strategy) else "replicated"


def _family_of_name(strategy_name: str) -> str:
    """The family of a strategy class name (checkpoints written before ``family`` was recorded)."""
    return "sharded" if strategy_name in SHARDED_STRATEGY_NAMES else "replicated"


def plan_resume(store: RecoverStore, experiment: ExperimentConfig, trainer: Any) -> ResumePlan | None:
    """Repair, validate and verify the trial's recover checkpoint (rank 0); ``None``: start fresh."""
    store.repair()
    if not store.exists():
        log.info("RecoverCallback: no %s; starting fresh", store.info_dir)
        return None
    info = store.read_info()
    ckpt = info[CHECKPOINT_INFO]
    path = store.info_dir / CHECKPOINT_INFO
    expected = {"experiment_name": experiment.experiment_name, "trial_name": experiment.trial_name}
    for key, value in expected.items():
        if ckpt[key] != value:
            raise RecoverMismatchError(
                f"{path} was written by {key}={ckpt[key]!r}, this run is {key}={value!r}: the trial folder "
                f"was copied or renamed. Use the original names, or {start_fresh()}.")
    strategy = type(trainer.strategy).__name__
    saved_family = ckpt.get("family") or _family_of_name(ckpt["strategy"])
    family = strategy_family(trainer.strategy)
    if saved_family != family:
        raise RecoverMismatchError(
            f"{path}: the recover checkpoint was written with strategy={ckpt['strategy']!r} "
            f"({saved_family} parameters) but this run has strategy={strategy!r} "
            f"({family} parameters); their optimizer states are keyed differently. Resume with a "
            f"{saved_family} strategy, or {start_fresh()}.")
    if ckpt["world_size"] != trainer.world_size:
        log.warning("RecoverCallback: resharding the recover checkpoint written by %d rank(s) (%s) onto %d rank(s) "
                    "(%s): DCP reshards model and optimizer; the dataloader position is mapped by samples consumed",
                    ckpt["world_size"], ckpt["strategy"], trainer.world_size, strategy)
    start = time.perf_counter()
    nbytes = store.verify(ckpt, data=None)  # presence, sizes, .metadata: each rank verifies what it loads
    return ResumePlan(store.ckpt_dir, info, nbytes, time.perf_counter() - start)


def agreed_plan(store: RecoverStore, experiment: ExperimentConfig, trainer: Any,
                ranks: CheckpointGroup) -> ResumePlan | None:
    """Rank 0 repairs, validates and decides; every rank gets the same plan (or error)."""
    if trainer.world_size == 1:
        return plan_resume(store, experiment, trainer)
    outcome: tuple[str, Any] | None = None
    if trainer.is_global_zero:
        try:
            outcome = ("ok", plan_resume(store, experiment, trainer))
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below, as itself
            outcome = ("error", exc)
    outcome = ranks.agree(None, "RecoverCallback resume plan", outcome)[0]
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1]


def _keep_csv_rows(logger: Any, steps_done: int) -> None:
    """A CSVLogger's writer deletes ``metrics.csv`` when it opens a version folder: keep the
    rows the interrupted run flushed up to the checkpoint (later steps are trained again)."""
    from lightning.pytorch.loggers import CSVLogger

    if not isinstance(logger, CSVLogger):
        return
    path = Path(logger.log_dir) / "metrics.csv"
    if not path.is_file():
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        keys = list(reader.fieldnames or [])
        rows = []
        for row in reader:
            try:
                if int(float(row.get("step") or 0)) >= steps_done:
                    continue
            except ValueError:
                pass
            rows.append({k: v for k, v in row.items() if v not in ("", None)})  # the text as written
    writer = logger.experiment  # creating it removes the file; its rows are written back on save
    writer.metrics = rows + writer.metrics
    writer.metrics_keys = keys + [k for k in writer.metrics_keys if k not in keys]


def continue_logger_versions(trainer: Any, saved: dict[str, Any], steps_done: int) -> None:
    """Point each logger back at the version the checkpointed run logged into.

    Lightning creates the loggers' experiments (and a new ``version_N`` folder) before
    any callback's ``setup``; when that new folder holds nothing yet, the logger is
    redirected to the saved version and the empty folder removed. A version that
    already holds data (e.g. one the user fixed) is left alone.
    """
    for logger, entry in zip(trainer.loggers, saved.get("loggers", [])):
        if type(logger).__name__ != entry.get("class") or logger.name != entry.get("name"):
            continue
        if not can_redirect_logger(logger) or logger.version == entry["version"]:
            continue
        new_dir = Path(logger.log_dir)
        leftovers = [p for p in new_dir.rglob("*") if p.is_file()] if new_dir.is_dir() else []
        if any(not p.name.startswith("events.out.tfevents") or p.stat().st_size > 1024 for p in leftovers):
            continue
        redirect_logger(logger, entry["version"])
        if not trainer.is_global_zero:
            continue  # loggers write on rank 0 only (elsewhere their experiment is a dummy)
        if new_dir.is_dir():
            shutil.rmtree(new_dir, ignore_errors=True)
        _keep_csv_rows(logger, steps_done)
        log.info("RecoverCallback: %s continues logging into version %s", type(logger).__name__, entry["version"])
