"""The recover checkpoint pipeline of one ``trainer.fit``, behind ``RecoverCallback``'s hooks.

:class:`RecoverSession` owns what lives for one fit: the installed ``DCPCheckpointIO`` and
strategy bridge, the trial lock, the resume wiring, the telemetry.

* **setup**: install the IO and the bridge; every rank agrees the trial lock was taken and
  the fileroot is shared; auto-resume is wired where Lightning resolves the checkpoint
  (:mod:`areal_lightning.lightning._internals`).
* **save** (:meth:`RecoverSession.save`, one function: trigger -> capture -> stage/write ->
  commit): wait for the previous save to be durable; rank 0 cleans leftovers and names the
  generation, which every rank agrees on; the ``recover_info`` is described
  (:func:`~areal_lightning.lightning.recover_state.describe`); Lightning's ``dump_checkpoint``
  collects every state, then :meth:`RecoverState.capture` adds RNG and loader positions (every
  rank's, gathered) and :meth:`RecoverState.canonical` gives the canonical form;
  ``DCPCheckpointIO.write`` gets the store's commit target as an argument: DCP writes every
  rank's shard, and after DCP's save returned (in the background for async saves) rank 0 runs
  the target's ``finalize``: ``recover_info`` and the swap
  (:mod:`areal_lightning.commit.recover_store`). With the memory tier
  (:mod:`areal_lightning.commit.memory_tier`), each rank's slot of the collected checkpoint is
  written at every memory step, and a shared save of such a step is copied from the slots.
* **resume**: the plan of :mod:`areal_lightning.lightning.resume`, or the memory tier's newest
  step every rank can restore when it is not older, loaded through Lightning's own
  ``resume_start`` (the IO's ``load_checkpoint``), then RNG and loaders at train start.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader

from areal_lightning._torch_internals import remove_warning_filter
from areal_lightning.capture.compiled import live_names
from areal_lightning.capture.optimizer_names import by_index, parameter_names
from areal_lightning.commit.generations import resolve
from areal_lightning.commit.memory_tier import MemoryTier, local_nbytes
from areal_lightning.commit.recover_store import RecoverStorage
from areal_lightning.errors import CheckpointCorruptError, ConfigError, RecoverMismatchError, start_fresh
from areal_lightning.layout import CHECKPOINT_INFO, COMMIT_MARKER, DATALOADER_INFO, STATS_LOGGER_INFO, STEP_INFO
from areal_lightning.lightning._internals import (
    Patch,
    continue_after_save_point,
    continue_train_epoch_metrics,
    dump_checkpoint,
    epoch_loop_ends,
    loaded_checkpoint,
    set_ddp_forward_sync,
    train_loaders,
    wrap_ddp_setup_model,
    wrap_epoch_end,
    wrap_resume_start,
    wrap_step_end,
    wrap_train_dataloader,
)
from areal_lightning.lightning.bridge import bridged, install_bridge, is_sharded
from areal_lightning.lightning.builtin_resume import resume_swa, started_swa
from areal_lightning.lightning.checkpoint_io import DCPCheckpointIO, attach_recover_io, find_io
from areal_lightning.lightning.recover_state import (
    PendingResume,
    RecoverState,
    at_epoch_boundary,
    describe,
    hf_models_of,
    step_info,
)
from areal_lightning.objectstore import is_remote
from areal_lightning.lightning.resume import (
    ResumePlan,
    agreed_plan,
    continue_user_files,
    restore_csv_logs,
)
from areal_lightning.telemetry import SaveTimer, Telemetry
from areal_lightning.trigger import StepInfo
from areal_lightning.lightning.preemption import Preemption
from areal_lightning.trigger.schedule import Save, SavePoint, SaveSchedule
from areal_lightning.write.dcp_format import weights_only_refusal

__all__ = ["RecoverSession"]

log = logging.getLogger(__name__)

_NOT_RESUMABLE_WARNING = ".*your dataloader is not resumable.*"


def _parse_time(value: Any) -> float | None:
    try:
        return _dt.datetime.fromisoformat(value).timestamp()
    except (TypeError, ValueError):
        return None


def _is_dcp_dir(path: Any, storage_options: Any = None) -> bool:
    """A DCP checkpoint directory (a recover checkpoint, or a copy of one): it has ``.metadata``
    (on an object store: it, or its newest committed generation, has one)."""
    if is_remote(path):
        try:
            resolve(path, storage_options)
        except (FileNotFoundError, OSError):
            return False
        return True
    try:
        return (Path(path) / COMMIT_MARKER).is_file()
    except (TypeError, OSError):
        return False


def recover_io(trainer: Any, io_mode: str, storage_options: Any = None,
               async_executor: str = "thread") -> tuple[DCPCheckpointIO, bool]:
    """The ``DCPCheckpointIO`` the recover checkpoints go through, and whether it is the
    Trainer's own: the user passed ``plugins=[DCPCheckpointIO()]`` (their checkpoints are DCP
    too, and the strategy is bridged for the whole run); otherwise a private one, used only
    for the recover checkpoints, while every other checkpoint of the run keeps the format of
    the user's CheckpointIO (Lightning's single file by default)."""
    io = find_io(trainer)
    if io is not None:
        if storage_options and not io.engine.storage_options:
            io.engine.storage_options = dict(storage_options)
        return io, True
    return DCPCheckpointIO(io_mode, storage_options=storage_options, async_executor=async_executor), False


class RecoverSession:
    """One fit's recover pipeline (see the module doc); made by ``RecoverCallback.setup``.

    The session owns when to save: at the save point after each optimizer step (after every
    hook of the step, and at an epoch's last step after the epoch's end too) it asks
    ``schedule``, then calls :meth:`save` and, for a preemption, once the save is durable on
    every rank, ``preemption.stop`` (which raises).
    """

    def __init__(self, trainer: Any, *, store: RecoverStorage, state: RecoverState, telemetry: Telemetry,
                 experiment: Any, schedule: SaveSchedule, preemption: Preemption, io_mode: str, async_executor: str,
                 weights_only: bool, collective_timeout: float, state_key: str,
                 memory: MemoryTier | None = None) -> None:
        self.trainer = trainer
        self.store = store
        self.state = state
        self.telemetry = telemetry
        self.experiment = experiment
        self.schedule = schedule
        self.weights_only = weights_only
        self.collective_timeout = collective_timeout
        self.preemption = preemption
        self.state_key = state_key  # the callback's key in the checkpoint's "callbacks"
        self.memory = memory  # the node-local memory tier (None: off)
        self.io, self._trainer_io = recover_io(trainer, io_mode, store.storage_options,
                                               async_executor)
        self.last_durable: float | None = None  # wall clock of the last durable recover checkpoint
        self.shared_step: int | None = None  # global step of the newest shared save started or resumed from
        self._timer: SaveTimer | None = None  # the timing of the last save
        self._step_hooks: dict[int, Any] = {}  # optimizer id -> its step pre-hook waiting for the memory tier
        self._patch = Patch()
        self._checked_loadable = False
        self._waiter = False
        self._warning_filter: tuple | None = None
        self._io_closed = False

    @property
    def ranks(self) -> Any:
        """The checkpoint collectives' gloo groups (those of the IO's engine)."""
        return self.io.engine.ranks

    # -- setup / teardown ------------------------------------------------------------------

    def setup(self) -> None:
        """Install the bridge, take the trial lock, check shared storage, wire auto-resume."""
        trainer = self.trainer
        self.state.pending = PendingResume()  # nothing of an earlier fit of this callback is pending
        if self._trainer_io:  # the user's checkpoints are DCP too: bridged for the whole run
            install_bridge(trainer.strategy, self.io)
        else:
            self.io.enable_collective()  # every rank writes its shard (bridged for our saves and loads)
            attach_recover_io(trainer, self.io)  # HFSaverCallback's io_mode "auto" is async with it
        self.io.add_staging_waiter()  # on_before_optimizer_step waits for the host copy (wait_for_staging)
        self._waiter = True
        self.ranks.configure(self.collective_timeout)
        error: BaseException | None = None
        try:
            self.store.claim(trainer.global_rank)  # the trial lock; on an object store: every rank's access
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
        self.ranks.agree(error, f"RecoverCallback setup ({self.store.claim_label})")
        self.store.check_shared(self.ranks, trainer.is_global_zero)
        wrap_resume_start(trainer, self._patch, self._resume_start)
        wrap_train_dataloader(trainer, self._patch, self._train_dataloader)
        wrap_step_end(trainer, self._patch, self._step_end)
        wrap_epoch_end(trainer, self._patch, self._epoch_end)
        continue_after_save_point(trainer, self._patch, self._resumed_at_epoch_end)
        # A resumed DDP reduces its first step with the saved buckets, as the run that saved did.
        # DDP's constructor broadcasts rank 0's parameters and buffers: what each rank loaded as its
        # own (write/replicas.py) is put back once it is built.
        wrap_ddp_setup_model(trainer.strategy, self._patch, lambda: self.state.pending.ddp_buckets,
                             after=lambda ddp: self._reapply_per_rank(trainer, ddp))

    def _reapply_per_rank(self, trainer: Any, ddp: Any) -> None:
        """Once the DDP is built: put this rank's own copies of the model's per-rank tensors, read
        by the resume, back into the module (DDP's constructor broadcast rank 0's), and let its next
        forward broadcast buffers only if the saved DDP's would have."""
        if self.state.pending.ddp_forward_sync is not None:  # a fresh DDP broadcasts buffers at its first forward
            set_ddp_forward_sync(ddp, self.state.pending.ddp_forward_sync)
        loaded, self.io.engine.last_per_rank = self.io.engine.last_per_rank, {}
        prefix = "state_dict."
        own = {fqn[len(prefix):]: value for fqn, value in loaded.items() if fqn.startswith(prefix)}
        if not own:
            return
        live = trainer.lightning_module.state_dict()
        with torch.no_grad():  # saved under plain names; live ones may carry torch.compile's _orig_mod.
            for key, value in live_names(own, live.keys()).items():
                if key in live:
                    live[key].copy_(value)

    def close(self) -> None:
        """Undo the wiring, release the lock (idempotent)."""
        self._patch.undo()
        attach_recover_io(self.trainer, None)
        if self._waiter:
            self.io.remove_staging_waiter()
            self._waiter = False
        if self._warning_filter is not None:
            remove_warning_filter(self._warning_filter)
        self._warning_filter = None
        self.state.tracker.untrack()
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks = {}
        if self.memory is not None:
            self.memory.close()  # the slots stay: a rerun resumes from them
        if not self._trainer_io and not self._io_closed:
            self._io_closed = True
            try:  # the private IO: its staging buffers and process groups (a failure was raised by wait_all())
                self.io.teardown()
            except BaseException as exc:  # noqa: BLE001 - close runs in teardown and after an error
                log.error("RecoverCallback: closing the recover checkpoint IO: %s", exc)
        self.store.release()

    # -- resume --------------------------------------------------------------------------

    def _resume_start(self, original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        trainer = self.trainer

        def resume_start(checkpoint_path: Any = None, weights_only: Any = None) -> None:
            if checkpoint_path is not None:
                log.info("RecoverCallback: resuming from the explicit ckpt_path=%s", checkpoint_path)
                if self.memory is not None:
                    self.memory.discard()
                # the user's own checkpoint: their CheckpointIO
                if not _is_dcp_dir(checkpoint_path, self.io.engine.storage_options):
                    return original(checkpoint_path, weights_only)
                with bridged(trainer.strategy, self.io):  # a recover checkpoint (or a copy of one)
                    original(checkpoint_path, weights_only)
                self._to_live_names()
                return None
            plan = agreed_plan(self.store, self.experiment, trainer, self.ranks)
            self.shared_step = plan.info[CHECKPOINT_INFO]["global_step"] if plan is not None else None
            memory = self._memory_plan()
            plan = self.state.pending.plan = memory if memory is not None else plan
            if plan is None:
                return original(None, weights_only)
            ckpt = plan.info[CHECKPOINT_INFO]
            continue_user_files(trainer, plan.info[STATS_LOGGER_INFO], ckpt["global_step"])
            self.state.pending.automatic = True
            self.last_durable = _parse_time(ckpt.get("commit_time"))
            # The non-tensor state is unpickled with weights_only=True unless the user opted out
            # (hyper-parameters holding arbitrary objects; see the README's security note).
            preloaded = memory is not None and memory.loaded is not None  # read by choose(), every item hashed
            # from the memory tier, each rank reads its own view: handed over as choose() read it,
            # or read without hashing again the slot files choose() checked (sharded strategies)
            reads: Any = contextlib.nullcontext() if memory is None else \
                self.io.preloaded(plan.path, plan.loaded) if preloaded else \
                self.io.engine.checked_before(plan.path, plan.checked_files)
            try:
                with bridged(trainer.strategy, self.io), \
                        self.io.rank_local_paths() if memory is not None else contextlib.nullcontext(), reads:
                    original(str(plan.path), self.weights_only)
            except CheckpointCorruptError as exc:
                raise CheckpointCorruptError(f"{exc} (or {start_fresh(self.store.info_dir)})") from exc
            finally:
                plan.loaded = None  # Lightning holds it until restored; the plan, kept for the run, must not
            self._to_live_names()
            self.state.pending.swa = started_swa(trainer, loaded_checkpoint(trainer))
            loaded = loaded_checkpoint(trainer).get("global_step")
            if loaded != ckpt["global_step"]:
                raise CheckpointCorruptError(
                    f"{plan.path} holds global step {loaded}, but {self.store.info_dir} describes "
                    f"global step {ckpt['global_step']}; {start_fresh(self.store.info_dir)}")
            step = plan.info[STEP_INFO]
            read = self.io.engine.last_read
            if preloaded:
                checked = (f"this rank read its slot once, {(read.nbytes if read else 0) / 1e6:.1f} MB, every item's "
                           f"CRC32C checked as read ({read.verified if read else 0} items, "
                           f"{read.verify_s if read else 0.0:.3f}s hashing), before the step was chosen "
                           f"({memory.check_s:.3f}s with the agreements)")
            elif memory is not None:
                received = f", {read.verified} items received from rank 0 hashed as read" if read and read.verified \
                    else ""
                checked = (f"this rank checked every item's CRC32C of its slot ({memory.checked_bytes / 1e6:.1f} MB, "
                           f"{memory.check_s:.3f}s with the agreement) before the step was chosen, then read "
                           f"{(read.nbytes if read else 0) / 1e6:.1f} MB{received}")
            else:
                checked = (f"this rank read and verified {(read.nbytes if read else 0) / 1e6:.1f} MB "
                           f"({read.verified if read else 0} items, {read.verify_s if read else 0.0:.3f}s hashing)")
            log.info("RecoverCallback: resuming from the %s tier, %s after global step %d (epoch %d, step %d in "
                     "epoch); %s", "memory" if memory is not None else "shared", plan.path, step["global_step"],
                     step["epoch"], step["epoch_step"], checked)

        return resume_start

    def _memory_plan(self) -> ResumePlan | None:
        """The memory tier's newest step every rank can restore, when it is not older than the
        shared tier's checkpoint (collective; see :meth:`MemoryTier.choose`)."""
        if self.memory is None:
            return None
        fresh = self.trainer.is_global_zero and self.shared_step is None and self.store.info_deleted()
        if self.trainer.world_size > 1:
            fresh = bool(self.ranks.agree(None, "memory tier: a fresh start", fresh)[0])
        # a replicated strategy loads into new tensors: choose() loads each candidate step itself,
        # checking every item as it is read (the slot read once); a sharded one loads into the
        # live model's shards, so its slot is checked before anything is loaded
        weights_only = self.weights_only
        load = None if is_sharded(self.trainer.strategy) else \
            (lambda path: self.io.engine.load(path, weights_only=weights_only))
        chosen = self.memory.choose(self.ranks, self.trainer.world_size, self.shared_step, fresh, load=load)
        if chosen is None:
            return None
        return ResumePlan(chosen.path, chosen.info, chosen.nbytes, chosen.check_s, chosen.checked_files,
                          chosen.loaded)

    def _to_live_names(self) -> None:
        """The loaded model state under the live model's names: a recover checkpoint stores them
        without ``torch.compile``'s ``_orig_mod.`` segments (sharded strategies load by the live
        model's own names already)."""
        checkpoint = loaded_checkpoint(self.trainer)
        if isinstance(checkpoint.get("state_dict"), dict) and not is_sharded(self.trainer.strategy):
            live = self.trainer.lightning_module.state_dict().keys()
            checkpoint["state_dict"] = live_names(checkpoint["state_dict"], live)

    def fit_started(self) -> None:
        """Before Lightning restores the optimizers: a replicated strategy loads them by position
        (``Optimizer.load_state_dict``), so the loaded states keyed by parameter name (every
        recover checkpoint since 0.2.0, whatever strategy wrote it) are given that form now
        that the optimizers exist. Sharded strategies loaded them by name already."""
        checkpoint = loaded_checkpoint(self.trainer)
        if not checkpoint or is_sharded(self.trainer.strategy) or not checkpoint.get("optimizer_states"):
            return
        names = parameter_names(self.trainer.lightning_module)
        try:
            checkpoint["optimizer_states"] = [
                by_index(opt, state, names, f"optimizer {i}")
                for i, (opt, state) in enumerate(zip(self.trainer.optimizers, checkpoint["optimizer_states"]))]
        except ValueError as exc:
            where = self.state.pending.plan.path if self.state.pending.plan is not None else "the checkpoint"
            raise RecoverMismatchError(f"{where}: {exc}; the optimizers of this run do not match the "
                                       f"checkpoint's, or {start_fresh(self.store.info_dir)}") from None

    def state_loaded(self) -> None:
        """The callback state of the checkpoint is loaded: an automatic resume writes back the
        CSV loggers' rows up to the checkpoint (Lightning's writer deleted them at setup)."""
        if self.state.pending.automatic:
            restore_csv_logs(self.trainer, self.state.pending.csv_logs)
        self.state.pending.csv_logs = {}

    # -- the save point ------------------------------------------------------------------

    def _step_end(self, original: Callable[[Any], None]) -> Callable[[Any], None]:
        trainer = self.trainer

        def on_advance_end(data_fetcher: Any) -> None:
            if self.state.pending.epoch_metrics:  # the first batch after a mid-epoch resume
                continue_train_epoch_metrics(trainer, self.state.pending.epoch_metrics)
            original(data_fetcher)
            if not epoch_loop_ends(trainer):  # else the epoch's end belongs to this step
                self._act(self.schedule.after_step(trainer.global_step, self.ranks), SavePoint.STEP_END)

        return on_advance_end

    def _epoch_end(self, original: Callable[[], None]) -> Callable[[], None]:
        trainer = self.trainer

        def on_advance_end() -> None:
            original()
            self.state.pending.epoch_metrics = {}
            epochs_done = self.state.position.epoch + 1
            self._act(self.schedule.after_epoch(trainer.global_step, epochs_done, self.ranks), SavePoint.EPOCH_END)

        return on_advance_end

    def _act(self, decision: Save, point: SavePoint) -> None:
        if decision is Save.NONE:
            if self.memory is not None and self.memory.due(self.trainer.global_step):
                self.save(point, shared=False)  # the memory tier's own step
            return
        self.save(point)
        if decision is Save.PREEMPT:
            self.wait_all()  # durable on every rank
            self.preemption.stop(self.trainer, self.store.ckpt_dir)

    def save_at_train_end(self) -> None:
        """At ``on_train_end``: the fit loop has finished after its last epoch's end (the
        checkpoint is one of the epoch-end save point; a rerun continues with the next epoch
        if ``max_epochs`` grew)."""
        self._act(Save.TRIGGER, SavePoint.EPOCH_END)

    def _resumed_at_epoch_end(self) -> bool | None:
        """Where the checkpoint this fit resumed from was taken (``None``: not at a save point)."""
        point, self.state.pending.save_point = self.state.pending.save_point, None
        return None if point is None else point == SavePoint.EPOCH_END.value

    def _train_dataloader(self, original: Callable[[], Any]) -> Callable[[], Any]:
        def dataloader() -> Any:
            loaders = original()
            counter = iter(range(1 << 30))
            return apply_to_collection(loaders, DataLoader, lambda dl: self.state.tracker.track(dl, next(counter)))

        return dataloader

    def check_memory_space(self) -> None:
        """Before the first step: the memory tier's tmpfs holds its slots of this rank's state as it
        is now (model, and optimizer states already made); every rank raises if one cannot."""
        if self.memory is None:
            return
        error: BaseException | None = None
        try:
            # parameters and buffers (FSDP: this rank's shards), not state_dict(): FSDP1 must not be
            # asked for one before its first forward
            module = self.trainer.lightning_module
            tensors = [list(module.parameters()), list(module.buffers())] + \
                [list(opt.state.values()) for opt in self.trainer.optimizers]
            self.memory.check_space(local_nbytes(tensors))
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
        if self.trainer.world_size > 1:
            self.ranks.agree(error, "memory tier: free space")
        elif error is not None:
            raise error

    def train_started(self, pl_module: Any) -> StepInfo | None:
        """At ``on_train_start`` of a resumed run: restore the RNG, log, return where it resumed."""
        trainer = self.trainer
        if not self.state.restore_rng(trainer):
            return None
        loaders = train_loaders(trainer)
        if loaders and all(isinstance(dl, DataLoader) for dl in loaders):
            # Every train loader is resumed by the tracker: Lightning's mid-epoch warning that a
            # plain DataLoader "is not resumable" does not apply to this run.
            warnings.filterwarnings("ignore", message=_NOT_RESUMABLE_WARNING)
            self._warning_filter = warnings.filters[0]
        if self.state.pending.swa and self.state.pending.plan is not None and not self.state.pending.plan.info[DATALOADER_INFO].get("at_epoch_boundary"):
            resume_swa(trainer, pl_module, self.state.pending.swa)  # its epoch-start hook, which Lightning skips mid-epoch
        self.state.pending.swa = []
        if self.state.pending.plan is not None and self.state.pending.automatic:
            step = StepInfo(**{k: v for k, v in self.state.pending.plan.info[STEP_INFO].items() if k != "next"})
        else:
            now = step_info(trainer, self.state.position)
            step = StepInfo(now.epoch, now.epoch_step, trainer.global_step - 1, now.steps_per_epoch)
        self.state.pending.automatic = False
        log.info(
            "RecoverCallback: resumed from %s after global step %d (epoch %d, step %d in epoch); restored model, "
            "%d optimizer(s), %d LR scheduler(s), loop progress, RNG, dataloader position (%s), callback states",
            trainer.ckpt_path, step.global_step, step.epoch, step.epoch_step, len(trainer.optimizers),
            len(trainer.lr_scheduler_configs), "; ".join(self.state.tracker.replayed) or "restored by the loader itself")
        return step

    # -- save ----------------------------------------------------------------------------

    def save(self, point: SavePoint | None = None, *, shared: bool = True) -> None:
        """Write a recover checkpoint of the current state (collective: every rank calls it).
        ``point``: where in the loop (``None``: from inside a hook, ``RecoverCallback.save``);
        at a save point the memory tier, when on and due, gets this rank's slot too.
        ``shared=False``: the memory tier only. At the save point an async save's host copy is
        finished before training goes on (the next step's hooks and forward, e.g. BatchNorm
        statistics, change the live tensors)."""
        trainer, engine, steps = self.trainer, self.io.engine, self.trainer.global_step
        tier = self.memory if self.memory is not None and point is not None and self.memory.due(steps) else None
        if shared:
            self.state.freq.mark_fired(steps)
            self.shared_step = steps  # the memory tier's slots follow this save from now on
            timer = self._timer = SaveTimer(self.telemetry, steps, str(self.store.ckpt_dir), self.store.retries)
        boundary = at_epoch_boundary(trainer)
        # each parameter's name, by its id: this save's info and its optimizer states keyed by name
        names = None if is_sharded(trainer.strategy) else parameter_names(trainer.lightning_module)
        info = describe(trainer, self.state, boundary=boundary, io_mode=self.io.resolved_mode,
                        experiment=self.experiment, user=self.store.layout.user, names=names)
        # 1. The previous save is durable and committed (or its failure raised here); rank 0 cleans
        #    what interrupted saves left, names this save's generation; every rank agrees on it.
        error: BaseException | None = None
        gen: str | None = None
        if shared:
            try:
                engine.wait()
                if self.memory is not None:
                    self.memory.wait_persist()
                if trainer.is_global_zero:
                    self.store.clean_stale()
                    gen = self.store.new_generation(steps)
                    models = self.store.record_hf_models(lambda: hf_models_of(trainer, trainer.lightning_module))
                    if models is not None:  # what `convert --to hf` needs
                        info[CHECKPOINT_INFO]["hf_models"] = models
            except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
                error = exc
            gen = self.ranks.agree(error, f"recover checkpoint of global step {steps}", gen)[0]
        # 2. Collect the checkpoint: Lightning's (model, optimizers, loops, callback states, every
        #    on_save_checkpoint hook), each rank its own shard's view (FSDP's sharded state dicts);
        #    then the recover state, as training goes on from here (RNG: after anything the hooks
        #    drew; loader positions: every rank's, gathered), in the canonical form.
        with bridged(trainer.strategy, self.io):
            checkpoint = dump_checkpoint(trainer)
        extra = self.state.capture(trainer, boundary, self.ranks, point)
        checkpoint.setdefault("callbacks", {}).setdefault(self.state_key, {}).update(extra)
        self.state.canonical(checkpoint, trainer, names)
        # 3. The memory tier: this rank's slot (training waits for the copy; the slot is sealed
        #    in the background).
        if tier is not None:
            self._write_memory(tier, checkpoint, info, steps, point)
        if not shared:
            return
        # 4. Write every rank's shard into the generation's folder; rank 0 commits it with its
        #    recover_info once DCP returned (in the background for an async save). With the
        #    memory tier's slot of this step: copied from the slots once they are sealed.
        target = self.store.target(gen, info, on_committed=self._committed(timer))
        check = None if not self.weights_only or self._checked_loadable else self._check_loadable
        if tier is not None:
            self._persist(tier, checkpoint, target, check)
        else:
            self.io.write(checkpoint, target, check=check)
        trainer.strategy.barrier("RecoverCallback.save")
        # 5. At the save point the next step must not change what an async save still copies.
        if point is not None and engine.in_flight is not None:
            engine.wait_for_staging()
        timer.returned()
        written = engine.last_written
        if written is not None and not trainer.is_global_zero and self.io.resolved_mode == "sync":
            log.debug("recover checkpoint of global step %d: rank %d wrote %.1f MB, %.3fs of it hashing",
                      steps, trainer.global_rank, written.nbytes / 1e6, written.hash_s)

    def _persist(self, tier: MemoryTier, checkpoint: dict[str, Any], target: Any,
                 check: Callable[[dict[str, Any]], None] | None) -> None:
        """The shared tier's save of this step from every rank's memory-tier slot (in the
        background, once sealed; rank 0 commits). ``check``: rank 0's first-save check."""
        lead = self.trainer.is_global_zero
        error: BaseException | None = None
        try:
            if check is not None and lead:
                check(checkpoint)
            target.create()
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
        try:
            self.ranks.agree(error, f"recover checkpoint {target.final} from the memory tier")
        except BaseException:
            if lead:
                target.discard()
            raise
        out = target.tmp if isinstance(target.tmp, str) else Path(target.tmp)
        tier.persist(out, self.ranks, target.finalize if lead else None, self.io.engine.storage_options)

    def _write_memory(self, tier: MemoryTier, checkpoint: dict[str, Any], info: dict[str, Any], steps: int,
                      point: SavePoint) -> None:
        """This rank's memory-tier slot of the checkpoint; a failure on any rank is raised on every rank.
        Every rank first agrees that its previous slot was sealed (checksummed and sealed in the
        background): no rank unseals an older slot while another rank lacks the newer step. Each
        optimizer waits for this slot's seal before it steps. On CUDA, parameters and optimizer
        states are copied during the next step only at a step's save point (an epoch's end is
        where callbacks such as stochastic weight averaging rewrite the weights: the training
        stream waits for the whole copy there)."""
        error: BaseException | None = None
        if tier.wrote:  # the previous step's background seal
            try:
                tier.wait_sealed()
            except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
                error = exc
            self.ranks.agree(error, f"memory tier: the slot before global step {steps} sealed")  # one rank: raises it
        try:
            late = self._changed_by_optimizers() if point is SavePoint.STEP_END else None
            tier.write(checkpoint, global_step=steps, world_size=self.trainer.world_size, lineage=self.shared_step,
                       info=info, late=late)
            self._wait_before_optimizer_steps(tier)
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
        self.ranks.agree(error, f"memory tier slot of global step {steps}")  # one rank: raises it
        metrics = {"checkpoint/memory/blocked_s": tier.last_copy_s + tier.last_stall_s,
                   "checkpoint/memory/stall_s": tier.last_stall_s}
        lag = tier.replica_lag
        if lag is not None:
            metrics["checkpoint/memory/replica_lag_steps"] = float(lag)
        self.telemetry.note(steps, metrics)

    def _changed_by_optimizers(self) -> Callable[[torch.Tensor], bool]:
        """Whether a tensor of the checkpoint is a parameter some optimizer steps, or an
        optimizer state, on the GPU (by storage): the memory tier's device copy of those may
        still run until the next optimizer step (:meth:`wait_for_staging`, and each optimizer's
        step pre-hook); every other tensor (buffers such as BatchNorm's statistics, which the next
        forward changes; parameters no optimizer holds, e.g. a momentum encoder's) is copied
        before the next step's kernels run."""
        storages: set[int] | None = None

        def address(tensor: Any) -> int | None:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            return local.untyped_storage().data_ptr() if isinstance(local, torch.Tensor) and local.is_cuda else None

        def late(tensor: torch.Tensor) -> bool:
            nonlocal storages
            if storages is None:
                tensors = [p for optimizer in self.trainer.optimizers for group in optimizer.param_groups
                           for p in group["params"] if p.requires_grad]
                tensors += [value for optimizer in self.trainer.optimizers for state in optimizer.state.values()
                            for value in state.values() if isinstance(value, torch.Tensor)]
                storages = {a for t in tensors if (a := address(t)) is not None}
            return address(tensor) in storages

        return late

    def _wait_before_optimizer_steps(self, tier: MemoryTier) -> None:
        """Each optimizer of the run waits for the memory tier's seal (CUDA: and device copy)
        before it changes the parameters (a step pre-hook: also where a manual-optimisation step
        bypasses Lightning's hooks). A step given a closure (Lightning's automatic optimisation
        runs the forward and backward in it) waits after the closure, so the seal overlaps them."""
        def wait(_optimizer: Any, args: Any, kwargs: Any) -> Any:  # None, or new (args, kwargs)
            # args: the step's own, the optimizer first (torch passes the bound method's arguments)
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
            if not callable(closure):
                self._wait_for_seal()
                return None

            def closure_then_wait() -> Any:
                result = closure()
                self._wait_for_seal()
                return result

            if "closure" in kwargs:
                return args, {**kwargs, "closure": closure_then_wait}
            return (args[0], closure_then_wait, *args[2:]), kwargs

        hooked = self._step_hooks
        for optimizer in self.trainer.optimizers:
            inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's torch optimizer
            if id(inner) not in hooked and hasattr(inner, "register_step_pre_hook"):
                hooked[id(inner)] = inner.register_step_pre_hook(wait)

    def _wait_for_seal(self) -> None:
        """Until the memory tier's last slot is sealed (telemetry: ``checkpoint/memory/optimizer_wait_s``);
        a failure is raised on every rank by the next memory-tier save (or the end of training)."""
        if self.memory is not None:
            waited = self.memory.wait_sealed(raise_failure=False)
            if waited is not None:
                self.telemetry.note(self.trainer.global_step, {"checkpoint/memory/optimizer_wait_s": waited})

    def _committed(self, timer: SaveTimer) -> Callable[[Any], None]:
        def committed(written: Any) -> None:  # rank 0, after the commit (in the background when async)
            self.last_durable = time.time()
            timer.committed(written)

        return committed

    def _check_loadable(self, checkpoint: dict[str, Any]) -> None:
        """At the first save: the resume will unpickle the non-tensor state with
        ``weights_only=True``; refuse now what it would refuse then."""
        refusal = weights_only_refusal(checkpoint)
        self._checked_loadable = True
        if refusal is None:
            return
        raise ConfigError("weights_only", (
            f"the recover checkpoint holds a {refusal.type_name} at {refusal.path}, which the resume would refuse "
            f"to load with weights_only=True ({refusal.reason}); nothing was written. Either store plain data there "
            "(lists, dicts, numbers, strings, tensors: e.g. list(d) of a deque d) or, where torch can rebuild the "
            f"type, allowlist it before training with torch.serialization.add_safe_globals([{refusal.type_name}]); "
            "or pass RecoverCallback(weights_only=False) if you trust the checkpoint storage"))

    def wait_for_staging(self) -> None:
        """Before an optimizer step: wait until an async save and the memory tier's device copy
        no longer read the weights and optimizer states, and the tier's slot is sealed."""
        self._wait_for_seal()
        if self.io.engine.in_flight is not None:
            start = time.perf_counter()
            self.io.engine.wait_for_staging()
            if self._timer is not None:
                self._timer.waited(time.perf_counter() - start)

    def wait(self) -> None:
        """Until the last save is durable and published (and the memory tier's last slot
        sealed); raises its failure (rank-local)."""
        self.io.engine.wait()
        if self.memory is not None:
            self.memory.wait_sealed()
            self.memory.wait_persist()

    def wait_all(self) -> None:
        """Collective :meth:`wait`: a failure on any rank (rank 0 alone publishes) is raised on every rank."""
        error: BaseException | None = None
        try:
            if self.memory is not None:
                self.memory.wait_sealed()
                self.memory.wait_persist()
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
        self.io.engine.wait_all("recover checkpoint in flight at the end of training")
        self.ranks.agree(error, "recover checkpoint from the memory tier in flight at the end of training")

    def finished(self) -> None:
        """``fit`` ended normally and its last checkpoint is durable on every rank: the memory
        tier's folders are removed (the shared tier holds the end)."""
        if self.memory is not None:
            self.memory.remove()

    def log_age(self, pl_module: Any) -> None:
        """Log ``checkpoint/recover/age_s``: seconds since the last durable recover checkpoint."""
        if self.last_durable is not None and self.trainer.loggers:
            pl_module.log("checkpoint/recover/age_s", time.time() - self.last_durable, on_step=True,
                          on_epoch=False, rank_zero_only=True)

