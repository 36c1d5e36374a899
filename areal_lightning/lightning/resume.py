"""Resume (Lightning): which recover checkpoint a start continues from, and the user's files.

* :func:`plan_resume` (rank 0): finish an interrupted swap, read and validate
  ``recover_info/``, check the run is the same one (experiment, trial, strategy family),
  check every file's presence and size and ``.metadata``'s checksum against the manifest
  (the data itself is verified by each rank as it loads it); the result is a :class:`ResumePlan` or ``None``
  (a fresh start). :func:`agreed_plan` gives every rank rank 0's plan, or its error.
* :func:`continue_user_files`: point each logger back at the version (W&B: the run) the
  checkpointed run logged into (Lightning made a new empty one before any callback ran), the
  ``ModelCheckpoint`` folders taken from it with them, and remove the checkpoint files written
  after the checkpoint; :func:`checkpoint_files` records which were there at each save.
* :func:`csv_snapshots` / :func:`restore_csv_logs`: a ``CSVLogger``'s ``metrics.csv`` as of
  each save, written back on resume (Lightning's CSV writer empties it at start).
"""

from __future__ import annotations

import logging
import os
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
from areal_lightning.lightning._internals import (
    can_redirect_logger,
    can_redirect_wandb,
    redirect_logger,
    redirect_wandb,
)
from areal_lightning.lightning.bridge import SHARDED_STRATEGY_NAMES, is_sharded
from areal_lightning.namespaces import classes

__all__ = ["ResumePlan", "plan_resume", "agreed_plan", "continue_user_files", "csv_snapshots", "restore_csv_logs",
           "checkpoint_files", "model_checkpoints", "strategy_family", "saved_keys"]

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
    checked_files: frozenset[str] = frozenset()
    """Data files of ``path`` whose every item was checked just before (a memory-tier slot's own
    files, by ``MemoryTier.choose``): the load does not hash them again."""
    loaded: Any = None
    """What a load of ``path`` returned already (``MemoryTier.choose`` read and checked it): the
    load that follows takes it instead of reading again."""


def strategy_family(strategy: Any) -> str:
    """``sharded`` (FSDP, ModelParallel: optimizer state keyed by parameter name) or
    ``replicated`` (single device, DDP: keyed by parameter index)."""
    return "sharded" if is_sharded(strategy) else "replicated"


NAMED_SINCE = "0.2.0"
"""The first version whose recover checkpoints key every optimizer's state by parameter name."""


def saved_keys(ckpt: dict[str, Any]) -> str:
    """How a recover checkpoint keys its optimizer states (``checkpoint_info.json``): ``names``
    or ``index`` (replicated strategies before the field was recorded)."""
    if "optimizer_keys" in ckpt:
        return str(ckpt["optimizer_keys"])
    return "names" if (ckpt.get("family") or _family_of_name(ckpt["strategy"])) == "sharded" else "index"


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
    path = store.info_file(CHECKPOINT_INFO)
    expected = {"experiment_name": experiment.experiment_name, "trial_name": experiment.trial_name}
    for key, value in expected.items():
        if ckpt[key] != value:
            raise RecoverMismatchError(
                f"{path} was written by {key}={ckpt[key]!r}, this run is {key}={value!r}: the trial folder "
                f"was copied or renamed. Use the original names, or {start_fresh()}.")
    strategy = type(trainer.strategy).__name__
    saved_family = ckpt.get("family") or _family_of_name(ckpt["strategy"])
    family = strategy_family(trainer.strategy)
    if saved_keys(ckpt) == "index" and family == "sharded":
        raise RecoverMismatchError(
            f"{path}: the recover checkpoint was written with strategy={ckpt['strategy']!r}, whose optimizer "
            f"states are keyed by position (written before areal_lightning {NAMED_SINCE}, or an optimizer "
            f"updates a parameter outside the LightningModule), but this run has strategy={strategy!r} "
            f"({family} parameters), which keys them by parameter name. Resume with a {saved_family} strategy "
            f"(one process or DDP), or {start_fresh()}.")
    if saved_family != family:
        log.warning("RecoverCallback: the recover checkpoint was written with %s (%s parameters), this run has %s "
                    "(%s parameters): model and optimizer states are loaded by parameter name", ckpt["strategy"],
                    saved_family, strategy, family)
    if ckpt["world_size"] != trainer.world_size:
        log.warning("RecoverCallback: resharding the recover checkpoint written by %d rank(s) (%s) onto %d rank(s) "
                    "(%s): DCP reshards model and optimizer; the dataloader position is mapped by samples consumed",
                    ckpt["world_size"], ckpt["strategy"], trainer.world_size, strategy)
    start = time.perf_counter()
    nbytes = store.verify(ckpt, data=None)  # presence, sizes, .metadata: each rank verifies what it loads
    return ResumePlan(store.checkpoint_path(), info, nbytes, time.perf_counter() - start)


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


def csv_snapshots(trainer: Any) -> dict[str, dict[str, Any]]:
    """Rank 0, in a recover save: each ``CSVLogger``'s ``metrics.csv`` as of now (its buffered
    rows flushed first), by logger index. Lightning's CSV writer deletes the file when a start
    opens the version folder, before any callback runs: the resume writes this text back."""
    snapshots: dict[str, dict[str, Any]] = {}
    if not trainer.is_global_zero:
        return snapshots
    for index, logger in enumerate(trainer.loggers):
        if not isinstance(logger, classes("loggers.CSVLogger")):
            continue
        logger.save()
        path = Path(logger.experiment.metrics_file_path)
        text = path.read_text() if path.is_file() else ""
        snapshots[str(index)] = {"text": text, "keys": list(logger.experiment.metrics_keys)}
    return snapshots


def restore_csv_logs(trainer: Any, snapshots: dict[str, dict[str, Any]]) -> None:
    """Rank 0, on a resume: write back each ``CSVLogger``'s rows up to the checkpoint (also
    under a version the user fixed); the steps after it log theirs again, once."""
    if not trainer.is_global_zero:
        return
    for index, snap in snapshots.items():
        i = int(index)
        if i >= len(trainer.loggers) or not isinstance(trainer.loggers[i], classes("loggers.CSVLogger")):
            continue
        writer = trainer.loggers[i].experiment  # (re)opened for the continued version
        path = Path(writer.metrics_file_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(snap["text"])
        writer.metrics_keys = list(snap["keys"]) + [k for k in writer.metrics_keys if k not in snap["keys"]]
        log.info("RecoverCallback: %s continues %s with its %d rows up to the checkpoint",
                 type(trainer.loggers[i]).__name__, path, max(0, snap["text"].count("\n") - 1))


def _checkpoint_dir_of_logger(trainer: Any) -> str | None:
    """Where a ``ModelCheckpoint`` without ``dirpath`` writes (Lightning's rule: the first
    logger's ``save_dir/name/version/checkpoints``)."""
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    save_dir = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return os.path.join(save_dir, str(logger.name), version, "checkpoints")  # as Lightning joins it


def model_checkpoints(trainer: Any) -> list[Any]:
    """The Trainer's ``ModelCheckpoint`` callbacks (either namespace) that have a folder."""
    return [cb for cb in trainer.callbacks
            if isinstance(cb, classes("callbacks.ModelCheckpoint")) and getattr(cb, "dirpath", None)]


def checkpoint_files(trainer: Any) -> dict[str, list[str]]:
    """The files in each ``ModelCheckpoint``'s folder now (recorded with a recover checkpoint:
    files that appear after it were written by steps a resume trains again)."""
    listed: dict[str, list[str]] = {}
    for cb in model_checkpoints(trainer):
        folder = os.path.normpath(str(cb.dirpath))
        try:
            listed[folder] = sorted(name for name in os.listdir(folder) if name.endswith(cb.FILE_EXTENSION))
        except OSError:  # not created yet (nothing saved): no file is from before the checkpoint
            listed[folder] = []
    return listed


def _config_files(trainer: Any) -> list[str]:
    """The config file names of LightningCLI's ``SaveConfigCallback`` (either namespace)."""
    return [cb.config_filename for cb in trainer.callbacks
            if isinstance(cb, classes("cli.SaveConfigCallback")) and getattr(cb, "save_to_log_dir", False)]


def _move_config(new_dir: Path, old_dir: Path, name: str, steps_done: int) -> None:
    """LightningCLI wrote this start's config into the new version folder: keep it in the
    continued one (the same config is kept once; a changed one beside the first)."""
    new, old = new_dir / name, old_dir / name
    if not new.is_file():
        return
    if not old.is_file():
        shutil.move(str(new), str(old))
    elif old.read_bytes() != new.read_bytes():
        beside = old.with_name(f"{old.stem}.resumed-step{steps_done}{old.suffix}")
        shutil.move(str(new), str(beside))
        log.warning("RecoverCallback: this start's config differs from the interrupted run's %s; kept as %s",
                    old, beside)


def _remove_later_checkpoints(saved: dict[str, list[str]], trainer: Any) -> None:
    """Files in a ``ModelCheckpoint`` folder that were not there at the recover checkpoint were
    written by the steps after it, which are trained again and write them again (left in
    place, Lightning would name the new ones ``-v1`` and never delete the old ones)."""
    for cb in model_checkpoints(trainer):
        folder = os.path.normpath(str(cb.dirpath))
        if folder not in saved or not os.path.isdir(folder):
            continue
        before = set(saved[folder])
        for name in sorted(os.listdir(folder)):
            if name.endswith(cb.FILE_EXTENSION) and name not in before:
                path = os.path.join(folder, name)
                (shutil.rmtree if os.path.isdir(path) and not os.path.islink(path) else os.remove)(path)
                log.info("RecoverCallback: removed %s, written after the recover checkpoint by a step that is "
                         "trained again", path)


def continue_user_files(trainer: Any, saved: dict[str, Any], steps_done: int) -> None:
    """Continue the user's logs and checkpoints where the checkpointed run left them.

    * Loggers: Lightning opens a new ``version_N`` before any callback's ``setup``; when that
      folder holds nothing of value yet (small event files, LightningCLI's config), the logger
      is redirected to the saved version and the new folder removed. A version that already
      holds data is left alone.
    * ``ModelCheckpoint``: a folder taken from the logger's version follows the redirect (so
      its top-k / last / best bookkeeping is restored with it); files written after the
      checkpoint are removed (the steps that wrote them are trained again).
    (``CSVLogger`` rows: :func:`restore_csv_logs`, once the callback state is loaded.)
    """
    before = trainer.strategy.broadcast(_checkpoint_dir_of_logger(trainer))  # as ModelCheckpoint resolved it
    for logger, entry in zip(trainer.loggers, saved.get("loggers", [])):
        if type(logger).__name__ != entry.get("class") or logger.name != entry.get("name"):
            continue
        if can_redirect_wandb(logger):
            if entry["version"] is not None and trainer.strategy.broadcast(logger.version) != entry["version"]:
                _continue_wandb_run(trainer, logger, entry["version"])
        elif can_redirect_logger(logger) and trainer.strategy.broadcast(logger.version) != entry["version"]:
            _redirect(trainer, logger, entry["version"], steps_done)
    after = trainer.strategy.broadcast(_checkpoint_dir_of_logger(trainer))
    if before is not None and after is not None and before != after:
        for cb in model_checkpoints(trainer):
            if os.path.normpath(str(cb.dirpath)) == os.path.normpath(before):
                cb.dirpath = after  # the string Lightning resolves (its saved dirpath is compared as such)
    if trainer.is_global_zero and "checkpoint_files" in saved:
        _remove_later_checkpoints(saved["checkpoint_files"], trainer)


def _continue_wandb_run(trainer: Any, logger: Any, run_id: str) -> None:
    """A ``WandbLogger``: continue the checkpointed run's id (``resume="allow"``) instead of the
    new run Lightning opened for this start, which is finished and, offline, its folder removed
    (it holds nothing yet). ``wandb sync`` of the offline folders of one id makes one run."""
    run = redirect_wandb(logger, run_id)
    folder = getattr(run, "dir", None) if run is not None else None
    offline = getattr(getattr(run, "settings", None), "mode", None) in ("offline", "dryrun")
    if trainer.is_global_zero and folder and offline:
        shutil.rmtree(Path(folder).parent, ignore_errors=True)  # offline-run-<time>-<new id>/
    log.info("RecoverCallback: %s continues the W&B run %s", type(logger).__name__, run_id)


def _redirect(trainer: Any, logger: Any, version: Any, steps_done: int) -> None:
    """Collective: rank 0 looks at the new version's folder and decides for every rank (the others
    must not read the folder that rank 0 removes, nor decide on a version of their own)."""
    new_dir = Path(logger.log_dir)
    configs = _config_files(trainer)
    held = False
    if trainer.is_global_zero:
        leftovers = [p for p in new_dir.rglob("*") if p.is_file()] if new_dir.is_dir() else []
        held = any(not (p.name.startswith("events.out.tfevents") and p.stat().st_size <= 1024)
                   and not (p.parent == new_dir and p.name in configs) for p in leftovers)
    if trainer.strategy.broadcast(held):
        return
    redirect_logger(logger, version)
    if trainer.is_global_zero:  # loggers write on rank 0 only (elsewhere their experiment is a dummy)
        old_dir = Path(logger.log_dir)
        for name in configs:
            _move_config(new_dir, old_dir, name, steps_done)
        if new_dir.is_dir():
            shutil.rmtree(new_dir, ignore_errors=True)
    log.info("RecoverCallback: %s continues logging into version %s", type(logger).__name__, version)
