"""``RecoverCallback``: crash-safe recover checkpoints and exact automatic resume.

The callback is the Lightning glue: each hook below hands over to the pipeline of
:class:`~areal_lightning.lightning.recover_session.RecoverSession` (setup, save, resume),
:class:`~areal_lightning.lightning.recover_state.RecoverState` (the callback state) and
:class:`~areal_lightning.trigger.SaveSchedule` (when to save, asked at the one save point after
each step, which the session places in Lightning's loop).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl

from areal_lightning.collective import DEFAULT_TIMEOUT_S, validate_timeout
from areal_lightning.commit.memory_tier import MemoryTier, tier_folder
from areal_lightning.commit.object_recover_store import ObjectRecoverStore
from areal_lightning.commit.recover_store import RecoverStore
from areal_lightning.config import (
    IO_MODES,
    ExperimentConfig,
    RecoverConfig,
    as_experiment,
    as_memory,
    check_async_executor,
    validate_model_name,
)
from areal_lightning.errors import ConfigError, UsageError
from areal_lightning.layout import CHECKPOINT_INFO, TrialLayout
from areal_lightning.lightning._internals import callback_state_key
from areal_lightning.lightning.bridge import warn_if_single_fsdp_unit
from areal_lightning.lightning.preemption import Preemption
from areal_lightning.lightning.recover_session import RecoverSession
from areal_lightning.lightning.recover_state import RecoverState
from areal_lightning.namespaces import bases
from areal_lightning.objectstore import is_remote
from areal_lightning.telemetry import Telemetry
from areal_lightning.trigger import FreqController, SaveSchedule, StepInfo
from areal_lightning.config import DEFAULT_PREEMPT_SIGNALS, parse_signals
from areal_lightning.trigger.preempt import PREEMPTED_EXIT_CODE, PreemptionWatch

__all__ = ["RecoverCallback", "StepInfo"]

log = logging.getLogger(__name__)


def _warn_torchrun_shared_store() -> None:
    """Under ``torchrun --max-restarts N``, torch 2.13's agent shares one TCPStore across
    restarts: restarted gloo workers can read their dead peers' addresses and fail
    (``Gloo connectFullMesh failed``) or hang. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` set
    for torchrun gives each restart a fresh store."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if (restarts.isdigit() and int(restarts) > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("RANK", "0") == "0"):
        log.warning("RecoverCallback: torchrun --max-restarts with a shared agent store: restarted gloo workers may "
                    "fail to connect (torch reuses the store across restarts). Start torchrun with "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that every restart resumes.")


class RecoverCallback(*bases("callbacks.Callback")):  # type: ignore[misc]
    """Save the full training state on triggers; resume from it automatically.

    With ``mode="on"``/``"auto"``, ``trainer.fit(model)`` without ``ckpt_path`` resumes
    from the last committed recover checkpoint of the trial (an explicit ``ckpt_path``
    wins), restoring model, optimizers, LR schedulers, loop progress, RNG states,
    the train dataloader's position (plain ``DataLoader`` too) and the other callbacks'
    and the logger's state, so the resumed run's losses equal an uninterrupted run's.
    ``"off"``/``"disabled"`` neither save nor resume.

    Recover checkpoints are DCP directories written through a :class:`DCPCheckpointIO` of
    their own (the Trainer's, when the user passed one as a plugin); every other checkpoint of
    the run (``ModelCheckpoint``, ``trainer.save_checkpoint``) keeps the format of the
    Trainer's CheckpointIO. One recover checkpoint is kept; the next is written beside it and
    swapped in atomically together with ``recover_info/``. A resume continues the user's
    logger versions, ``ModelCheckpoint`` folders and bookkeeping, and CSV rows where the
    checkpoint left them. Works under ``lightning.pytorch`` and ``pytorch_lightning`` alike,
    and from LightningCLI (``class_path: areal_lightning.RecoverCallback``).

    Args:
        fileroot: the root folder of all checkpoints (``{fileroot}/checkpoints/{user}/...``).
        experiment_name: the experiment's folder under ``fileroot``.
        trial_name: the trial's folder under the experiment: a rerun with the same names resumes.
        user: the user folder (``None``: the OS user).
        mode: ``on``, ``auto`` (both save and resume), ``off`` or ``disabled`` (neither).
        freq_epochs: save every N epochs (any enabled trigger fires a save).
        freq_steps: save every N optimizer steps.
        freq_secs: save when N seconds passed since the last save.
        retries: used by ``areal-lightning run`` (re-runs of a failed command).
        on_resume: ``fn(trainer, module, step_info)`` called once after a resume
            (also the LightningModule's ``on_resume(trainer, step_info)`` if defined).
        io_mode: ``auto``, ``sync`` or ``async``: how the recover checkpoints are written (when
            the user passed a ``DCPCheckpointIO`` plugin, its mode is used).
        async_executor: ``thread`` or ``process``: where async recover saves are written (see
            ``DCPCheckpointIO``; a user's own ``DCPCheckpointIO`` plugin keeps its own).
        name: the model folder holding ``recover_checkpoint/``.
        collective_timeout: seconds any checkpoint collective waits for the other ranks
            (setup checks, the agreement before each save, DCP's exchanges) before every
            rank raises; it must exceed the slowest rank's write time of one save.
        fast_forward: how a mid-epoch resume passes the batches of the epoch already trained
            on: ``"sampler"`` (default) draws and drops their indices without fetching a sample
            (an ``IterableDataset`` with ``state_dict``/``load_state_dict`` gets its state back;
            one without is replayed, and the log says how long that took), and gives the
            DataLoader workers (``num_workers > 0``) the random streams they had, so random
            augmentations continue exactly; ``"replay"`` fetches them through the dataset.
        preempt_signals: signals that mean "this run is being preempted" (default SIGTERM;
            also e.g. ``["SIGTERM", "SIGUSR1"]``; ``None`` or ``[]``: none). On one, the run
            finishes its optimizer step, every rank agrees on that step, writes a recover
            checkpoint of it, waits until it is durable and stops with ``preempt_exit_code``
            (raising :class:`~areal_lightning.trigger.preempt.Preempted`, a ``SystemExit``).
            Under ``SLURMEnvironment(auto_requeue=True)`` its requeue signal is handled so too,
            followed by ``scontrol requeue`` (instead of Lightning's save from inside the handler).
        preempt_exit_code: the exit code of a preempted run (default 75, ``EX_TEMPFAIL``).
        storage_options: options of the object-store file system when ``fileroot`` is an
            ``s3://`` / ``gs://`` / ``az://`` URI (e.g. ``{"endpoint_url": ...}``, ``{"profile":
            ...}``); credentials otherwise come from the provider's standard chain (``AWS_*``
            environment variables, profiles, instance roles). Never written to ``recover_info/``.
        weights_only: unpickle the checkpoint's non-tensor state as ``torch.load(...,
            weights_only=True)`` does (default). Hyper-parameters holding other objects are
            then refused with an explanation: allowlist their types with
            ``torch.serialization.add_safe_globals``, or pass ``False`` for trusted storage.
        memory: the node-local memory tier (``recover.memory``; off by default): ``True``, or a
            dict / :class:`~areal_lightning.config.MemoryConfig` of ``root`` (default a per-trial
            folder on ``/dev/shm``), ``freq_steps`` (default 1), ``slots`` (>= 2), ``replicas``.
            After every such step each rank copies its state into a slot on tmpfs and seals it
            in the background; a rerun resumes from the newest step every rank sealed when it
            is newer than the shared tier's checkpoint (``freq_*`` keep driving the shared tier).
        lock_lease_s: with an object-store ``fileroot``, the trial lock's lease (seconds, default
            60; ``recover.lock_lease_s``): a second run of the trial while this one is alive is
            refused within a third of it; a rerun after a crash waits at most this long.

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
        async_executor: str = "thread",
        name: str = "default",
        weights_only: bool = True,
        collective_timeout: float = DEFAULT_TIMEOUT_S,
        fast_forward: str = "sampler",
        preempt_signals: Any = DEFAULT_PREEMPT_SIGNALS,
        preempt_exit_code: int = PREEMPTED_EXIT_CODE,
        storage_options: dict[str, Any] | None = None,
        memory: Any = None,
        lock_lease_s: float = 60.0,
    ) -> None:
        exp = ExperimentConfig(
            fileroot=fileroot,  # type: ignore[arg-type]
            experiment_name=experiment_name,
            trial_name=trial_name,
            user=user,
            storage_options=storage_options,
            recover=RecoverConfig(mode=mode, freq_epochs=freq_epochs, freq_steps=freq_steps,
                                  freq_secs=freq_secs, retries=retries, preempt_signals=preempt_signals,  # type: ignore[arg-type]
                                  fast_forward=fast_forward, memory=as_memory(memory),
                                  lock_lease_s=lock_lease_s),
        ).validate()
        if io_mode not in IO_MODES:
            raise ConfigError("io_mode", f"unknown mode {io_mode!r}; allowed: {', '.join(IO_MODES)}")
        self.async_executor = check_async_executor(async_executor)
        if on_resume is not None and not callable(on_resume):
            raise ConfigError("on_resume", f"expected a callable fn(trainer, module, step_info), got {on_resume!r}")
        signals = parse_signals(exp.recover.preempt_signals)
        if isinstance(preempt_exit_code, bool) or not isinstance(preempt_exit_code, int) \
                or not 1 <= preempt_exit_code <= 255:
            raise ConfigError("preempt_exit_code", f"expected an integer from 1 to 255, got {preempt_exit_code!r}")
        if not isinstance(weights_only, bool):
            raise ConfigError("weights_only", f"expected True or False, got {weights_only!r}")
        self.config = exp.recover
        self.experiment = exp
        _warn_torchrun_shared_store()
        self.name = validate_model_name(name, "name")
        self.layout = TrialLayout(exp.fileroot if is_remote(exp.fileroot) else Path(exp.fileroot),
                                  exp.resolved_user, exp.experiment_name, exp.trial_name)
        self.storage_options = exp.storage_options or {}
        self.store = (ObjectRecoverStore(self.layout, self.name, self.storage_options, exp.recover.lock_lease_s)
                      if self.layout.remote
                      else RecoverStore(self.layout, self.name))
        self.io_mode = io_mode
        self.weights_only = weights_only
        self.collective_timeout = validate_timeout(collective_timeout)
        self.on_resume = on_resume
        self.freq = FreqController(self.config.freq_epochs, self.config.freq_steps, self.config.freq_secs)
        self.fast_forward = exp.recover.fast_forward
        self.preempt = PreemptionWatch(signals)
        self.schedule = SaveSchedule(self.freq, self.preempt)
        self.preempt_exit_code = preempt_exit_code
        self.preemption = Preemption(self.preempt, preempt_exit_code)
        self.state = RecoverState(self.freq, self.fast_forward)
        self.telemetry = Telemetry()
        self.resumed_from: StepInfo | None = None
        self._session: RecoverSession | None = None
        self._trainer: "pl.Trainer | None" = None

    @classmethod
    def from_config(cls, cfg: Any, strict: bool = True, **kwargs: Any) -> "RecoverCallback":
        """Build from a whole experiment config (YAML path, dict, dataclass or ``DictConfig``),
        using the top-level paths and the ``recover:`` section."""
        exp = as_experiment(cfg, strict)
        r = exp.recover
        return cls(fileroot=exp.fileroot, experiment_name=exp.experiment_name, trial_name=exp.trial_name,
                   user=exp.user, mode=r.mode, freq_epochs=r.freq_epochs, freq_steps=r.freq_steps,
                   freq_secs=r.freq_secs, retries=r.retries,
                   **{"preempt_signals": r.preempt_signals, "fast_forward": r.fast_forward,
                      "storage_options": exp.storage_options, "memory": r.memory,
                      "lock_lease_s": r.lock_lease_s, **kwargs})

    @property
    def enabled(self) -> bool:
        """True for modes ``on`` and ``auto``."""
        return self.config.enabled

    @property
    def checkpoint_io(self) -> Any:
        """The ``DCPCheckpointIO`` the recover checkpoints go through during ``fit`` (the Trainer's
        own when the user passed one, else the callback's); ``None`` outside ``fit``."""
        return self._session.io if self._session is not None else None

    @property
    def state_key(self) -> str:
        """Unique per recover model name."""
        return callback_state_key(self, name=self.name)

    # -- hooks -------------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Install the IO and the bridge, lock the trial, wire auto-resume (see RecoverSession.setup)."""
        if stage != "fit" or not self.enabled:
            return
        self._trainer = trainer
        self._session = RecoverSession(
            trainer, store=self.store, state=self.state, telemetry=self.telemetry, experiment=self.experiment,
            schedule=self.schedule, preemption=self.preemption, io_mode=self.io_mode,
            async_executor=self.async_executor, weights_only=self.weights_only,
            collective_timeout=self.collective_timeout, state_key=self.state_key, memory=self._memory_tier(trainer))
        self._session.setup()
        self.freq.start()

    def _memory_tier(self, trainer: "pl.Trainer") -> MemoryTier | None:
        memory = self.config.memory
        if not memory.enabled:
            return None
        folder = tier_folder(memory.root, self.layout.user, self.layout.experiment_name, self.layout.trial_name,
                             self.name)
        tier = MemoryTier(memory, folder, trainer.global_rank, trainer.num_devices, trainer.world_size,
                          self.collective_timeout)
        if memory.replicas and not tier.peers and trainer.is_global_zero:
            log.warning("RecoverCallback: recover.memory.replicas=%d needs 2 nodes or more (this run: %d rank(s), %d a "
                        "node): no peer copy is written", memory.replicas, trainer.world_size, trainer.num_devices)
        return tier

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.enabled:
            warn_if_single_fsdp_unit(trainer.strategy)  # the model is wrapped by now
        if self._session is not None:
            self._session.fit_started()  # before Lightning restores the optimizers

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.state.position.train_started(trainer)
        if self._session is not None:
            self._session.check_memory_space()
        if self.enabled:
            self.preemption.install(trainer)
        step = self._session.train_started(pl_module) if self._session is not None else None
        if step is None:
            return
        self.resumed_from = step
        if self.on_resume is not None:
            self.on_resume(trainer, pl_module, step)
        module_hook = getattr(pl_module, "on_resume", None)
        if callable(module_hook):
            module_hook(trainer, step)

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.state.position.epoch_started(trainer)

    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        self.state.restore_accumulation(trainer)

    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        """An async save may still copy the weights: wait before the optimizer changes them."""
        if self._session is not None:
            self._session.wait_for_staging()

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Report the saves done so far; the saves themselves are taken after every hook of the
        step has run (:class:`RecoverSession`'s save point)."""
        self.telemetry.flush(trainer)
        if self._session is not None:
            self._session.log_age(pl_module)

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.enabled and not trainer.sanity_checking:
            self.state.evaluator.validated(trainer)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.telemetry.flush(trainer)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A run that finished keeps a checkpoint of its end, so re-running it does nothing."""
        self.preemption.uninstall()
        if self.enabled and trainer.global_step > 0 and self.freq.last_fired_step != trainer.global_step \
                and self._session is not None:
            self._session.save_at_train_end()
        if self._session is not None:
            self._session.wait_all()
            self._session.finished()
        self.telemetry.flush(trainer)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        """Let the save in flight finish (its failure is logged, not raised over the original error)."""
        self.preemption.uninstall()
        if self._session is not None:
            try:
                self._session.wait()
            except BaseException as err:  # noqa: BLE001 - the original exception propagates
                log.error("RecoverCallback: the recover checkpoint in flight failed too: %s", err)
            self._session.close()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.preemption.uninstall()
        if self._session is not None:
            self._session.close()

    # -- Lightning state ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Trigger progress, epoch position; in recover saves also RNG and loader positions."""
        return self.state.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state.load_state_dict(state_dict, self._trainer.global_rank if self._trainer is not None else 0)
        if self._session is not None:
            self._session.state_loaded()

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict) -> None:
        """On a different world size, map the dataloader position (runs before ``load_state_dict``)."""
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if isinstance(state, dict):
            self.state.remap_world_size(state, checkpoint, trainer.world_size, trainer.global_rank)

    # -- actions -------------------------------------------------------------------------

    def save(self, trainer: "pl.Trainer") -> None:
        """Write a recover checkpoint of the current state now, from a hook or a callback during
        ``fit`` (the triggers save at the save point after each step by themselves); collective:
        every rank calls it."""
        if self._session is None:
            raise UsageError("RecoverCallback.save is for use during trainer.fit (from a hook or a callback), "
                             "where every rank calls it; it was called outside fit")
        self._session.save()

    def wait(self) -> None:
        """Return once the last recover checkpoint is durable and published; raise its failure."""
        if self._session is not None:
            self._session.wait()

    def last_checkpoint(self) -> Path | str | None:
        """The committed recover checkpoint of this trial (validated, read-only), or ``None``
        (a ``str`` URI on an object store)."""
        if not self.store.exists():
            return None
        info = self.store.read_info()
        self.store.verify(info[CHECKPOINT_INFO])
        return self.store.checkpoint_path()
