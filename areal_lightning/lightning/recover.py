"""``RecoverCallback``: crash-safe recover checkpoints and exact automatic resume."""

from __future__ import annotations

import csv
import logging
import math
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from areal_lightning.capture.loader import (
    LoaderTracker,
    is_stateful_loader,
    remap_position,
)
from areal_lightning.capture.rng import capture_rng, restore_rng
from areal_lightning.collective import (
    DEFAULT_TIMEOUT_S,
    check_shared_storage,
    validate_timeout,
)
from areal_lightning.commit.recover_store import (
    FORMAT_VERSION,
    RecoverStore,
    TrialLock,
)
from areal_lightning.config import (
    ConfigError,
    ExperimentConfig,
    RecoverConfig,
    as_experiment,
    validate_model_name,
)
from areal_lightning.errors import CheckpointCorruptError, RecoverMismatchError
from areal_lightning.layout import TrialLayout
from areal_lightning.lightning.bridge import (
    SHARDED_STRATEGY_NAMES,
    install_bridge,
    is_sharded,
    warn_if_single_fsdp_unit,
)
from areal_lightning.lightning.checkpoint_io import DCPCheckpointIO, find_io
from areal_lightning.telemetry import SaveReport, Telemetry
from areal_lightning.trigger.freq import EpochPosition, FreqController

__all__ = ["RecoverCallback", "StepInfo"]

_NOT_RESUMABLE_WARNING = ".*your dataloader is not resumable.*"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInfo:
    """Where a checkpoint was taken: 0-based indices of the last completed optimizer step.

    Example:
        >>> StepInfo(epoch=0, epoch_step=99, global_step=99, steps_per_epoch=100).next()
        StepInfo(epoch=1, epoch_step=0, global_step=100, steps_per_epoch=100)
    """

    epoch: int
    epoch_step: int
    global_step: int
    steps_per_epoch: int | None

    def next(self) -> "StepInfo":
        """The step that training continues with."""
        end_of_epoch = self.steps_per_epoch is not None and self.epoch_step + 1 >= self.steps_per_epoch
        return StepInfo(
            epoch=self.epoch + 1 if end_of_epoch else self.epoch,
            epoch_step=0 if end_of_epoch else self.epoch_step + 1,
            global_step=self.global_step + 1,
            steps_per_epoch=self.steps_per_epoch,
        )

    @property
    def weight_version(self) -> int:
        """Version of the restored weights for an inference engine (``global_step + 1``)."""
        return self.global_step + 1


@dataclass
class _ResumePlan:
    path: Path
    info: dict[str, dict[str, Any]]
    verified_bytes: int
    verify_s: float


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


def _warn_torchrun_shared_store() -> None:
    """Under ``torchrun --max-restarts N``, torch 2.13's agent shares one TCPStore across
    restarts: restarted gloo workers can read their dead peers' addresses and fail
    (``Gloo connectFullMesh failed``) or hang. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` set
    for torchrun gives each restart a fresh store."""
    import os

    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if (restarts.isdigit() and int(restarts) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("RANK", "0") == "0"):
        log.warning("RecoverCallback: torchrun --max-restarts with a shared agent store: restarted gloo workers may "
                    "fail to connect (torch reuses the store across restarts). Start torchrun with "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that every restart resumes.")


def _family(strategy_name: str) -> str:
    """``sharded`` (FSDP, ModelParallel: optimizer state keyed by parameter name) or
    ``replicated`` (single device, DDP: keyed by parameter index)."""
    return "sharded" if strategy_name in SHARDED_STRATEGY_NAMES else "replicated"


def _parse_time(value: Any) -> float | None:
    import datetime as _dt

    try:
        return _dt.datetime.fromisoformat(value).timestamp()
    except (TypeError, ValueError):
        return None


def _versions() -> dict[str, str]:
    import lightning
    import transformers

    from areal_lightning import __version__

    return {"torch": torch.__version__, "lightning": lightning.__version__,
            "transformers": transformers.__version__, "areal_lightning": __version__}


class RecoverCallback(Callback):
    """Save the full training state on triggers; resume from it automatically.

    With ``mode="on"``/``"auto"``, ``trainer.fit(model)`` without ``ckpt_path`` resumes
    from the last committed recover checkpoint of the trial (an explicit ``ckpt_path``
    wins), restoring model, optimizers, LR schedulers, loop progress, RNG states,
    the train dataloader's position (plain ``DataLoader`` too) and the other callbacks'
    and the logger's state, so the resumed run's losses equal an uninterrupted run's.
    ``"off"``/``"disabled"`` neither save nor resume.

    Checkpoints are DCP directories written through :class:`DCPCheckpointIO` (installed
    when the Trainer has no CheckpointIO plugin). One is kept; the next is written beside
    it and swapped in atomically together with ``recover_info/``.

    Args:
        fileroot, experiment_name, trial_name, user: where the trial lives.
        mode: ``on``, ``auto``, ``off`` or ``disabled``.
        freq_epochs, freq_steps, freq_secs: triggers (any fires).
        retries: used by ``areal-lightning run`` (re-runs of a failed command).
        on_resume: ``fn(trainer, module, step_info)`` called once after a resume
            (also the LightningModule's ``on_resume(trainer, step_info)`` if defined).
        io_mode: mode of the installed ``DCPCheckpointIO`` (``auto``, ``sync``, ``async``).
        name: the model folder holding ``recover_checkpoint/``.
        collective_timeout: seconds any checkpoint collective waits for the other ranks
            (setup checks, the agreement before each save, DCP's exchanges) before every
            rank raises; it must exceed the slowest rank's write time of one save.
        weights_only: unpickle the checkpoint's non-tensor state as ``torch.load(...,
            weights_only=True)`` does (default). Hyper-parameters holding other objects are
            then refused with an explanation: allowlist their types with
            ``torch.serialization.add_safe_globals``, or pass ``False`` for trusted storage.

    Example:
        >>> recover = RecoverCallback(fileroot="/tmp/ckpt", experiment_name="exp", trial_name="t0",
        ...                           freq_steps=100)
        >>> trainer = pl.Trainer(callbacks=[recover])  # doctest: +SKIP
        >>> trainer.fit(model, loader)  # resumes automatically when run again  # doctest: +SKIP
    """

    def __init__(
        self,
        fileroot: str | Path,
        experiment_name: str,
        trial_name: str,
        user: str | None = None,
        mode: str = "on",
        freq_epochs: int | None = None,
        freq_steps: int | None = None,
        freq_secs: int | None = None,
        retries: int = 3,
        on_resume: Callable[["pl.Trainer", "pl.LightningModule", StepInfo], None] | None = None,
        io_mode: str = "auto",
        name: str = "default",
        weights_only: bool = True,
        collective_timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        exp = ExperimentConfig(
            fileroot=fileroot,  # type: ignore[arg-type]
            experiment_name=experiment_name,
            trial_name=trial_name,
            user=user,
            recover=RecoverConfig(mode=mode, freq_epochs=freq_epochs, freq_steps=freq_steps,
                                  freq_secs=freq_secs, retries=retries),
        ).validate()
        if io_mode not in ("auto", "sync", "async"):
            raise ConfigError("io_mode", f"unknown mode {io_mode!r}; allowed: auto, sync, async")
        if on_resume is not None and not callable(on_resume):
            raise ConfigError("on_resume", f"expected a callable fn(trainer, module, step_info), got {on_resume!r}")
        self.config = exp.recover
        self.experiment = exp
        _warn_torchrun_shared_store()
        self.name = validate_model_name(name, "name")
        self.layout = TrialLayout(Path(exp.fileroot), exp.resolved_user, exp.experiment_name, exp.trial_name)
        self.store = RecoverStore(self.layout, self.name)
        if not isinstance(weights_only, bool):
            raise ConfigError("weights_only", f"expected True or False, got {weights_only!r}")
        self.io_mode = io_mode
        self.weights_only = weights_only
        self.collective_timeout = validate_timeout(collective_timeout)
        self.on_resume = on_resume
        self.freq = FreqController(self.config.freq_epochs, self.config.freq_steps, self.config.freq_secs)
        self.tracker = LoaderTracker()
        self.resumed_from: StepInfo | None = None
        self._plan: _ResumePlan | None = None
        self._resuming = False
        self._pending_rng: dict[str, Any] | None = None
        self._remapped: dict[str, Any] | None = None  # loader positions mapped to another world size
        self._boundary_rng_applied = False
        self.position = EpochPosition()
        self._saving_at_boundary: bool | None = None
        self._io: DCPCheckpointIO | None = None
        self._lock: TrialLock | None = None
        self._last_seen_step = -1
        self.telemetry = Telemetry()
        self._last_durable: float | None = None  # wall clock of the last durable recover checkpoint
        self._held: dict[str, float] = {}
        self._trainer_ref: "pl.Trainer | None" = None
        self._patched: list[tuple[Any, str]] = []
        self._warning_filter: tuple | None = None

    @classmethod
    def from_config(cls, cfg: Any, strict: bool = True, **kwargs: Any) -> "RecoverCallback":
        """Build from a whole experiment config (YAML path, dict, dataclass or ``DictConfig``),
        using the top-level paths and the ``recover:`` section."""
        exp = as_experiment(cfg, strict)
        r = exp.recover
        return cls(fileroot=exp.fileroot, experiment_name=exp.experiment_name, trial_name=exp.trial_name,
                   user=exp.user, mode=r.mode, freq_epochs=r.freq_epochs, freq_steps=r.freq_steps,
                   freq_secs=r.freq_secs, retries=r.retries, **kwargs)

    @property
    def enabled(self) -> bool:
        """True for modes ``on`` and ``auto``."""
        return self.config.enabled

    @property
    def state_key(self) -> str:
        return self._generate_state_key(name=self.name)

    # -- setup: install the IO, plan the resume, wire the hooks ------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit" or not self.enabled:
            return
        self._io = self._install_io(trainer)
        install_bridge(trainer.strategy, self._io)  # every rank writes its shard; loads reshard
        self._io.engine.ranks.configure(self.collective_timeout)
        self._trainer_ref = trainer
        error: BaseException | None = None
        try:
            if trainer.is_global_zero:
                self._lock = TrialLock(self.layout.trial_dir)
                self._lock.acquire()
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
        self._io.engine.ranks.agree(error, "RecoverCallback setup (trial lock)")
        check_shared_storage(self._io.engine.ranks, self.layout.trial_dir, trainer.is_global_zero)
        # Run after the other callbacks at each hook, so their state at this step is saved.
        # (A new list: Lightning is iterating over the current one.)
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not self] + [self]
        self._wire(trainer)
        self.freq.start()

    def _install_io(self, trainer: "pl.Trainer") -> DCPCheckpointIO:
        io = find_io(trainer)
        if io is not None:
            return io
        current = trainer.strategy._checkpoint_io
        if current is not None and type(current) is not TorchCheckpointIO:
            raise TypeError(
                f"RecoverCallback saves through DCPCheckpointIO, but the Trainer uses {type(current).__name__}; "
                "pass plugins=[DCPCheckpointIO()] instead (or no CheckpointIO plugin and it is installed for you)"
            )
        io = DCPCheckpointIO(self.io_mode)
        trainer.strategy.checkpoint_io = io
        log.info("RecoverCallback: installed DCPCheckpointIO(mode=%r) as the Trainer's checkpoint_io", self.io_mode)
        return io

    def _wire(self, trainer: "pl.Trainer") -> None:
        """Hook Lightning where it resolves the checkpoint and builds the train dataloader.

        Lightning resolves ``ckpt_path`` before any callback hook runs, so auto-resume wraps
        the checkpoint connector's ``resume_start`` (called with the resolved path right
        after ``setup``); the train loaders are made resumable where Lightning requests them
        (``fit_loop._data_source.dataloader``). Both are Lightning internals, pinned by tests.
        """
        connector = trainer._checkpoint_connector
        source = trainer.fit_loop._data_source
        if not callable(getattr(connector, "resume_start", None)) or not callable(getattr(source, "dataloader", None)):
            raise RuntimeError(
                "RecoverCallback: this Lightning version does not have the internals auto-resume relies on "
                "(_checkpoint_connector.resume_start, fit_loop._data_source.dataloader); pass "
                "ckpt_path=recover_callback.last_checkpoint() to trainer.fit instead"
            )
        original_resume, original_loader = connector.resume_start, source.dataloader

        def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
            if checkpoint_path is not None:
                log.info("RecoverCallback: resuming from the explicit ckpt_path=%s", checkpoint_path)
                return original_resume(checkpoint_path, weights_only)
            self._plan = self._agreed_plan(trainer)
            if self._plan is None:
                return original_resume(None, weights_only)
            self._continue_logger_versions(trainer, self._plan.info["stats_logger_info.json"],
                                           self._plan.info["checkpoint_info.json"]["global_step"])
            self._resuming = True
            self._last_durable = _parse_time(self._plan.info["checkpoint_info.json"].get("commit_time"))
            # The non-tensor state is unpickled with weights_only=True unless the user opted out
            # (hyper-parameters holding arbitrary objects; see the README's security note).
            original_resume(str(self._plan.path), self.weights_only)
            loaded = connector._loaded_checkpoint.get("global_step")
            want = self._plan.info["checkpoint_info.json"]["global_step"]
            if loaded != want:
                raise CheckpointCorruptError(
                    f"{self._plan.path} holds global step {loaded}, but {self.store.info_dir} describes "
                    f"global step {want}; delete {self.store.info_dir} to start fresh")
            step = self._plan.info["step_info.json"]
            log.info("RecoverCallback: resuming from %s after global step %d (epoch %d, step %d in epoch); "
                     "checksums of %.1f MB verified in %.2fs", self._plan.path, step["global_step"], step["epoch"],
                     step["epoch_step"], self._plan.verified_bytes / 1e6, self._plan.verify_s)

        def dataloader() -> Any:
            loaders = original_loader()
            counter = iter(range(1 << 30))
            return apply_to_collection(loaders, DataLoader, lambda dl: self.tracker.track(dl, next(counter)))

        connector.resume_start = resume_start
        source.dataloader = dataloader
        self._patched = [(connector, "resume_start"), (source, "dataloader")]

    def _unwire(self) -> None:
        for obj, attr in self._patched:
            obj.__dict__.pop(attr, None)
        self._patched = []
        if self._warning_filter is not None and self._warning_filter in warnings.filters:
            warnings.filters.remove(self._warning_filter)
            getattr(warnings, "_filters_mutated", lambda: None)()  # invalidate CPython's warning caches
        self._warning_filter = None
        self.tracker.untrack()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _agreed_plan(self, trainer: "pl.Trainer") -> _ResumePlan | None:
        """Rank 0 repairs, validates and decides; every rank gets the same plan (or error)."""
        if trainer.world_size == 1:
            return self._plan_resume(trainer)
        outcome: tuple[str, Any] | None = None
        if trainer.is_global_zero:
            try:
                outcome = ("ok", self._plan_resume(trainer))
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below, as itself
                outcome = ("error", exc)
        outcome = self._io.engine.ranks.agree(None, "RecoverCallback resume plan", outcome)[0]
        if outcome[0] == "error":
            raise outcome[1]
        return outcome[1]

    def _plan_resume(self, trainer: "pl.Trainer") -> _ResumePlan | None:
        self.store.repair()
        if not self.store.exists():
            log.info("RecoverCallback: no %s; starting fresh", self.store.info_dir)
            return None
        info = self.store.read_info()
        ckpt = info["checkpoint_info.json"]
        path = self.store.info_dir / "checkpoint_info.json"
        expected = {"experiment_name": self.experiment.experiment_name, "trial_name": self.experiment.trial_name}
        for key, value in expected.items():
            if ckpt[key] != value:
                raise RecoverMismatchError(
                    f"{path} was written by {key}={ckpt[key]!r}, this run is {key}={value!r}: the trial folder "
                    "was copied or renamed. Use the original names, or delete recover_info/ to start fresh.")
        strategy = type(trainer.strategy).__name__
        saved_family = ckpt.get("family") or _family(ckpt["strategy"])
        family = "sharded" if is_sharded(trainer.strategy) else "replicated"
        if saved_family != family:
            raise RecoverMismatchError(
                f"{path}: the recover checkpoint was written with strategy={ckpt['strategy']!r} "
                f"({saved_family} parameters) but this run has strategy={strategy!r} "
                f"({family} parameters); their optimizer states are keyed differently. Resume with a "
                f"{saved_family} strategy, or delete recover_info/ to start fresh.")
        if ckpt["world_size"] != trainer.world_size:
            log.warning("RecoverCallback: resharding the recover checkpoint written by %d rank(s) (%s) onto %d rank(s) "
                        "(%s): DCP reshards model and optimizer; the dataloader position is mapped by samples consumed",
                        ckpt["world_size"], ckpt["strategy"], trainer.world_size, strategy)
        start = time.perf_counter()
        nbytes = self.store.verify(ckpt)
        return _ResumePlan(self.store.ckpt_dir, info, nbytes, time.perf_counter() - start)

    @staticmethod
    def _continue_logger_versions(trainer: "pl.Trainer", saved: dict[str, Any], steps_done: int) -> None:
        """Point each logger back at the version the checkpointed run logged into.

        Lightning creates the loggers' experiments (and a new ``version_N`` folder) before
        any callback's ``setup``; when that new folder holds nothing yet, the logger is
        redirected to the saved version and the empty folder removed. A version that
        already holds data (e.g. one the user fixed) is left alone.
        """
        for logger, entry in zip(trainer.loggers, saved.get("loggers", [])):
            if type(logger).__name__ != entry.get("class") or logger.name != entry.get("name"):
                continue
            if not hasattr(logger, "_version") or not hasattr(logger, "_experiment") or logger.version == entry["version"]:
                continue
            new_dir = Path(logger.log_dir)
            leftovers = [p for p in new_dir.rglob("*") if p.is_file()] if new_dir.is_dir() else []
            if any(not p.name.startswith("events.out.tfevents") or p.stat().st_size > 1024 for p in leftovers):
                continue
            close = getattr(logger._experiment, "close", None)
            if callable(close):
                close()
            logger._experiment = None
            logger._version = entry["version"]
            if new_dir.is_dir():
                shutil.rmtree(new_dir, ignore_errors=True)
            _keep_csv_rows(logger, steps_done)
            log.info("RecoverCallback: %s continues logging into version %s", type(logger).__name__, entry["version"])

    # -- triggers ----------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.position.epoch_started(trainer)

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        """An async save may still copy the weights: wait before the optimizer changes them."""
        if self._io is not None and self._io.engine.in_flight is not None:
            start = time.perf_counter()
            self._io.engine.wait_for_staging()
            self._held["staging_wait"] = self._held.get("staging_wait", 0.0) + time.perf_counter() - start

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.enabled or trainer.global_step == self._last_seen_step:
            return  # no optimizer step in this batch (gradient accumulation): nothing new to save
        self._last_seen_step = trainer.global_step
        decision = self.freq.check_step(trainer.global_step)
        if self.freq.uses_clock and trainer.world_size > 1:
            decision = bool(self._io.engine.ranks.agree(None, "seconds trigger", decision)[0])  # rank 0 decides
        if decision:
            self.save(trainer)
        self._log_telemetry(trainer, pl_module)

    def _log_telemetry(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.telemetry.flush(trainer)
        if self._last_durable is not None and trainer.loggers:
            pl_module.log("checkpoint/recover/age_s", time.time() - self._last_durable, on_step=True,
                          on_epoch=False, rank_zero_only=True)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.enabled and self.freq.check_epoch(trainer.current_epoch + 1, trainer.global_step):
            self.save(trainer)
        self.telemetry.flush(trainer)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A run that finished keeps a checkpoint of its end, so re-running it does nothing."""
        if self.enabled and trainer.global_step > 0 and self.freq.last_fired_step != trainer.global_step:
            self.save(trainer)
        if self._io is not None:
            self._io.engine.wait()
        self.telemetry.flush(trainer)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        """Let the save in flight finish (its failure is logged, not raised over the original error)."""
        if self._io is not None:
            try:
                self._io.engine.wait()
            except BaseException as err:  # noqa: BLE001 - the original exception propagates
                log.error("RecoverCallback: the recover checkpoint in flight failed too: %s", err)
        self._unwire()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._unwire()

    # -- saving ------------------------------------------------------------------------------

    def _batches_done(self, trainer: "pl.Trainer") -> int:
        return trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def _at_boundary(self, trainer: "pl.Trainer") -> bool:
        return self._batches_done(trainer) >= trainer.num_training_batches

    def _step_info(self, trainer: "pl.Trainer") -> StepInfo:
        steps = trainer.global_step
        n = trainer.num_training_batches
        per_epoch = math.ceil(n / trainer.accumulate_grad_batches) if n != float("inf") else None
        # The epoch of the last step (after the last epoch Lightning's counter has moved on).
        return StepInfo(epoch=self.position.epoch, epoch_step=self.position.epoch_step(steps),
                        global_step=steps - 1, steps_per_epoch=per_epoch)

    def save(self, trainer: "pl.Trainer") -> None:
        """Write a recover checkpoint of the current state now (also used by the triggers)."""
        if self._io is None:
            raise RuntimeError("RecoverCallback.save called outside trainer.fit")
        steps = trainer.global_step
        self.freq.mark_fired(steps)
        start = time.perf_counter()
        self._saving_at_boundary = self._at_boundary(trainer)
        try:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        finally:
            boundary, self._saving_at_boundary = self._saving_at_boundary, None
        info = self._build_info(trainer, checkpoint, boundary)
        engine = self._io.engine
        gen: str | None = None
        error: BaseException | None = None
        try:
            engine.wait()  # the previous save is durable and swapped in (or its failure raised here)
            if trainer.is_global_zero:
                self.store.clean_stale()
                gen = self.store.new_generation(steps)
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
        # Every rank writes its shard into the same directory (one collective DCP save); rank
        # 0 alone publishes it with recover_info once committed. A failure on any rank so far
        # stops every rank here.
        gen = engine.ranks.agree(error, f"recover checkpoint of global step {steps}", gen)[0]
        asynchronous = self._io.resolved_mode == "async"
        held = self._held = {"call": 0.0}

        def commit() -> None:
            files = self.store.commit(gen, info)
            self._last_durable = time.time()
            self.telemetry.record(SaveReport(
                "recover", steps, str(self.store.ckpt_dir), held["call"] + held.get("staging_wait", 0.0),
                time.perf_counter() - start, sum(f["size"] for f in files.values())))

        engine.save(checkpoint, self.store.tmp_ckpt_dir(gen), asynchronous=asynchronous,
                    on_commit=commit if trainer.is_global_zero else None)
        held["call"] = time.perf_counter() - start

    def _build_info(self, trainer: "pl.Trainer", checkpoint: dict[str, Any], boundary: bool) -> dict[str, dict]:
        from areal_lightning.lightning.hf_saver import HFSaverCallback

        loop = trainer.fit_loop.epoch_loop
        loaders = []
        combined = trainer.fit_loop._combined_loader
        for i, dl in enumerate(combined.flattened if combined is not None else []):
            cls = type(dl).__mro__[1] if type(dl).__dict__.get("_areal_resumable") else type(dl)
            loaders.append({"index": i, "class": cls.__name__, "stateful": is_stateful_loader(dl),
                            "num_workers": getattr(dl, "num_workers", None),
                            "batch_size": getattr(dl, "batch_size", None),
                            "sampler": type(getattr(dl, "sampler", None)).__name__})
        return {
            "step_info.json": {**asdict(self._step_info(trainer)),
                               "next": asdict(self._step_info(trainer).next())},
            "saver_info.json": {cb.state_key: cb.state_dict() for cb in trainer.callbacks
                                if isinstance(cb, HFSaverCallback)},
            "evaluator_info.json": {
                "val_check_interval": trainer.val_check_interval,
                "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
                "val_batches_completed_total": loop.val_loop.batch_progress.total.completed,
            },
            "stats_logger_info.json": {"loggers": [
                {"class": type(lg).__name__, "name": lg.name, "version": lg.version,
                 "save_dir": str(lg.save_dir) if lg.save_dir else None} for lg in trainer.loggers]},
            "dataloader_info.json": {"epoch": trainer.current_epoch, "batches_done": self._batches_done(trainer),
                                     "at_epoch_boundary": boundary, "loaders": loaders},
            "checkpoint_info.json": {
                "format_version": FORMAT_VERSION,
                "global_step": checkpoint["global_step"],
                "epoch": checkpoint["epoch"],
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
                "family": "sharded" if is_sharded(trainer.strategy) else "replicated",
                "num_devices": trainer.num_devices,
                "num_nodes": trainer.num_nodes,
                "accelerator": type(trainer.accelerator).__name__,
                "io_mode": self._io.resolved_mode if self._io else None,
                "experiment_name": self.experiment.experiment_name,
                "trial_name": self.experiment.trial_name,
                "user": self.layout.user,
                "versions": _versions(),
            },
        }

    # -- Lightning state ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Trigger progress, RNG states and the train loaders' position (no pickled objects)."""
        state: dict[str, Any] = {"freq": self.freq.state_dict(), **self.position.state_dict()}
        boundary = self._saving_at_boundary
        if boundary is not None:  # only our own saves carry RNG and data position
            trainer = self._trainer_ref
            state["rng"] = capture_rng()
            fetcher = trainer.fit_loop._data_fetcher
            prefetched = len(getattr(fetcher, "batches", ()))
            state["data"] = self.tracker.state_dict(self._batches_done(trainer), boundary, prefetched)
            if not boundary:
                # Each stateful loader's own state, as Lightning saves it (CombinedLoader._state_dicts),
                # kept here too: Lightning drops it when configure_optimizers built the loader early (#20550).
                combined = trainer.fit_loop._combined_loader
                for i, dl in enumerate(combined.flattened if combined is not None else []):
                    entry = state["data"]["loaders"].get(str(i))
                    if entry is not None and entry["stateful"]:
                        entry["loader_state"] = dl.state_dict()
            if trainer.world_size > 1:
                # RNG and loader position differ per rank; Lightning saves rank 0's callback
                # state only, so every rank's is gathered into it (all ranks are in save()).
                mine = {"rng": state.pop("rng"), "data": state.pop("data")}
                gathered = self._io.engine.ranks.agree(None, "per-rank RNG and data position", mine)
                state["per_rank"] = {str(rank): entry for rank, entry in enumerate(gathered)}
        return state

    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict) -> None:
        if self._saving_at_boundary is None:
            return
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if "combined_loader" in fit_state:
            # The tracker restores every train loader itself, each rank its own (Lightning keeps
            # rank 0's loader states only). At an epoch boundary a stateful loader's state would
            # even skip the next epoch (Lightning restores it as "exhausted").
            fit_state["combined_loader"] = []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.freq.load_state_dict(state_dict.get("freq", {}))
        self.position.load_state_dict(state_dict)
        state_dict = self._own_rank_state(state_dict)
        if "rng" in state_dict:  # a checkpoint written by RecoverCallback.save (auto-resumed or explicit)
            data, self._remapped = self._remapped or state_dict["data"], None
            self._pending_rng = state_dict["rng"]
            self._boundary_rng_applied = bool(data["at_boundary"])
            self.tracker.load_state_dict(data, checkpoint_rng=state_dict["rng"]["torch"])

    def _own_rank_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's RNG and loader state out of a saved callback state; on another world
        size (resharding) rank r continues from saved rank r mod W."""
        per_rank = state.get("per_rank")
        if per_rank is None:
            return state
        rank = self._trainer_ref.global_rank if self._trainer_ref is not None else 0
        return {**state, **per_rank[str(rank % len(per_rank))]}

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict) -> None:
        """On a different world size, map the dataloader position by samples consumed and make
        Lightning's batch counters of the epoch agree with it (runs before ``load_state_dict``)."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if not isinstance(state, dict):
            return
        per_rank = state.get("per_rank")
        old_world = len(per_rank) if per_rank is not None else 1
        mine = self._own_rank_state(state)
        if old_world == trainer.world_size or "data" not in mine:
            return
        try:
            data = remap_position(mine["data"], old_world, trainer.world_size)
        except ValueError as exc:
            raise RecoverMismatchError(f"resharding from {old_world} to {trainer.world_size} ranks: {exc}") from None
        self._remapped = data
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {}).get("current")
        if not data["at_boundary"] and progress:
            done = max((int(entry["batches_done"]) for entry in data["loaders"].values()),
                       default=progress["processed"])
            shift = done - progress["processed"]
            for key in ("ready", "started", "processed", "completed"):
                progress[key] += shift

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.enabled:
            warn_if_single_fsdp_unit(trainer.strategy)  # the model is wrapped by now

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.position.train_started(trainer)
        rng, self._pending_rng = self._pending_rng, None
        if rng is None:
            return
        combined = trainer.fit_loop._combined_loader
        if combined is not None and all(isinstance(dl, DataLoader) for dl in combined.flattened):
            # Every train loader is resumed by the tracker: Lightning's mid-epoch warning that a
            # plain DataLoader "is not resumable" does not apply to this run.
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE_WARNING)
            self._warning_filter = warnings.filters[0]
        if self._boundary_rng_applied and self.tracker.replayed:
            # The next epoch's iterator was created from the saved torch RNG state already.
            rng = {**rng, "torch": torch.get_rng_state()}
        restore_rng(rng)
        if self._plan is not None and self._resuming:
            step = StepInfo(**{k: v for k, v in self._plan.info["step_info.json"].items() if k != "next"})
        else:
            now = self._step_info(trainer)
            step = StepInfo(now.epoch, now.epoch_step, trainer.global_step - 1, now.steps_per_epoch)
        self._resuming = False
        self.resumed_from = step
        log.info(
            "RecoverCallback: resumed from %s after global step %d (epoch %d, step %d in epoch); restored model, "
            "%d optimizer(s), %d LR scheduler(s), loop progress, RNG, dataloader position (%s), callback states",
            trainer.ckpt_path, step.global_step, step.epoch, step.epoch_step, len(trainer.optimizers),
            len(trainer.lr_scheduler_configs), "; ".join(self.tracker.replayed) or "restored by the loader itself")
        if self.on_resume is not None:
            self.on_resume(trainer, pl_module, step)
        module_hook = getattr(pl_module, "on_resume", None)
        if callable(module_hook):
            module_hook(trainer, step)

    # -- helpers for users -----------------------------------------------------------------

    def last_checkpoint(self) -> Path | None:
        """The committed recover checkpoint of this trial (validated, read-only), or ``None``."""
        if not self.store.exists():
            return None
        info = self.store.read_info()
        self.store.verify(info["checkpoint_info.json"])
        return self.store.ckpt_dir
