"""``HFSaverCallback``: export the model in HuggingFace format on epoch / step / seconds triggers."""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl

from areal_lightning.errors import ConfigTypeError, UnsupportedModelError
from areal_lightning.capture.compiled import uncompiled
from areal_lightning.capture.hf_weights import fsdp1_root
from areal_lightning.capture.peft_weights import check_exportable, is_peft, unnamed_bases
from areal_lightning.collective import (
    DEFAULT_TIMEOUT_S,
    CheckpointGroup,
    validate_timeout,
)
from areal_lightning.commit.atomic import clean_stale_tmp
from areal_lightning.commit.retention import keep_newest, keep_newest_remote
from areal_lightning.commit.upload import clean_uncommitted_exports, committed_exports, folder_bytes_remote
from areal_lightning.config import (
    DEFAULT_SHARDED_METHOD,
    ConfigError,
    ExperimentConfig,
    SaverConfig,
    as_experiment,
    validate_model_name,
)
from areal_lightning.hf_export import HFExporter, validate_method, validate_peft_export
from areal_lightning.layout import TrialLayout
from areal_lightning.objectstore import is_remote, is_uri, probe, retries
from areal_lightning.lightning._internals import callback_state_key
from areal_lightning.lightning.checkpoint_io import checkpoints_through_dcp
from areal_lightning.namespaces import bases
from areal_lightning.telemetry import SaveReport, Telemetry, folder_bytes
from areal_lightning.trigger import EpochPosition, FreqController, StepGate
from areal_lightning.write.hf import DEFAULT_MAX_SHARD_SIZE

__all__ = ["HFSaverCallback"]

log = logging.getLogger(__name__)

ModelAttr = str | Callable[["pl.LightningModule"], Any]


class HFSaverCallback(*bases("callbacks.Callback")):  # type: ignore[misc]
    """Export a ``transformers.PreTrainedModel`` held by the LightningModule, HuggingFace style.

    Exports land in
    ``{fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}/{name}/epoch{E}epochstep{S}globalstep{G}/``
    (0-based indices) and load with ``AutoModelForCausalLM.from_pretrained`` /
    ``AutoTokenizer.from_pretrained``. A folder with that name is always complete: it is
    written aside, fsynced and renamed into place.

    Modes: ``sync`` writes in the training thread. ``async`` copies the weights to reused
    host buffers (pinned on GPU) -- the only time the training loop is held -- and writes
    safetensors, config and tokenizer in a background thread; one export in flight, the
    next save waits for it, and a background failure is raised at the next save or at fit
    end. ``auto`` is async when the run checkpoints through :class:`DCPCheckpointIO`, else sync. The same global step is never exported
    twice. The trigger progress is part of Lightning's callback state, so a resumed run
    neither double-saves nor skips a save.

    Multi-process runs (see :mod:`areal_lightning.hf_export`): every rank takes part in
    each export and the files are written once, by rank 0. Under DDP rank 0 exports its
    replica. Under FSDP2 / tensor parallelism (``DTensor`` parameters) no rank gathers the
    model on its accelerator: ``sharded_method="gather"`` streams full tensors one at a time
    to rank 0's host memory and writes with ``save_pretrained``; ``"dcp"`` has every rank
    write its shards with DCP's ``HuggingFaceStorageWriter`` and rank 0 consolidate them.
    Before each export, all ranks wait for their export in flight and agree it succeeded;
    a failure on any rank is raised on every rank.

    Args:
        fileroot: the root folder of all checkpoints (``{fileroot}/checkpoints/{user}/...``).
        experiment_name: the experiment's folder under ``fileroot``.
        trial_name: the trial's folder under the experiment.
        user: the user folder (``None``: the OS user).
        name: the model's folder name (one callback per exported model, e.g. ``"critic"``).
        mode: ``"auto"``, ``"sync"`` or ``"async"``.
        freq_epochs: export every N epochs (any enabled trigger fires an export).
        freq_steps: export every N optimizer steps.
        freq_secs: export when N seconds passed since the last export.
        max_keep: keep only the newest N exports of this model (``None``: keep all).
        model_attr: attribute name (dots allowed) of the LightningModule holding the
            ``PreTrainedModel``, or a callable ``module -> PreTrainedModel``.
        tokenizer: a tokenizer to save with each export; else the module's ``tokenizer``
            attribute when present.
        max_shard_size: safetensors shard threshold (``"5GB"``, or bytes).
        sharded_method: ``"gather"`` (default) or ``"dcp"``: how sharded (``DTensor``) weights
            are exported in a multi-process run.
        collective_timeout: seconds each export's agreement and collectives wait for the
            other ranks before every rank raises (multi-process runs).
        peft_export: for a ``peft.PeftModel``: ``"adapter"`` (default: what ``PeftModel.save_pretrained``
            writes, small, loaded with ``AutoPeftModelForCausalLM``), ``"merged"`` (full weights with the
            adapters merged in, loaded with ``AutoModelForCausalLM``: what an inference engine takes) or
            ``"both"`` (merged in the folder, the adapter in its ``adapter/`` subfolder). ``"adapter"``
            over a base with no ``base_model_name_or_path`` (built from a config) is refused at setup:
            its export would not load on its own.
        storage_options: options of the object-store file system when ``fileroot`` is an
            ``s3://`` / ``gs://`` / ``az://`` URI (credentials otherwise come from the standard
            provider chain). On an object store each export is written to ``staging_dir``,
            uploaded in parallel and committed by a ``COMMITTED.json`` marker written last;
            :func:`areal_lightning.download_export` fetches one for ``from_pretrained``.
        staging_dir: the node-local folder object-store exports are written in first
            (default ``$TMPDIR/areal-lightning-staging``).

    Example:
        >>> saver = HFSaverCallback(fileroot="/tmp/ckpt", experiment_name="exp", trial_name="t0",
        ...                         freq_steps=100, max_keep=3)
        >>> trainer = pl.Trainer(callbacks=[saver])  # doctest: +SKIP
    """

    def __init__(
        self,
        fileroot: str | Path,
        experiment_name: str,
        trial_name: str,
        user: str | None = None,
        name: str = "default",
        mode: str = "auto",
        freq_epochs: int | None = None,
        freq_steps: int | None = None,
        freq_secs: int | None = None,
        max_keep: int | None = None,
        model_attr: ModelAttr = "model",
        tokenizer: Any = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        sharded_method: str = DEFAULT_SHARDED_METHOD,
        collective_timeout: float = DEFAULT_TIMEOUT_S,
        peft_export: str = "adapter",
        storage_options: dict[str, Any] | None = None,
        staging_dir: str | Path | None = None,
    ) -> None:
        exp = ExperimentConfig(
            fileroot=fileroot,  # type: ignore[arg-type]
            experiment_name=experiment_name,
            trial_name=trial_name,
            user=user,
            storage_options=storage_options,
            saver=SaverConfig(
                mode=mode, freq_epochs=freq_epochs, freq_steps=freq_steps, freq_secs=freq_secs, max_keep=max_keep
            ),
        ).validate()
        self.name = validate_model_name(name, "name")
        if not (callable(model_attr) or (isinstance(model_attr, str) and model_attr.strip())):
            raise ConfigError("model_attr", f"expected an attribute name or a callable, got {model_attr!r}")
        if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (int, str)):
            raise ConfigError("max_shard_size", f"expected bytes (int) or a size string like '5GB', got {max_shard_size!r}")
        validate_method(sharded_method, "sharded_method")
        self.collective_timeout = validate_timeout(collective_timeout)
        self.ranks = CheckpointGroup(self.collective_timeout)
        """The dedicated gloo group of this callback's collectives (shared with its exporter)."""
        self.config: SaverConfig = exp.saver
        remote = is_remote(exp.fileroot)
        self.layout = TrialLayout(exp.fileroot if remote else Path(exp.fileroot), exp.resolved_user,
                                  exp.experiment_name, exp.trial_name)
        self.storage_options = exp.storage_options or {}
        if staging_dir is not None and (not isinstance(staging_dir, (str, os.PathLike)) or is_uri(staging_dir)):
            raise ConfigError("staging_dir", f"expected a local folder path or None, got {staging_dir!r}")
        self.staging_dir = Path(staging_dir) if staging_dir is not None else None
        if remote and sharded_method == "dcp":
            raise ConfigError("sharded_method", "'dcp' writes every rank's shards into one shared folder that rank 0 "
                                                "then consolidates; with an object-store fileroot use 'gather' (the "
                                                "default: rank 0 stages the export locally and uploads it)")
        self.model_attr = model_attr
        self.tokenizer = tokenizer
        self.max_shard_size = max_shard_size
        self.sharded_method = sharded_method
        self.peft_export = validate_peft_export(peft_export)
        self.freq = FreqController(self.config.freq_epochs, self.config.freq_steps, self.config.freq_secs)
        self.gate = StepGate(self.freq)
        self.position = EpochPosition()
        self.last_export: Path | None = None
        self.resolved_mode: str | None = None
        self._exporter: HFExporter | None = None  # made at the first save, once every callback's setup ran
        self.telemetry = Telemetry()

    # -- construction from config ---------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: Any, strict: bool = True, **kwargs: Any) -> "HFSaverCallback":
        """Build from a whole experiment config (YAML path, dict, dataclass or ``DictConfig``).

        Uses the top-level ``fileroot`` / ``experiment_name`` / ``trial_name`` / ``user`` and
        the ``saver:`` section; ``kwargs`` (``name``, ``model_attr``, ``tokenizer``,
        ``max_shard_size``, ``sharded_method``, ``peft_export``) are passed through. ``strict=False`` ignores
        unknown top-level keys (for configs that also hold your model and data settings).

        Example:
            >>> HFSaverCallback.from_config({"fileroot": "/tmp/x", "experiment_name": "e",
            ...     "trial_name": "t", "saver": {"freq_epochs": 1}}).config.freq_epochs
            1
        """
        exp = as_experiment(cfg, strict)
        s = exp.saver
        return cls(
            fileroot=exp.fileroot,
            experiment_name=exp.experiment_name,
            trial_name=exp.trial_name,
            user=exp.user,
            mode=s.mode,
            freq_epochs=s.freq_epochs,
            freq_steps=s.freq_steps,
            freq_secs=s.freq_secs,
            max_keep=s.max_keep,
            storage_options=kwargs.pop("storage_options", exp.storage_options),
            **kwargs,
        )

    # -- Lightning plumbing ----------------------------------------------------------------

    @property
    def state_key(self) -> str:
        """Unique per exported model, so several savers can coexist in one Trainer."""
        return callback_state_key(self, name=self.name)

    @property
    def model_dir(self) -> Path:
        """The folder holding this model's exports."""
        return self.layout.model_dir(self.name)

    def resolve_model(self, pl_module: "pl.LightningModule") -> Any:
        """The model named by ``model_attr`` (a ``PreTrainedModel`` or ``peft.PeftModel``, unwrapped from
        ``torch.compile``); ``TypeError`` otherwise."""
        from transformers import PreTrainedModel

        if callable(self.model_attr):
            model = self.model_attr(pl_module)
            where = f"model_attr callable {self.model_attr!r}"
        else:
            try:
                model = functools.reduce(getattr, self.model_attr.split("."), pl_module)
            except AttributeError:
                raise ConfigTypeError(
                    "model_attr", f"HFSaverCallback(name={self.name!r}): {type(pl_module).__name__} has no attribute "
                    f"{self.model_attr!r}; set model_attr to the attribute holding the PreTrainedModel "
                    "or to a callable module -> PreTrainedModel"
                ) from None
            where = f"attribute {self.model_attr!r}"
        model = uncompiled(model)  # torch.compile's OptimizedModule: the model it wraps
        if is_peft(model):
            try:
                check_exportable(model, merged=self.peft_export != "adapter")
            except TypeError as exc:
                raise UnsupportedModelError(f"HFSaverCallback(name={self.name!r}): {where} of {type(pl_module).__name__}: "
                                f"{exc}") from None
            unnamed = unnamed_bases(model) if self.peft_export == "adapter" else []
            if unnamed:
                raise ConfigError(
                    "peft_export", f"HFSaverCallback(name={self.name!r}): 'adapter' (the default) for the PeftModel at {where} of "
                    f"{type(pl_module).__name__}, whose adapter {', '.join(map(repr, unnamed))} has no "
                    "base_model_name_or_path (a base built from a config or in code): its adapter export would not "
                    "load with AutoPeftModelForCausalLM.from_pretrained (it would look for a base named None on "
                    "the Hub). Use peft_export='merged' or 'both' (full weights that load on their own with "
                    "AutoModelForCausalLM), or save the base with save_pretrained and set "
                    "peft_config[adapter].base_model_name_or_path to its path or Hub id"
                )
        elif not isinstance(model, PreTrainedModel):
            raise UnsupportedModelError(
                f"HFSaverCallback(name={self.name!r}): {where} of {type(pl_module).__name__} is a "
                f"{type(model).__name__}, not a transformers.PreTrainedModel (supported: a PreTrainedModel or a "
                "peft.PeftModel, also torch.compile'd)"
            )
        return model

    def resolve_tokenizer(self, pl_module: "pl.LightningModule") -> Any:
        """The tokenizer given to ``__init__``, else the module's ``tokenizer`` attribute, else ``None``."""
        return self.tokenizer if self.tokenizer is not None else getattr(pl_module, "tokenizer", None)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        self.resolve_model(pl_module)  # fail before training, not at the first save
        if self.layout.remote:  # every rank can write, read and delete in the bucket, or all raise now
            error: BaseException | None = None
            try:
                if trainer.is_global_zero:
                    probe(str(self.model_dir), self.storage_options, trainer.global_rank)
            except BaseException as exc:  # noqa: BLE001 - raised on every rank by the agreement
                error = exc
            self.ranks.agree(error, "HFSaverCallback setup (object-store check)")
        self.resolved_mode = None  # resolved at the first save, once every callback's setup ran
        self.freq.start()

    def _resolve_mode(self, trainer: "pl.Trainer") -> str:
        """``auto`` is async when the run checkpoints through ``DCPCheckpointIO`` (the Trainer's,
        or an enabled ``RecoverCallback``'s), else sync."""
        mode = self.config.mode
        if mode == "auto":
            return "async" if checkpoints_through_dcp(trainer) else "sync"
        return mode

    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Wait for the export in flight; raise its failure (never swallowed). In a
        multi-process run all ranks agree first, so a failure is raised on every rank."""
        self._close_exporter(raise_failure=True, agree=True)
        self.telemetry.flush(trainer)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        """Let the export in flight finish (or fail, logged) while the original error propagates;
        end the gloo groups (Lightning calls no ``teardown`` hook after an exception)."""
        try:
            self._close_exporter(raise_failure=False)
        finally:
            self.ranks.close()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        try:
            self._close_exporter(raise_failure=True)
        finally:
            self.ranks.close()  # after the last collective of the fit: ends the gloo groups' threads

    def _close_exporter(self, raise_failure: bool, agree: bool = False) -> None:
        exporter, self._exporter = self._exporter, None
        if exporter is not None:
            exporter.close(agree=agree, raise_failure=raise_failure)

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """After a resume at an epoch boundary Lightning skips ``on_train_epoch_start``; a
        resumed run exports again the export of its own step that the crash lost."""
        self.position.train_started(trainer)
        self._export_lost_at_resume(trainer, pl_module)

    def _export_lost_at_resume(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """The checkpoint a run resumed from records an export of that very step (its trigger
        fired, so it will not fire again) which is not there: the run was killed while that
        export, written in the background, was not yet in place. Export it now, from the
        weights of that step (the ones just restored), under its name. Rank 0 decides; every
        rank takes part in the export."""
        steps, last = trainer.global_step, self.last_export
        lost = False
        if steps > 0 and last is not None and trainer.is_global_zero:
            name = self.layout.export_dir(self.name, trainer.current_epoch, self.position.epoch_step(steps), steps - 1)
            if str(name) == str(last):
                if is_remote(str(last)):
                    lost = str(last) not in {uri for _, uri in committed_exports(str(self.model_dir),
                                                                                 self.storage_options)}
                else:
                    lost = not Path(last).is_dir()
        if self.ranks.agree(None, "HF export lost at the resumed step", lost)[0]:
            log.warning("HFSaverCallback: the export %s of the step this run resumed from is missing (the run was "
                        "stopped while it was written): exporting it again", last)
            self.save(trainer, pl_module)

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.position.epoch_started(trainer)

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.gate.new_step(trainer.global_step):
            return  # no optimizer step in this batch (gradient accumulation)
        if self.gate.due(trainer.global_step, self.ranks, "HF export seconds trigger"):
            self.save(trainer, pl_module)
        self.telemetry.flush(trainer)

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.gate.at_epoch_end(trainer.current_epoch + 1, trainer.global_step):
            self.save(trainer, pl_module)
        self.telemetry.flush(trainer)

    # -- saving ----------------------------------------------------------------------------

    def save(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Path | None:
        """Export now, named after the last completed step; return the folder (rank 0) or ``None``.

        In a multi-process run this is collective: every rank must call it (the triggers
        do); rank 0 writes and returns the folder, the other ranks return ``None``."""
        steps = trainer.global_step
        if steps <= 0:
            return None
        self.freq.mark_fired(steps)
        final = self.layout.export_dir(self.name, trainer.current_epoch, self.position.epoch_step(steps), steps - 1)
        start = time.perf_counter()
        if self._exporter is None:
            if self.resolved_mode is None:
                self.resolved_mode = self._resolve_mode(trainer)
            self._exporter = HFExporter(method=self.sharded_method, asynchronous=self.resolved_mode == "async",
                                        max_shard_size=self.max_shard_size, name=self.name, ranks=self.ranks,
                                        peft_export=self.peft_export, storage_options=self.storage_options,
                                        staging=self.staging_dir)

        def published(path: Path, blocked: float | None) -> None:
            self._published(path, start, steps, blocked)

        out = self._exporter.export(self.resolve_model(pl_module), final, self.resolve_tokenizer(pl_module),
                                    on_published=published, fsdp_root=fsdp1_root(trainer.strategy.model))
        if out is not None:
            self.last_export = out
        return out

    def _published(self, final: Path, start: float, step: int, blocked: float | None) -> None:
        """Rank 0, once ``final`` is in place: telemetry, ``max_keep`` pruning, stale temp cleanup."""
        total = time.perf_counter() - start
        remote = self.layout.remote
        size = folder_bytes_remote(str(final), self.storage_options) if remote else folder_bytes(final)
        self.telemetry.record(SaveReport("hf", step, str(final), total if blocked is None else blocked, total, size,
                                         retries=retries() if remote else None))
        if remote:
            keep_newest_remote(str(self.model_dir), self.config.max_keep, self.storage_options)
            clean_uncommitted_exports(str(self.model_dir), self.storage_options)
        else:
            keep_newest(self.layout, self.name, self.config.max_keep)
            clean_stale_tmp(self.model_dir)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Trigger progress, the current epoch's first step and the last export (JSON-friendly)."""
        return {
            "freq": self.freq.state_dict(),
            **self.position.state_dict(),
            "last_export": str(self.last_export) if self.last_export else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore progress; the current config's frequencies stay in force."""
        self.freq.load_state_dict(state_dict.get("freq", {}))
        self.position.load_state_dict(state_dict)
        last = state_dict.get("last_export")
        self.last_export = (last if is_remote(last) else Path(last)) if last else None
