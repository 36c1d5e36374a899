"""The only module that touches Lightning's private attributes (Lightning 2.6).

Each function below names the private attribute it reads or replaces; every one is pinned by
``tests/test_internals.py`` against the installed Lightning, so a Lightning upgrade that
moves one breaks one test with a clear name instead of a training run.
``tests/test_internals.py`` also checks that no other module of the package uses these names.

Why each is needed (public Lightning has no equivalent):

* auto-resume: Lightning resolves ``ckpt_path`` before any callback hook runs, and the first
  moment the resolved path passes by a hook is ``_checkpoint_connector.resume_start``, called
  right after ``setup``; the loaded checkpoint is then ``_loaded_checkpoint``.
* exact dataloader position: the train loaders are built by ``fit_loop._data_source.dataloader``;
  the loaders in use are ``fit_loop._combined_loader.flattened``; batches the data fetcher
  prefetched are ``fit_loop._data_fetcher.batches``.
* the CheckpointIO the user passed (``strategy._checkpoint_io``; the public property builds a
  default one), unwrapped from Lightning's ``_WrappingCheckpointIO``.
* per-rank sharded saves: ``FSDPStrategy._state_dict_type`` and
  ``ModelParallelStrategy._save_distributed_checkpoint`` (constructor-only settings).
* continuing the interrupted run's logger version: ``logger._version`` / ``logger._experiment``;
  a ``WandbLogger``'s run: ``_wandb_init`` / ``_id`` / ``_experiment``.
* a callback's checkpoint key from its arguments (``Callback._generate_state_key``), as
  Lightning's own callbacks build theirs, so several instances coexist in one Trainer.
* the user's sampler inside Lightning's ``DistributedSamplerWrapper`` (``dataset._sampler``),
  whose generator holds the epoch's permutation.
* the save point after everything Lightning runs for a step: no hook runs after the validation
  due after a batch, the schedulers and the epoch's end, so the save wraps
  ``fit_loop.epoch_loop.on_advance_end`` and ``fit_loop.on_advance_end``; a checkpoint taken
  there is continued with the next step by taking over Lightning's restart decisions
  (``fit_loop.reset``, ``epoch_loop.reset``, ``_restarting``).
* epoch-aggregated training metrics (``self.log(..., on_epoch=True)``) across a mid-epoch
  resume: Lightning accumulates them in ``fit_loop.epoch_loop._results`` and saves them nowhere.
* DDP's gradient reduction order on a resume: DDP reduces its first iteration with buckets in
  parameter-definition order and rebuilds them by gradient-ready order for the next ones; an
  all-reduce of 3+ ranks sums an element in an order that depends on its offset in the bucket,
  so a fresh DDP would reduce the first resumed step differently. The layout is read from DDP
  (``_has_rebuilt_buckets``, ``reducer._rebuild_buckets``, ``_get_ddp_logging_data``) and given
  to the resumed DDP when Lightning builds it (``DDPStrategy._setup_model``, through
  ``torch.distributed._compute_bucket_assignment_by_size``).
* preemption under ``SLURMEnvironment(auto_requeue=True)``: the cluster environment of any
  strategy (``trainer._accelerator_connector.cluster_environment``; single-device strategies
  have no public ``cluster_environment``).
"""

from __future__ import annotations

from typing import Any, Callable

from areal_lightning.errors import IncompatibleVersionError

__all__ = [
    "Patch",
    "dump_checkpoint",
    "wrap_resume_start",
    "wrap_train_dataloader",
    "loaded_checkpoint",
    "train_loaders",
    "prefetched_batches",
    "user_checkpoint_io",
    "unwrap_checkpoint_io",
    "fsdp_state_dict_type",
    "set_fsdp_state_dict_type",
    "saves_distributed_checkpoint",
    "set_save_distributed_checkpoint",
    "can_redirect_logger",
    "can_redirect_wandb",
    "redirect_wandb",
    "redirect_logger",
    "wrapped_sampler",
    "callback_state_key",
    "wrap_step_end",
    "wrap_epoch_end",
    "epoch_loop_ends",
    "continue_after_save_point",
    "ddp_bucket_layout",
    "ddp_forward_sync",
    "set_ddp_forward_sync",
    "wrap_ddp_setup_model",
    "cluster_environment",
    "train_epoch_metrics",
    "continue_train_epoch_metrics",
]

PRIVATE_NAMES = (
    "_checkpoint_connector", "_loaded_checkpoint", "_data_source", "_combined_loader", "_data_fetcher",
    "_checkpoint_io", "_WrappingCheckpointIO", "_state_dict_type", "_save_distributed_checkpoint",
    "_experiment", "_version", "_sampler", "_generate_state_key", "_restarting", "_setup_model",
    "_accelerator_connector", "_results",
)
"""The Lightning private names used here (and nowhere else in the package)."""


class Patch:
    """Instance attributes replaced on Lightning objects; :meth:`undo` restores them."""

    def __init__(self) -> None:
        self._patched: list[tuple[Any, str]] = []

    def set(self, obj: Any, attr: str, value: Any) -> None:
        """Shadow ``obj.attr`` (a method) with ``value`` on this instance only."""
        setattr(obj, attr, value)
        self._patched.append((obj, attr))

    def undo(self) -> None:
        """Remove every shadowing attribute (the class's methods show again); idempotent."""
        for obj, attr in self._patched:
            obj.__dict__.pop(attr, None)
        self._patched = []


def _require(obj: Any, attr: str, where: str) -> Callable[..., Any]:
    method = getattr(obj, attr, None)
    if not callable(method):
        raise IncompatibleVersionError(
            f"areal_lightning: this Lightning version has no {where}.{attr}, which auto-resume relies on; "
            "pass ckpt_path=recover_callback.last_checkpoint() to trainer.fit instead")
    return method


def wrap_resume_start(trainer: Any, patch: Patch,
                      make: Callable[[Callable[[Any, Any], None]], Callable[[Any, Any], None]]) -> None:
    """Replace ``trainer._checkpoint_connector.resume_start(checkpoint_path, weights_only)``
    by ``make(original)`` (called with the resolved path right after ``setup``)."""
    connector = trainer._checkpoint_connector
    patch.set(connector, "resume_start", make(_require(connector, "resume_start", "_checkpoint_connector")))


def wrap_train_dataloader(trainer: Any, patch: Patch, make: Callable[[Callable[[], Any]], Callable[[], Any]]) -> None:
    """Replace ``trainer.fit_loop._data_source.dataloader()`` (what builds the train
    loaders, on every reload) by ``make(original)``."""
    source = trainer.fit_loop._data_source
    patch.set(source, "dataloader", make(_require(source, "dataloader", "fit_loop._data_source")))


def loaded_checkpoint(trainer: Any) -> dict[str, Any]:
    """The checkpoint dict Lightning is restoring (``_checkpoint_connector._loaded_checkpoint``)."""
    return trainer._checkpoint_connector._loaded_checkpoint


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """The full checkpoint dict of the run now, as ``trainer.save_checkpoint`` collects it before
    handing it to the strategy (``_checkpoint_connector.dump_checkpoint(weights_only=False)``):
    model, optimizers, schedulers, loops, callback states, the hooks' additions."""
    connector = trainer._checkpoint_connector
    return _require(connector, "dump_checkpoint", "_checkpoint_connector")(weights_only=False)


def train_loaders(trainer: Any) -> list[Any]:
    """The train loaders in use (``fit_loop._combined_loader.flattened``), in Lightning's order."""
    combined = trainer.fit_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def prefetched_batches(trainer: Any) -> int:
    """Batches the train data fetcher fetched ahead and has not yielded (``_data_fetcher.batches``)."""
    return len(getattr(trainer.fit_loop._data_fetcher, "batches", ()))


def user_checkpoint_io(strategy: Any) -> Any:
    """The CheckpointIO plugin the user passed, or ``None`` (``strategy._checkpoint_io``:
    the public ``checkpoint_io`` property creates a default one when there is none)."""
    return strategy._checkpoint_io


def unwrap_checkpoint_io(io: Any) -> Any:
    """``io`` without Lightning's wrappers (``AsyncCheckpointIO`` etc., ``_WrappingCheckpointIO``)."""
    from areal_lightning.namespaces import classes

    while isinstance(io, classes("plugins.io.wrapper._WrappingCheckpointIO")):
        io = io.checkpoint_io
    return io


def fsdp_state_dict_type(strategy: Any) -> str:
    """``FSDPStrategy``'s ``state_dict_type`` (``_state_dict_type``: a constructor argument only)."""
    return strategy._state_dict_type


def set_fsdp_state_dict_type(strategy: Any, value: str) -> None:
    """Set ``FSDPStrategy``'s ``state_dict_type`` after construction."""
    strategy._state_dict_type = value


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """``ModelParallelStrategy``'s ``save_distributed_checkpoint`` (``_save_distributed_checkpoint``)."""
    return bool(strategy._save_distributed_checkpoint)


def set_save_distributed_checkpoint(strategy: Any, value: bool) -> None:
    """Set ``ModelParallelStrategy``'s ``save_distributed_checkpoint`` after construction."""
    strategy._save_distributed_checkpoint = value


def can_redirect_logger(logger: Any) -> bool:
    """Whether ``logger`` keeps its version and experiment where :func:`redirect_logger`
    can change them (``_version``, ``_experiment``: CSV and TensorBoard loggers)."""
    return hasattr(logger, "_version") and hasattr(logger, "_experiment")


def redirect_logger(logger: Any, version: Any) -> None:
    """Close the logger's current experiment and make it log into ``version`` (the next
    access to ``logger.experiment`` opens that version's folder)."""
    close = getattr(logger._experiment, "close", None)
    if callable(close):
        close()
    logger._experiment = None
    logger._version = version


def can_redirect_wandb(logger: Any) -> bool:
    """Whether ``logger`` is a ``WandbLogger`` whose run :func:`redirect_wandb` can change
    (``_wandb_init``, ``_id``, ``_experiment``)."""
    return isinstance(getattr(logger, "_wandb_init", None), dict) and hasattr(logger, "_id") \
        and hasattr(logger, "_experiment")


def redirect_wandb(logger: Any, run_id: str) -> Any:
    """Finish the W&B run this start opened (``logger._experiment``) and make the logger continue
    the run ``run_id`` (``wandb.init(id=run_id, resume="allow")`` at the next access); returns the
    finished run (``None`` if there was none)."""
    run = logger._experiment
    if run is not None:
        run.finish()
    logger._experiment = None
    logger._id = run_id
    logger._wandb_init.update(id=run_id, resume="allow")
    return run


def wrapped_sampler(sampler: Any) -> Any:
    """The user's sampler inside Lightning's ``DistributedSamplerWrapper``
    (``sampler.dataset._sampler``); any other sampler is returned as is."""
    from areal_lightning.namespaces import fabric_classes

    if isinstance(sampler, fabric_classes("utilities.distributed.DistributedSamplerWrapper")):
        return getattr(sampler.dataset, "_sampler", sampler)
    return sampler


def callback_state_key(callback: Any, **kwargs: Any) -> str:
    """The key of ``callback``'s state in a checkpoint, made from ``kwargs`` as Lightning's
    own callbacks make theirs (``Callback._generate_state_key``)."""
    return callback._generate_state_key(**kwargs)


def wrap_step_end(trainer: Any, patch: Patch,
                  make: Callable[[Callable[[Any], None]], Callable[[Any], None]]) -> None:
    """Replace ``trainer.fit_loop.epoch_loop.on_advance_end(data_fetcher)`` by ``make(original)``.
    Lightning calls it after every hook of a batch (each callback's and the module's
    ``on_train_batch_end``, the logger connector); it runs the validation due after the batch,
    the plateau schedulers and the logger flush. Nothing else runs before the next batch."""
    loop = trainer.fit_loop.epoch_loop
    patch.set(loop, "on_advance_end", make(_require(loop, "on_advance_end", "fit_loop.epoch_loop")))


def wrap_epoch_end(trainer: Any, patch: Patch, make: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
    """Replace ``trainer.fit_loop.on_advance_end()`` (the end of an epoch: every
    ``on_train_epoch_end`` in Lightning's order, the epoch-interval schedulers, the epoch
    metrics logged, the epoch counted complete) by ``make(original)``."""
    loop = trainer.fit_loop
    patch.set(loop, "on_advance_end", make(_require(loop, "on_advance_end", "fit_loop")))


def epoch_loop_ends(trainer: Any) -> bool:
    """After a batch's ``on_advance_end``: whether the epoch loop stops now (``fit_loop.epoch_loop.done``:
    the epoch's last batch, ``max_steps`` reached, or a stop requested), so that the epoch's end
    follows before the next step."""
    return bool(trainer.fit_loop.epoch_loop.done)


def continue_after_save_point(trainer: Any, patch: Patch, epoch_end: Callable[[], bool | None]) -> None:
    """Make Lightning continue a checkpoint taken at the save point (after a step's
    ``on_advance_end``, or after an epoch's) with the next step, nothing run twice or skipped.

    Lightning's restart logic (``restarting``, restart stages) expects checkpoints taken inside
    a hook and finishes what followed that hook: after a mid-epoch checkpoint whose step had a
    validation due it skips the next batch's training and runs that step's ``on_advance_end``
    again; after a restart it does not step plateau schedulers at the epoch end; with
    ``max_steps`` an epoch-end checkpoint runs the epoch's end again. ``epoch_end()`` (read when
    the fit loop resets, after the checkpoint's callback states are loaded) says where the
    loaded checkpoint was taken (``None``: not at the save point; Lightning's logic applies).
    Mid-epoch the loops restart (the epoch continues at the saved batch) and then stop
    restarting (``_restarting``) before the next batch; at an epoch end the next epoch
    starts as in a run that never stopped. One-shot wrappers of ``fit_loop.reset`` and
    ``fit_loop.epoch_loop.reset``."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    fit_reset = _require(fit_loop, "reset", "fit_loop")
    epoch_reset = _require(epoch_loop, "reset", "fit_loop.epoch_loop")

    def reset_fit() -> None:
        fit_loop.__dict__.pop("reset", None)
        where = epoch_end()
        if where is None:
            epoch_loop.__dict__.pop("reset", None)
            return fit_reset()
        if where:
            epoch_loop.restarting = False  # and its validation and optimization loops
            fit_loop._restarting = False  # the setter would keep it with max_steps
            epoch_loop.__dict__.pop("reset", None)
            return fit_reset()
        fit_reset()  # restarted mid-epoch: the epoch-start hooks are not run again
        fit_loop._restarting = False  # plateau schedulers step at this epoch's end
        return None

    def reset_epoch() -> None:
        epoch_loop.__dict__.pop("reset", None)
        epoch_reset()  # keeps the epoch's batch counters (restarting)
        epoch_loop.restarting = False  # the next batch trains; its validation is not skipped

    patch.set(fit_loop, "reset", reset_fit)
    patch.set(epoch_loop, "reset", reset_epoch)


def ddp_bucket_layout(model: Any) -> list[list[int]] | None:
    """The gradient buckets ``model`` (a ``DistributedDataParallel``) reduces with: parameter
    indices per bucket, in reduction order, as DDP rebuilt them by gradient-ready order;
    ``None`` for any other module, or a DDP that does not rebuild (static graph, unused
    parameters). Collective (every rank of the DDP group): a DDP that has run one iteration
    but not rebuilt yet (it would at the next forward) is rebuilt now, the same rebuild.
    Uses ``_has_rebuilt_buckets``, ``reducer._rebuild_buckets()``, ``_get_ddp_logging_data()``
    and ``logger.set_runtime_stats_and_log()`` (which refreshes that data)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    if not model._has_rebuilt_buckets and model.reducer._rebuild_buckets():
        model._has_rebuilt_buckets = True
    if not model._has_rebuilt_buckets:
        return None
    text = model._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if text is None:  # the data is refreshed at each forward, before the rebuild
        model.logger.set_runtime_stats_and_log()
        text = model._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not text:
        return None
    return [[int(i) for i in bucket.split()] for bucket in str(text).split(",") if bucket.strip()]


def ddp_forward_sync(model: Any) -> bool | None:
    """Whether ``model`` (a ``DistributedDataParallel``) broadcasts rank 0's buffers at its next
    forward (``require_forward_param_sync``: True when built, then set by each forward from
    whether gradients were synchronized; Lightning's manual optimization leaves it False);
    ``None`` for any other module."""
    from torch.nn.parallel import DistributedDataParallel

    return bool(model.require_forward_param_sync) if isinstance(model, DistributedDataParallel) else None


def set_ddp_forward_sync(model: Any, value: bool) -> None:
    """Set what :func:`ddp_forward_sync` reads (a resumed DDP continues as the saved one would)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model.require_forward_param_sync = bool(value)


def wrap_ddp_setup_model(strategy: Any, patch: Patch, layout: Callable[[], list[list[int]] | None],
                         after: Callable[[Any], None] = lambda ddp: None) -> bool:
    """Make ``DDPStrategy._setup_model`` (where Lightning builds the ``DistributedDataParallel``)
    give the new DDP the bucket layout ``layout()`` returns (read then: after the checkpoint's
    callback states are loaded; ``None``: DDP's own), and call ``after(ddp)`` once the DDP is built
    (its constructor has broadcast rank 0's parameters and buffers). ``False`` for other strategies."""
    import sys

    import torch.distributed as dist
    from areal_lightning.namespaces import classes

    if not isinstance(strategy, classes("strategies.DDPStrategy")):
        return False
    original = _require(strategy, "_setup_model", "DDPStrategy")

    def setup_model(model: Any) -> Any:
        wrapped = build(model)
        after(wrapped)  # before Lightning assigns it to strategy.model
        return wrapped

    def build(model: Any) -> Any:
        buckets = layout()
        if not buckets:
            return original(model)
        assign = dist._compute_bucket_assignment_by_size

        def saved_assignment(params: Any, limits: list[int], *args: Any, **kwargs: Any) -> Any:
            if sorted(i for bucket in buckets for i in bucket) != list(range(len(params))):
                return assign(params, limits, *args, **kwargs)  # another model: DDP's own layout
            return list(reversed(buckets)), [limits[-1] if limits else sys.maxsize] * len(buckets)  # DDP reverses

        dist._compute_bucket_assignment_by_size = saved_assignment
        try:
            return original(model)
        finally:
            dist._compute_bucket_assignment_by_size = assign

    patch.set(strategy, "_setup_model", setup_model)
    return True


def cluster_environment(trainer: Any) -> Any:
    """The Trainer's ``ClusterEnvironment`` plugin (``_accelerator_connector.cluster_environment``),
    also for single-device strategies, which do not expose it."""
    env = getattr(trainer.strategy, "cluster_environment", None)
    return env if env is not None else getattr(trainer._accelerator_connector, "cluster_environment", None)


def train_epoch_metrics(trainer: Any) -> dict[str, dict[str, Any]]:
    """The epoch accumulators of the values logged in training with ``on_epoch=True``
    (``fit_loop.epoch_loop._results``: ``_ResultMetric.value`` and, for means,
    ``cumulated_batch_size``), as CPU tensors keyed like Lightning keys them."""
    out: dict[str, dict[str, Any]] = {}
    for key, metric in trainer.fit_loop.epoch_loop._results.items():
        meta = getattr(metric, "meta", None)
        if not getattr(metric, "is_tensor", False) or meta is None or not meta.on_epoch:
            continue  # a torchmetrics.Metric logged by the user keeps its own state
        entry = {"value": metric.value.detach().cpu().clone()}
        if meta.is_mean_reduction:
            entry["cumulated_batch_size"] = metric.cumulated_batch_size.detach().cpu().clone()
        out[key] = entry
    return out


def continue_train_epoch_metrics(trainer: Any, saved: dict[str, dict[str, Any]]) -> None:
    """After a mid-epoch resume, at a batch end: fold the saved accumulators into the metrics
    the resumed epoch created since (each has seen one batch: ``0 + x`` is ``x`` exactly, so
    ``saved + x`` is the uninterrupted run's sum bit for bit). Applied keys leave ``saved``."""
    results = trainer.fit_loop.epoch_loop._results
    for key in [k for k in saved if k in results]:
        entry, metric = saved.pop(key), results[key]
        value = entry["value"].to(metric.value.device, metric.value.dtype)
        if metric.meta.is_max_reduction or metric.meta.is_min_reduction:
            metric.value = metric.meta.reduce_fx(value, metric.value)
        else:
            metric.value = value + metric.value
        if "cumulated_batch_size" in entry and metric.meta.is_mean_reduction:
            metric.cumulated_batch_size = entry["cumulated_batch_size"].to(metric.cumulated_batch_size.device) \
                + metric.cumulated_batch_size
