"""The strategy bridge: every rank writes its own shard through ``DCPCheckpointIO``.

Lightning's base ``Strategy.save_checkpoint`` calls the ``CheckpointIO`` on global rank 0
only, and ``FSDPStrategy`` (sharded) / ``ModelParallelStrategy`` bypass the ``CheckpointIO``
and call DCP themselves. :func:`install_bridge` replaces the strategy instance's
``save_checkpoint`` and ``load_checkpoint`` so that, for every strategy,

* **every rank** calls :class:`~areal_lightning.lightning.checkpoint_io.DCPCheckpointIO` with its own
  state, as one collective DCP save: replicated (DDP) tensors are written once, spread over
  the ranks by DCP's de-duplication; sharded (FSDP1 ``ShardedTensor``/``DTensor``, FSDP2
  ``DTensor``) tensors are written by the rank that holds each shard -- no rank gathers the
  full model. The non-tensor part of the checkpoint is written by rank 0 only.
* **loads** are rank-local reads of the shared directory into a template (each rank
  verifies the checksum of every item it reads; a failure on one rank is raised on all): the live sharded
  model and optimizer state for FSDP / ModelParallel (so DCP reshards to the current world
  size), freshly allocated tensors otherwise. For sharded strategies the loaded model and
  optimizer states are applied with torch's ``set_model_state_dict`` /
  ``set_optimizer_state_dict`` (those strategies' own ``load_model_state_dict`` are no-ops).

The bridge is installed by :class:`~areal_lightning.RecoverCallback` and
:class:`~areal_lightning.StagingWaitCallback` in their ``setup`` -- users keep writing
``Trainer(strategy="ddp" | "fsdp" | ModelParallelStrategy(...), ...)``. It switches FSDP to
``state_dict_type="sharded"`` and ``ModelParallelStrategy`` to
``save_distributed_checkpoint=True`` (a full-state gather on rank 0 is what it avoids).

A replicated tensor that is not equal on every rank (BatchNorm statistics, buffers a user
keeps per rank) is found at each save by fingerprint and stored per rank, and each rank reads
its own copy back (:mod:`areal_lightning.write.replicas`); other per-rank state goes under
per-rank keys (``RecoverCallback`` gathers RNG and dataloader positions into ``per_rank``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Optional, Union

from lightning.pytorch.strategies import Strategy

from areal_lightning.layout import new_token
from areal_lightning.lightning._internals import (
    fsdp_state_dict_type,
    saves_distributed_checkpoint,
    set_fsdp_state_dict_type,
    set_save_distributed_checkpoint,
)
from areal_lightning.namespaces import classes

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["install_bridge", "bridged", "is_bridged", "is_sharded", "warn_if_single_fsdp_unit",
           "SHARDED_STRATEGY_NAMES"]

_FSDP = classes("strategies.FSDPStrategy")
_MODEL_PARALLEL = classes("strategies.ModelParallelStrategy")
_SHARDED = _FSDP + _MODEL_PARALLEL
SHARDED_STRATEGY_NAMES = ("FSDPStrategy", "ModelParallelStrategy")
"""Class names of the sharded strategies (as recorded in ``checkpoint_info.json``)."""


def is_sharded(strategy: Strategy) -> bool:
    """Whether the strategy shards parameters (FSDP1 or ModelParallel/FSDP2)."""
    return isinstance(strategy, _SHARDED)


def is_bridged(strategy: Strategy) -> bool:
    """Whether :func:`install_bridge` was applied to this strategy instance."""
    return strategy.__dict__.get("_areal_bridge") is not None


def _sharded_template(strategy: Strategy) -> dict[str, Any]:
    """The live sharded model and optimizer states, keyed as Lightning's checkpoint is."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = strategy.model
    return {
        "state_dict": get_model_state_dict(model),
        "optimizer_states": [get_optimizer_state_dict(model, opt) for opt in strategy.optimizers],
    }


def _apply_sharded(strategy: Strategy, checkpoint: dict[str, Any]) -> None:
    """Load model and optimizer states into the sharded model (the template was filled in
    place; ``set_*_state_dict`` also covers copies made by ``cpu_offload``)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    strict = bool(getattr(strategy.lightning_module, "strict_loading", True))
    model = strategy.model
    set_model_state_dict(model, checkpoint["state_dict"], options=StateDictOptions(strict=strict))
    states = checkpoint.get("optimizer_states", [])
    for opt, state in zip(strategy.optimizers, states):
        set_optimizer_state_dict(model, opt, optim_state_dict=state)


def warn_if_single_fsdp_unit(strategy: Strategy) -> None:
    """FSDP1 state dicts unshard one FSDP unit at a time: a model wrapped as one unit is
    unsharded whole, on every GPU, at every save and export. Call once the model is wrapped
    (``on_fit_start``)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(strategy, _FSDP) or not isinstance(strategy.model, FullyShardedDataParallel):
        return
    if len(FullyShardedDataParallel.fsdp_modules(strategy.model)) == 1:
        rank_zero_warn("FSDPStrategy without auto_wrap_policy: the whole model is one FSDP unit, so every recover "
                       "checkpoint and HF export unshards all of it (weights and optimizer state) on every GPU. "
                       "Pass FSDPStrategy(auto_wrap_policy={YourDecoderLayer}) to unshard one layer at a time.")


_METHODS = ("save_checkpoint", "load_checkpoint", "_areal_bridge")


def _per_rank_settings(strategy: Strategy, quiet: bool) -> list[Callable[[], None]]:
    """Switch FSDP / ModelParallel to per-rank (sharded) state dicts; the undo functions."""
    undo: list[Callable[[], None]] = []
    level = logging.DEBUG if quiet else logging.INFO
    if isinstance(strategy, _FSDP) and fsdp_state_dict_type(strategy) != "sharded":
        previous = fsdp_state_dict_type(strategy)
        log.log(level, "areal_lightning: FSDPStrategy state_dict_type=%r -> 'sharded' (each rank writes its shard)",
                previous)
        set_fsdp_state_dict_type(strategy, "sharded")
        undo.append(lambda: set_fsdp_state_dict_type(strategy, previous))
    if isinstance(strategy, _MODEL_PARALLEL) and not saves_distributed_checkpoint(strategy):
        log.log(level, "areal_lightning: ModelParallelStrategy save_distributed_checkpoint -> True "
                "(each rank writes its shard)")
        set_save_distributed_checkpoint(strategy, True)
        undo.append(lambda: set_save_distributed_checkpoint(strategy, False))
    return undo


@contextlib.contextmanager
def bridged(strategy: Strategy, io: Any) -> Iterator[None]:
    """The bridge for the duration of one save or load (``RecoverCallback``'s own checkpoints
    when the user's go through their own CheckpointIO): within, ``strategy`` saves and loads
    as :func:`install_bridge` makes it; after, the strategy is as the user configured it
    (their ``ModelCheckpoint`` keeps writing Lightning's files, FSDP its ``state_dict_type``).
    A strategy already bridged (the user passed ``DCPCheckpointIO``) is left as it is."""
    if is_bridged(strategy):
        yield
        return
    prior = {name: strategy.__dict__[name] for name in _METHODS if name in strategy.__dict__}
    undo = _per_rank_settings(strategy, quiet=True)
    _bridge(strategy, io)
    try:
        yield
    finally:
        for name in _METHODS:
            strategy.__dict__.pop(name, None)
        strategy.__dict__.update(prior)
        for fn in reversed(undo):
            fn()


def install_bridge(strategy: Strategy, io: Any) -> None:
    """Make ``strategy`` save and load every rank's own state through ``io`` (a
    :class:`~areal_lightning.lightning.checkpoint_io.DCPCheckpointIO`) for the rest of its
    life: the user's checkpoints too. Idempotent; see the module doc."""
    if strategy.__dict__.get("_areal_bridge") is io:
        return
    _per_rank_settings(strategy, quiet=False)
    _bridge(strategy, io)


def _bridge(strategy: Strategy, io: Any) -> None:
    sharded = is_sharded(strategy)

    def common_path(path: PathLike, what: str, repair: bool = False) -> str:
        """Rank 0's path, agreed by every rank; with ``repair``, rank 0 first finishes an
        interrupted save to it (its failure is raised on every rank)."""
        if strategy.world_size == 1:
            if repair:
                io.repair(path)
            return str(path)
        error: BaseException | None = None
        try:
            if repair and strategy.is_global_zero:
                io.repair(path)
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            error = exc
        return str(io.engine.ranks.agree(error, what, str(path))[0])

    def save_checkpoint(checkpoint: dict[str, Any], filepath: PathLike, storage_options: Optional[Any] = None) -> None:
        token = None
        if strategy.world_size > 1:  # one atomic directory for all ranks: rank 0's path and commit token
            filepath, token = io.engine.ranks.agree(None, "checkpoint path", (str(filepath), new_token()))[0]
        io.save_checkpoint(checkpoint, filepath, storage_options=storage_options, token=token)

    def load_checkpoint(checkpoint_path: PathLike, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # Every rank first waits for its own save in flight: rank 0 alone renames a finished
        # save into place, and the agreement below lets no rank read before it did.
        io.engine.wait_quietly(checkpoint_path)
        path = str(checkpoint_path) if io.own_paths else common_path(checkpoint_path, "checkpoint load", repair=True)
        # the sharded template is made on every rank first (collective under FSDP1)
        template = {"template": _sharded_template(strategy)} if sharded else {}
        error: BaseException | None = None
        checkpoint: dict[str, Any] = {}
        try:
            checkpoint = io.load_checkpoint(path, weights_only=weights_only, **template)
        except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
            if strategy.world_size == 1:
                raise
            error = exc
        if strategy.world_size > 1:
            # Each rank verified what it read (e.g. rank 1 alone reads its FSDP shards): a
            # damaged file stops every rank here, before the next collective (FSDP's load hooks).
            io.engine.ranks.agree(error, f"checkpoint load of {path}")
        if sharded:
            _apply_sharded(strategy, checkpoint)
        return checkpoint

    strategy.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
    strategy.load_checkpoint = load_checkpoint  # type: ignore[method-assign]
    strategy.__dict__["_areal_bridge"] = io
    io.enable_collective()
    log.debug("areal_lightning: bridge installed on %s", type(strategy).__name__)

