"""Capture (Lightning): what a recover checkpoint holds beyond Lightning's own checkpoint.

:class:`RecoverState` is ``RecoverCallback``'s callback state (``state_dict`` /
``load_state_dict``, stored by Lightning under the callback's key): trigger progress, the
epoch position and, added by the callback's own saves (:meth:`RecoverState.capture`), every
rank's RNG states and train loader position (gathered into rank 0's state: Lightning saves
rank 0's callback states only). On load it maps the loader position to another world size and restores the RNG at
``on_train_start``. :func:`describe` builds the ``recover_info/`` files of one save.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from areal_lightning.capture.compiled import plain_name, uncompiled
from areal_lightning.capture.hf_meta import HFModelEntry, is_pretrained, state_prefix
from areal_lightning.capture.loader import (
    LoaderTracker,
    is_stateful_loader,
    remap_position,
)
from areal_lightning.capture.optimizer_names import by_name, names_every_parameter, parameter_names
from areal_lightning.capture.rng import capture_rng, restore_rng
from areal_lightning.collective import CheckpointGroup
from areal_lightning.commit.recover_store import FORMAT_VERSION
from areal_lightning.errors import RecoverMismatchError
from areal_lightning.layout import (
    CHECKPOINT_INFO,
    DATALOADER_INFO,
    EVALUATOR_INFO,
    SAVER_INFO,
    STATS_LOGGER_INFO,
    STEP_INFO,
)
from areal_lightning.lightning._internals import (
    ddp_bucket_layout,
    ddp_forward_sync,
    prefetched_batches,
    train_epoch_metrics,
    train_loaders,
    wrapped_sampler,
)
from areal_lightning.lightning.bridge import is_sharded
from areal_lightning.lightning.resume import checkpoint_files, csv_snapshots, strategy_family
from areal_lightning.trigger import EpochPosition, FreqController, SavePoint, StepInfo

__all__ = ["RecoverState", "PendingResume", "optimizer_keys", "hf_models_of", "EvaluatorPosition", "evaluator_info", "describe", "batches_done",
           "at_epoch_boundary", "step_info"]


def batches_done(trainer: Any) -> int:
    """Batches of the current epoch the fit loop processed."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


def at_epoch_boundary(trainer: Any) -> bool:
    """Whether every batch of the epoch was processed (a save at the epoch's end)."""
    return batches_done(trainer) >= trainer.num_training_batches


def step_info(trainer: Any, position: EpochPosition) -> StepInfo:
    """The last completed optimizer step, 0-based (after the last epoch Lightning's epoch
    counter has moved on: ``position`` knows the epoch of that step)."""
    steps = trainer.global_step
    n = trainer.num_training_batches
    per_epoch = math.ceil(n / trainer.accumulate_grad_batches) if n != float("inf") else None
    return StepInfo(epoch=position.epoch, epoch_step=position.epoch_step(steps), global_step=steps - 1,
                    steps_per_epoch=per_epoch)


@dataclass
class PendingResume:
    """Everything a resume has read and not applied yet, in one place (a fresh one at each fit's
    setup): set when the checkpoint loads, applied where Lightning's loop lets it be (the hook
    named). ``save_point``, ``stop``, ``accumulate``, ``rng``, ``remapped``, ``epoch_metrics``,
    ``csv_logs``, ``swa`` and ``automatic`` are taken once; ``plan``, ``at_boundary`` and the DDP
    fields are read where needed."""

    plan: Any = None
    """The automatic resume's :class:`~areal_lightning.lightning.resume.ResumePlan` (``None``: a
    fresh start or an explicit ``ckpt_path``)."""
    automatic: bool = False  # an automatic resume, until on_train_start logged it
    save_point: str | None = None  # the checkpoint's SavePoint value (the loop continues after it)
    ddp_buckets: list[list[int]] | None = None  # DDP's gradient buckets (when the DDP is built)
    ddp_forward_sync: bool | None = None  # whether that DDP was to broadcast buffers at its next forward
    stop: bool = False  # the run had been asked to stop (EarlyStopping) when it was saved
    accumulate: int | None = None  # accumulate_grad_batches of the epoch (at the first batch)
    rng: dict[str, Any] | None = None  # this rank's RNG states (at on_train_start)
    remapped: dict[str, Any] | None = None  # loader positions mapped to another world size
    at_boundary: bool = False  # the checkpoint was taken at an epoch boundary
    epoch_metrics: dict[str, Any] = field(default_factory=dict)  # epoch aggregates (at the first batch)
    csv_logs: dict[str, Any] = field(default_factory=dict)  # CSVLogger files, rank 0's (once loaded)
    swa: list[Any] = field(default_factory=list)  # SWA callbacks started before the checkpoint loaded


class RecoverState:
    """The callback state of ``RecoverCallback`` (see the module doc)."""

    def __init__(self, freq: FreqController, fast_forward: str = "sampler") -> None:
        self.freq = freq
        self.position = EpochPosition()
        self.tracker = LoaderTracker(unwrap_sampler=wrapped_sampler, fast_forward=fast_forward)
        self.evaluator = EvaluatorPosition()
        self.pending = PendingResume()

    # -- saving ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Trigger progress, epoch position, validation position (Lightning's callback state;
        the callback's own saves add :meth:`capture` to it)."""
        return {"freq": self.freq.state_dict(), **self.position.state_dict(), "evaluator": self.evaluator.state_dict()}

    def capture(self, trainer: Any, boundary: bool, ranks: CheckpointGroup, point: SavePoint | None) -> dict[str, Any]:
        """What a recover save adds to :meth:`state_dict`: the save point, the RNG states and
        the train loaders' positions (every rank's, gathered: Lightning saves rank 0's callback
        state only; collective in multi-rank runs), the epoch aggregates, DDP's buckets.
        ``point``: ``None`` for a save from inside a hook (``RecoverCallback.save``)."""
        state: dict[str, Any] = {}
        if point is not None:
            state["save_point"] = SavePoint(point).value
            state["should_stop"] = bool(trainer.should_stop)
        # Set by the epoch's on_train_epoch_start hooks (GradientAccumulationScheduler), which a
        # mid-epoch resume does not run again.
        state["accumulate_grad_batches"] = int(trainer.accumulate_grad_batches)
        layout = ddp_bucket_layout(trainer.strategy.model)  # every rank: it may rebuild DDP's buckets
        if layout is not None:
            state["ddp_buckets"] = layout
        forward_sync = ddp_forward_sync(trainer.strategy.model)  # a fresh DDP would broadcast buffers
        if forward_sync is not None:
            state["ddp_forward_sync"] = forward_sync
        state["rng"] = capture_rng()
        csv_logs = csv_snapshots(trainer)  # rank 0 (whose callback state is the one saved)
        if csv_logs:
            state["csv_logs"] = csv_logs
        state["data"] = self.tracker.state_dict(batches_done(trainer), boundary, prefetched_batches(trainer))
        # Mid-epoch: the epoch aggregates of values logged with on_epoch=True so far.
        state["epoch_metrics"] = {} if boundary else train_epoch_metrics(trainer)
        if not boundary:
            # Each stateful loader's own state, as Lightning saves it (CombinedLoader._state_dicts),
            # kept here too: Lightning drops it when configure_optimizers built the loader early (#20550).
            for i, dl in enumerate(train_loaders(trainer)):
                entry = state["data"]["loaders"].get(str(i))
                if entry is not None and entry["stateful"]:
                    entry["loader_state"] = self.tracker.loader_state(i, dl, entry["batches_done"])
        if trainer.world_size > 1:
            # RNG and loader position differ per rank; Lightning saves rank 0's callback
            # state only, so every rank's is gathered into it (all ranks are in the save).
            mine = {"rng": state.pop("rng"), "data": state.pop("data"), "epoch_metrics": state.pop("epoch_metrics")}
            gathered = ranks.agree(None, "per-rank RNG and data position", mine)
            state["per_rank"] = {str(rank): entry for rank, entry in enumerate(gathered)}
        return state

    @staticmethod
    def canonical(checkpoint: dict[str, Any], trainer: Any, names: Mapping[int, str] | None = None) -> None:
        """A recover checkpoint's canonical form, in place: the model's state-dict keys without
        ``torch.compile``'s ``_orig_mod.`` segments (a compiled and an uncompiled run resume each
        other's checkpoints), every optimizer's state keyed by parameter name as sharded
        strategies key it (any strategy family resumes the checkpoint: :func:`optimizer_keys`),
        and no copy of the train loaders' states in Lightning's loop state: the tracker restores
        every train loader itself, each rank its own (Lightning keeps rank 0's loader states
        only), and at an epoch boundary a stateful loader's state would even skip the next epoch
        (Lightning restores it as "exhausted")."""
        if isinstance(checkpoint.get("state_dict"), dict):
            checkpoint["state_dict"] = {plain_name(k): v for k, v in checkpoint["state_dict"].items()}
        if not is_sharded(trainer.strategy) and checkpoint.get("optimizer_states"):
            names = parameter_names(trainer.lightning_module) if names is None else names
            checkpoint["optimizer_states"] = [by_name(opt, state, names) for opt, state
                                              in zip(trainer.optimizers, checkpoint["optimizer_states"])]
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if "combined_loader" in fit_state:
            fit_state["combined_loader"] = []

    # -- loading -----------------------------------------------------------------------------

    @staticmethod
    def own_rank_state(state: dict[str, Any], rank: int) -> dict[str, Any]:
        """This rank's RNG and loader state out of a saved callback state; on another world
        size (resharding) rank r continues from saved rank r mod W."""
        per_rank = state.get("per_rank")
        if per_rank is None:
            return state
        return {**state, **per_rank[str(rank % len(per_rank))]}

    def remap_world_size(self, state: dict[str, Any], checkpoint: dict[str, Any], world_size: int, rank: int) -> None:
        """On a different world size, map the dataloader position by samples consumed and
        make Lightning's batch counters of the epoch agree with it (before ``load_state_dict``)."""
        per_rank = state.get("per_rank")
        old_world = len(per_rank) if per_rank is not None else 1
        mine = self.own_rank_state(state, rank)
        if old_world == world_size or "data" not in mine:
            return
        try:
            data = remap_position(mine["data"], old_world, world_size)
        except ValueError as exc:
            raise RecoverMismatchError(f"resharding from {old_world} to {world_size} ranks: {exc}") from None
        self.pending.remapped = data
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {}).get("current")
        if not data["at_boundary"] and progress:
            done = max((int(entry["batches_done"]) for entry in data["loaders"].values()),
                       default=progress["processed"])
            shift = done - progress["processed"]
            for key in ("ready", "started", "processed", "completed"):
                progress[key] += shift

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        """Restore progress; a state from one of our saves also arms RNG and loader restore."""
        self.freq.load_state_dict(state.get("freq", {}))
        self.position.load_state_dict(state)
        self.evaluator.load_state_dict(state.get("evaluator", {}))
        self.pending.save_point = state.get("save_point")
        self.pending.ddp_buckets = state.get("ddp_buckets")
        self.pending.ddp_forward_sync = state.get("ddp_forward_sync")
        self.pending.stop = bool(state.get("should_stop", False))
        self.pending.accumulate = state.get("accumulate_grad_batches")
        self.pending.csv_logs = state.get("csv_logs") or {}
        state = self.own_rank_state(state, rank)
        if "rng" in state:  # a checkpoint written by RecoverCallback.save (auto-resumed or explicit)
            data, self.pending.remapped = self.pending.remapped or state["data"], None
            self.pending.rng = state["rng"]
            self.pending.epoch_metrics = dict(state.get("epoch_metrics") or {})
            self.pending.at_boundary = bool(data["at_boundary"])
            self.tracker.load_state_dict(data, checkpoint_rng=state["rng"]["torch"])

    def restore_rng(self, trainer: Any) -> bool:
        """At ``on_train_start``: set the RNG states saved with the checkpoint; ``False`` when
        this start is not a resume from one of our checkpoints."""
        rng, self.pending.rng = self.pending.rng, None
        if rng is None:
            return False
        if self.pending.stop:  # the run had been asked to stop (EarlyStopping) when it was saved
            trainer.should_stop = True
            self.pending.stop = False
        if self.pending.at_boundary and self.tracker.replayed:
            # The next epoch's iterator was created from the saved torch RNG state already.
            rng = {**rng, "torch": torch.get_rng_state()}
        restore_rng(rng)
        return True


    def restore_accumulation(self, trainer: Any) -> None:
        """At the first batch of a resume into the middle of an epoch: the gradient accumulation
        the epoch's ``on_train_epoch_start`` hooks had set (``GradientAccumulationScheduler``;
        Lightning does not run them again mid-epoch, and the scheduler's own ``on_train_start``
        requires the Trainer's value untouched until then)."""
        pending, self.pending.accumulate = self.pending.accumulate, None
        if pending is not None and not self.pending.at_boundary:
            trainer.accumulate_grad_batches = int(pending)


class EvaluatorPosition:
    """Where the run is in its validation schedule: the validations completed during fit
    (the sanity check not counted) and the step of the last one (``evaluator_info.json``)."""

    def __init__(self) -> None:
        self.completed = 0
        self.last_global_step: int | None = None
        self.last_epoch: int | None = None

    def validated(self, trainer: Any) -> None:
        """At the end of a validation during fit (not the sanity check)."""
        self.completed += 1
        self.last_global_step = trainer.global_step
        self.last_epoch = trainer.current_epoch

    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly position."""
        return {"completed": self.completed, "last_global_step": self.last_global_step,
                "last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty dict: no validation yet)."""
        self.completed = int(state.get("completed", 0))
        self.last_global_step = state.get("last_global_step")
        self.last_epoch = state.get("last_epoch")


def _json_number(value: Any) -> Any:
    """A schedule value for strict JSON: numbers as they are, infinity and anything else
    (a ``timedelta`` interval) as text."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and math.isfinite(value):
        return value
    return str(value)


def evaluator_info(trainer: Any, evaluator: EvaluatorPosition) -> dict[str, Any]:
    """``evaluator_info.json``: the validation schedule and the run's position in it. A save
    is never taken between a batch and the validation due after it, so ``validated_at_this_step``
    tells whether that validation belongs to the checkpoint (it is then not run again)."""
    loop = trainer.fit_loop.epoch_loop
    return {
        # A time-based interval (timedelta, "DD:HH:MM:SS", dict) leaves both unset on the Trainer.
        "val_check_interval": _json_number(getattr(trainer, "val_check_interval", "time-based")),
        "val_check_batch": _json_number(getattr(trainer, "val_check_batch", None)),
        "check_val_every_n_epoch": trainer.check_val_every_n_epoch,
        "limit_val_batches": _json_number(trainer.limit_val_batches),
        "num_sanity_val_steps": _json_number(trainer.num_sanity_val_steps),
        "validations_completed": evaluator.completed,
        "last_validation_global_step": evaluator.last_global_step,
        "last_validation_epoch": evaluator.last_epoch,
        "validated_at_this_step": evaluator.last_global_step == trainer.global_step,
        "val_batches_completed_total": loop.val_loop.batch_progress.total.completed,
    }


def _versions() -> dict[str, str]:
    import lightning
    import transformers

    from areal_lightning.version import __version__

    return {"torch": torch.__version__, "lightning": lightning.__version__,
            "transformers": transformers.__version__, "areal_lightning": __version__}


def hf_models_of(trainer: Any, module: Any) -> list[HFModelEntry]:
    """The ``PreTrainedModel``\\ s of ``module`` a recover checkpoint records for ``convert``: those
    of the run's ``HFSaverCallback``\\ s under their names, else every ``PreTrainedModel`` attribute
    of the module (``model`` as ``default``, with the module's ``tokenizer``). PEFT models are left
    out (their exports need the adapter configuration: ``HFSaverCallback``)."""
    from areal_lightning.lightning.hf_saver import HFSaverCallback
    from areal_lightning.write.hf import DEFAULT_MAX_SHARD_SIZE

    entries: list[HFModelEntry] = []
    savers = [cb for cb in trainer.callbacks if isinstance(cb, HFSaverCallback)]
    for cb in savers:
        try:
            model = uncompiled(cb.resolve_model(module))
        except Exception:  # noqa: BLE001 - the callback reports its own errors at its exports
            continue
        prefix = state_prefix(module, model)
        if is_pretrained(model) and prefix is not None:
            attr = cb.model_attr if isinstance(cb.model_attr, str) else None
            entries.append(HFModelEntry(cb.name, attr, model, cb.resolve_tokenizer(module), prefix,
                                        cb.max_shard_size))
    if savers:
        return entries
    for attr, child in module.named_children():
        model = uncompiled(child)
        if is_pretrained(model):
            name = "default" if attr == "model" else attr
            tokenizer = getattr(module, "tokenizer", None) if name == "default" else None
            entries.append(HFModelEntry(name, attr, model, tokenizer, plain_name(attr) + ".", DEFAULT_MAX_SHARD_SIZE))
    return entries


def optimizer_keys(trainer: Any, names: Mapping[int, str] | None = None) -> str:
    """How a recover save of this run keys its optimizer states: ``names`` (every strategy
    family resumes it) or ``index`` (a parameter outside the LightningModule: replicated
    strategies only, as every checkpoint of a replicated strategy before this field).
    ``names``: :func:`parameter_names` of the LightningModule, where the caller has it."""
    if is_sharded(trainer.strategy):
        return "names"
    names = parameter_names(trainer.lightning_module) if names is None else names
    return "names" if all(names_every_parameter(opt, names) for opt in trainer.optimizers) else "index"


def describe(trainer: Any, state: RecoverState, *, boundary: bool, io_mode: str | None, experiment: Any,
             user: str, names: Mapping[int, str] | None = None) -> dict[str, dict[str, Any]]:
    """The content of every ``recover_info/`` file of a save taken now (``checkpoint_info.json``
    without its file list, which the commit adds). ``names``: see :func:`optimizer_keys`."""
    from areal_lightning.lightning.hf_saver import HFSaverCallback

    loaders = []
    for i, dl in enumerate(train_loaders(trainer)):
        cls = type(dl).__mro__[1] if type(dl).__dict__.get("_areal_resumable") else type(dl)
        loaders.append({"index": i, "class": cls.__name__, "stateful": is_stateful_loader(dl),
                        "num_workers": getattr(dl, "num_workers", None),
                        "batch_size": getattr(dl, "batch_size", None),
                        "sampler": type(getattr(dl, "sampler", None)).__name__})
    step = step_info(trainer, state.position)
    return {
        STEP_INFO: {**asdict(step), "next": asdict(step.next())},
        SAVER_INFO: {cb.state_key: cb.state_dict() for cb in trainer.callbacks if isinstance(cb, HFSaverCallback)},
        EVALUATOR_INFO: evaluator_info(trainer, state.evaluator),
        STATS_LOGGER_INFO: {"loggers": [
            {"class": type(lg).__name__, "name": lg.name, "version": lg.version,
             "save_dir": str(lg.save_dir) if lg.save_dir else None} for lg in trainer.loggers],
            "checkpoint_files": checkpoint_files(trainer) if trainer.is_global_zero else {}},  # rank 0's is written
        DATALOADER_INFO: {"epoch": state.position.epoch, "batches_done": batches_done(trainer),
                          "at_epoch_boundary": boundary, "loaders": loaders},
        CHECKPOINT_INFO: {
            "format_version": FORMAT_VERSION,
            "global_step": trainer.global_step,
            "epoch": state.position.epoch,  # of the last step (at an epoch end Lightning counts the next)
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "family": strategy_family(trainer.strategy),
            "optimizer_keys": optimizer_keys(trainer, names),
            "num_devices": trainer.num_devices,
            "num_nodes": trainer.num_nodes,
            "accelerator": type(trainer.accelerator).__name__,
            "io_mode": io_mode,
            "experiment_name": experiment.experiment_name,
            "trial_name": experiment.trial_name,
            "user": user,
            "versions": _versions(),
        },
    }
