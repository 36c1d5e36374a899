"""Typed configuration: dataclasses usable as omegaconf structured configs, with validation.

Every config can be built from a YAML file, a ``dict``, a dataclass or a ``DictConfig``,
plus dotlist overrides (``saver.freq_steps=10``)::

    from areal_lightning import load_config
    cfg = load_config("configs/demo.yaml", overrides=["recover.mode=on"])

Validation raises :class:`ConfigError` naming the field (``saver.freq_steps``) and the
allowed values. YAML 1.1 reads ``mode: on`` / ``mode: off`` as booleans; for ``mode``
fields ``True`` means ``"on"`` and ``False`` means ``"off"``.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
import signal
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf

from areal_lightning.errors import ConfigError
from areal_lightning.layout import RESERVED_NAMES
from areal_lightning.objectstore import check_path, validate_options

__all__ = [
    "ConfigError",
    "SaverConfig",
    "RecoverConfig",
    "ExperimentConfig",
    "load_config",
    "validate_name",
]

IO_MODES = ("auto", "sync", "async")
"""How a save runs: ``sync`` (in the training thread) or ``async`` (host copy, then a background
write); the modes of ``DCPCheckpointIO``, ``RecoverCallback(io_mode=...)`` and ``HFSaverCallback``.
What ``auto`` picks: for DCP saves, async where this build can run background collectives
(else sync, with a warning); for HF exports, async when the run checkpoints through
``DCPCheckpointIO`` (it opted into async checkpointing), else sync. (``recover.mode: auto``
is another setting: it means ``on``, see :data:`RECOVER_MODES`.)"""
SAVER_MODES = IO_MODES

ASYNC_EXECUTORS = ("thread", "process")
"""Where async saves are written (``DCPCheckpointIO`` / ``RecoverCallback`` ``async_executor``)."""


def check_async_executor(value: Any, field_name: str = "async_executor") -> str:
    """Validate an ``async_executor`` value (one of :data:`ASYNC_EXECUTORS`)."""
    if value not in ASYNC_EXECUTORS:
        raise ConfigError(field_name, f"unknown executor {value!r}; allowed: {', '.join(ASYNC_EXECUTORS)}")
    return value
SHARDED_METHODS = ("gather", "dcp")
"""How ``HFSaverCallback`` exports sharded weights (see :mod:`areal_lightning.hf_export`)."""
DEFAULT_SHARDED_METHOD = "gather"
RECOVER_MODES = ("on", "auto", "off", "disabled")
"""``on`` / ``auto``: save and resume; ``off`` / ``disabled``: neither."""

T = TypeVar("T")


def validate_model_name(value: Any, field_name: str = "name") -> str:
    """Validate a model folder name: a :func:`validate_name` that is not reserved.

    ``recover_info`` (the metadata folder) and names starting with ``.`` (temporary
    folders) are reserved.
    """
    validate_name(value, field_name)
    if value in RESERVED_NAMES or value.startswith("."):
        raise ConfigError(field_name, f"{value!r} is reserved (recover_info and names starting with '.')")
    return value


def validate_name(value: Any, field_name: str) -> str:
    """Return ``value`` if it is a usable single path component, else raise :class:`ConfigError`.

    A name must be a non-empty string without ``/``, ``\\`` or ``..`` (it becomes a folder).
    """
    if not isinstance(value, str):
        raise ConfigError(field_name, f"expected a non-empty string, got {type(value).__name__} {value!r}")
    if not value.strip():
        raise ConfigError(field_name, "must be a non-empty name")
    if "/" in value or "\\" in value or ".." in value or value in (".",):
        raise ConfigError(
            field_name, f"{value!r} is not allowed: a name must not contain '/', '\\' or '..' (it becomes one folder)"
        )
    return value


def _positive_int(value: Any, field_name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            field_name, f"expected a positive integer or null (disabled), got {type(value).__name__} {value!r}"
        )
    if value <= 0:
        raise ConfigError(field_name, f"expected a positive integer or null (disabled), got {value}")
    return value


def _mode(value: Any, field_name: str, allowed: Sequence[str]) -> str:
    # YAML 1.1 (PyYAML, omegaconf) reads `on`/`off`/`yes`/`no` as booleans.
    if isinstance(value, bool):
        value = "on" if value else "off"
    if not isinstance(value, str) or value.lower() not in allowed:
        raise ConfigError(field_name, f"unknown mode {value!r}; allowed: {', '.join(allowed)}")
    return value.lower()


@dataclass
class SaverConfig:
    """When and how :class:`~areal_lightning.HFSaverCallback` exports HuggingFace checkpoints.

    A save happens when ANY enabled trigger holds; ``None`` disables a trigger.

    Attributes:
        mode: ``"auto"`` (async where supported, else sync), ``"sync"`` or ``"async"``.
        freq_epochs: export at the end of every N-th epoch.
        freq_steps: export after every N-th optimizer step (global step multiple of N).
        freq_secs: export when N seconds (monotonic clock) have passed since the last export.
        max_keep: keep only the newest N exports; ``None`` keeps all.

    Example:
        >>> SaverConfig(freq_steps=100, max_keep=3).validate().mode
        'auto'
    """

    mode: str = "auto"
    freq_epochs: int | None = None
    freq_steps: int | None = None
    freq_secs: int | None = None
    max_keep: int | None = None

    def validate(self, prefix: str = "saver") -> "SaverConfig":
        """Check every field; normalise ``mode``. Returns ``self``."""
        self.mode = _mode(self.mode, f"{prefix}.mode", SAVER_MODES)
        for name in ("freq_epochs", "freq_steps", "freq_secs", "max_keep"):
            _positive_int(getattr(self, name), f"{prefix}.{name}")
        return self

    @property
    def enabled(self) -> bool:
        """True when at least one trigger is set."""
        return any(f is not None for f in (self.freq_epochs, self.freq_steps, self.freq_secs))


MEMORY_ROOT = "/dev/shm/areal-lightning"
"""Where the memory tier's per-trial folders go by default (tmpfs: RAM, survives the process)."""


@dataclass
class MemoryConfig:
    """The node-local memory tier of :class:`~areal_lightning.RecoverCallback` (``recover.memory``).

    Each rank writes its shard of the full recover state into the next of ``slots`` slots on a
    tmpfs folder after every ``freq_steps``-th step and seals it; a rerun resumes from the newest
    step every rank sealed when it is newer than the shared tier's checkpoint.

    Attributes:
        enabled: write the memory tier (default off; ``RecoverCallback(memory=True)`` or a dict turns it on).
        root: the folder of the tier's per-trial folders (``None``: ``/dev/shm/areal-lightning``).
        freq_steps: write a slot after every N-th optimizer step (default 1: every step).
        slots: slots per rank (>= 2: the newest sealed slot is never overwritten before a newer one is sealed).
        replicas: copies of each slot on a peer node (0 or 1).

    Example:
        >>> MemoryConfig(enabled=True, slots=3).validate().slots
        3
    """

    enabled: bool = False
    root: Optional[str] = None
    freq_steps: int = 1
    slots: int = 2
    replicas: int = 0

    def validate(self, prefix: str = "recover.memory") -> "MemoryConfig":
        """Check every field. Returns ``self``."""
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{prefix}.enabled", f"expected true or false, got {self.enabled!r}")
        if self.root is not None:
            if isinstance(self.root, os.PathLike):
                self.root = os.fspath(self.root)
            if not isinstance(self.root, str) or not self.root.strip() or "://" in self.root:
                raise ConfigError(f"{prefix}.root", f"expected a local folder (a tmpfs such as /dev/shm) or null "
                                                    f"(default {MEMORY_ROOT}), got {self.root!r}")
        _positive_int(self.freq_steps, f"{prefix}.freq_steps")
        if self.freq_steps is None:
            raise ConfigError(f"{prefix}.freq_steps", "expected a positive integer (default 1: every step), got null")
        s = self.slots
        if isinstance(s, bool) or not isinstance(s, int) or s < 2:
            raise ConfigError(f"{prefix}.slots", f"expected an integer >= 2 (one slot is written while the newest "
                                                 f"sealed one is kept), got {s!r}")
        r = self.replicas
        if isinstance(r, bool) or r not in (0, 1):
            raise ConfigError(f"{prefix}.replicas", f"expected 0 or 1 (copies of each slot on a peer node), got {r!r}")
        return self


def as_memory(value: Any) -> MemoryConfig:
    """``RecoverCallback(memory=...)`` as a validated :class:`MemoryConfig`: ``None``/``False``
    (off), ``True`` (on with the defaults), a mapping of its fields (on unless it says
    ``enabled: false``) or a ``MemoryConfig``."""
    if value is None or value is False:
        return MemoryConfig()
    if value is True:
        return MemoryConfig(enabled=True).validate()
    if isinstance(value, MemoryConfig):
        return value.validate()
    if isinstance(value, (Mapping, DictConfig)):
        data = _to_container(value)
        data.setdefault("enabled", True)
        return build_dataclass(MemoryConfig, data, prefix="memory.").validate("memory")
    raise ConfigError("memory", f"expected true/false, a mapping of {', '.join(f.name for f in dataclasses.fields(MemoryConfig))} "
                                f"or a MemoryConfig, got {type(value).__name__} {value!r}")


@dataclass
class RecoverConfig:
    """When :class:`~areal_lightning.RecoverCallback` writes recover checkpoints.

    Attributes:
        mode: ``"on"``/``"auto"`` save and resume automatically; ``"off"``/``"disabled"`` do neither.
        freq_epochs: checkpoint at the end of every N-th epoch.
        freq_steps: checkpoint after every N-th optimizer step.
        freq_secs: checkpoint when N seconds have passed since the last one.
        retries: how many times ``areal-lightning run`` re-runs a failed command (>= 0).
        preempt_signals: signals on which the run checkpoints its current step and stops
            (default ``[SIGTERM]``; ``[]``: none).
        fast_forward: how a mid-epoch resume passes the trained batches: ``sampler`` or ``replay``.
        memory: the node-local memory tier (:class:`MemoryConfig`, off by default).
        lock_lease_s: on an object store, the trial lock's lease in seconds: a second live run
            is refused within a third of it; a crashed run's rerun waits at most this long.

    Example:
        >>> RecoverConfig(mode=True, freq_steps=100).validate().mode  # YAML `on`
        'on'
    """

    mode: str = "disabled"
    freq_epochs: int | None = None
    freq_steps: int | None = None
    freq_secs: int | None = None
    retries: int = 3
    preempt_signals: list = field(default_factory=lambda: ["SIGTERM"])
    fast_forward: str = "sampler"
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    lock_lease_s: float = 60.0

    def validate(self, prefix: str = "recover") -> "RecoverConfig":
        """Check every field; normalise ``mode``. Returns ``self``."""
        self.mode = _mode(self.mode, f"{prefix}.mode", RECOVER_MODES)
        for name in ("freq_epochs", "freq_steps", "freq_secs"):
            _positive_int(getattr(self, name), f"{prefix}.{name}")
        r = self.retries
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(f"{prefix}.retries", f"expected an integer >= 0, got {r!r}")
        self.preempt_signals = [s.name for s in parse_signals(self.preempt_signals, f"{prefix}.preempt_signals")]
        self.fast_forward = _mode(self.fast_forward, f"{prefix}.fast_forward", FAST_FORWARD_MODES)
        if isinstance(self.memory, (bool, Mapping)):
            self.memory = as_memory(self.memory)
        self.memory.validate(f"{prefix}.memory")
        lease = self.lock_lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or not 0.5 <= lease <= 600:
            raise ConfigError(f"{prefix}.lock_lease_s", f"expected seconds from 0.5 to 600, got {lease!r}")
        self.lock_lease_s = float(lease)
        return self

    @property
    def enabled(self) -> bool:
        """True for modes ``on`` and ``auto``."""
        return self.mode in ("on", "auto")


@dataclass
class ExperimentConfig:
    """Where checkpoints go, plus the ``saver:`` and ``recover:`` sections.

    Files land under ``{fileroot}/checkpoints/{user}/{experiment_name}/{trial_name}/``.
    ``user=None`` means the OS user (``getpass.getuser()``). ``fileroot`` may be an object
    store (``s3://bucket/prefix``, ``gs://``, ``az://``); ``storage_options`` then go to its
    fsspec file system (endpoint, profile, anything the provider chain does not give).

    Example:
        >>> cfg = ExperimentConfig(fileroot="/data/ckpt", experiment_name="exp", trial_name="t0",
        ...                        saver=SaverConfig(freq_epochs=1)).validate()
        >>> cfg.recover.enabled
        False
    """

    fileroot: str = "/tmp/areal_lightning"
    experiment_name: str = "default"
    trial_name: str = "trial0"
    user: str | None = None
    storage_options: Optional[Dict[str, Any]] = None
    saver: SaverConfig = field(default_factory=SaverConfig)
    recover: RecoverConfig = field(default_factory=RecoverConfig)

    def validate(self) -> "ExperimentConfig":
        """Check every field, including the nested sections. Returns ``self``."""
        if isinstance(self.fileroot, os.PathLike):
            self.fileroot = os.fspath(self.fileroot)
        if not isinstance(self.fileroot, str) or not self.fileroot.strip():
            raise ConfigError("fileroot", f"expected a non-empty path string, got {self.fileroot!r}")
        check_path(self.fileroot, "fileroot")
        self.storage_options = validate_options(self.storage_options) or None
        validate_name(self.experiment_name, "experiment_name")
        validate_name(self.trial_name, "trial_name")
        if self.user is not None:
            validate_name(self.user, "user")
        self.saver.validate("saver")
        self.recover.validate("recover")
        return self

    @property
    def resolved_user(self) -> str:
        """``user``, or the OS user when ``user`` is ``None``."""
        return self.user if self.user is not None else getpass.getuser()


# ---------------------------------------------------------------------------------------
# Loading: any source -> plain dict -> checked dataclass
# ---------------------------------------------------------------------------------------


def _to_container(source: Any) -> dict[str, Any]:
    """YAML path / dict / dataclass / DictConfig -> a plain ``dict`` (no omegaconf objects)."""
    if source is None:
        return {}
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ConfigError("config", f"file not found: {str(path)!r}")
        source = OmegaConf.load(path)
    if dataclasses.is_dataclass(source) and not isinstance(source, type):
        # Shallow on purpose: nested dataclasses are converted recursively below.
        source = {f.name: getattr(source, f.name) for f in dataclasses.fields(source)}
    if isinstance(source, (DictConfig, ListConfig)):
        source = OmegaConf.to_container(source, resolve=True)
    if not isinstance(source, Mapping):
        raise ConfigError("config", f"expected a mapping (YAML file, dict, dataclass or DictConfig), got {type(source).__name__}")
    out: dict[str, Any] = {}
    for key, value in source.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type) or isinstance(value, (DictConfig, Mapping)):
            value = _to_container(value)
        out[key] = value
    return out


def _apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    if not overrides:
        return data
    for item in overrides:
        if "=" not in item:
            raise ConfigError("overrides", f"expected key=value, got {item!r}")
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=True)
    return _deep_merge(data, parsed)


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _check_type(value: Any, tp: Any, field_name: str) -> Any:
    """Coarse type check of a leaf against its annotation (the validators do the rest)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _check_type(value, non_none[0], field_name)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(field_name, f"expected an integer, got {type(value).__name__} {value!r}")
    elif tp is str:
        # `mode: on` arrives as a bool; the mode validator maps it.
        if not isinstance(value, (str, bool)):
            raise ConfigError(field_name, f"expected a string, got {type(value).__name__} {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(field_name, f"expected a number, got {type(value).__name__} {value!r}")
        value = float(value)
    elif tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(field_name, f"expected true or false, got {type(value).__name__} {value!r}")
    return value


def build_dataclass(cls: type[T], data: Mapping[str, Any], prefix: str = "", strict: bool = True) -> T:
    """Build dataclass ``cls`` from a plain mapping, recursing into nested dataclass fields.

    Unknown keys raise :class:`ConfigError` naming them and listing the allowed keys,
    unless ``strict=False`` (then top-level unknown keys are ignored; nested sections stay strict).
    """
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            if not strict:
                continue
            raise ConfigError(dotted, f"unknown key; allowed keys{' in ' + prefix[:-1] if prefix else ''}: {', '.join(names)}")
        tp = hints[key]
        if _is_dataclass_type(tp):
            if value is None:
                value = {}
            if not isinstance(value, Mapping):
                raise ConfigError(dotted, f"expected a section (mapping), got {type(value).__name__} {value!r}")
            kwargs[key] = build_dataclass(tp, value, prefix=f"{dotted}.", strict=True)
        else:
            kwargs[key] = _check_type(value, tp, dotted)
    return cls(**kwargs)


def load_config(
    source: Any = None,
    overrides: Sequence[str] = (),
    schema: type[T] = ExperimentConfig,  # type: ignore[assignment]
    strict: bool = True,
) -> T:
    """Load and validate a config.

    Args:
        source: a YAML path, a ``dict``, a dataclass instance, a ``DictConfig`` or ``None``
            (schema defaults).
        overrides: dotlist entries such as ``["saver.freq_steps=10", "recover.mode=on"]``.
        schema: the dataclass to build (``ExperimentConfig`` or a subclass of it).
        strict: reject unknown top-level keys (nested sections are always strict).

    Raises:
        ConfigError: naming the offending field and the allowed values.

    Example:
        >>> load_config({"fileroot": "/tmp/x", "experiment_name": "e", "trial_name": "t"},
        ...             overrides=["recover.mode=on"]).recover.mode
        'on'
    """
    data = _apply_overrides(_to_container(source), overrides)
    cfg = build_dataclass(schema, data, strict=strict)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def as_experiment(cfg: Any, strict: bool = True) -> ExperimentConfig:
    """``cfg`` as a validated :class:`ExperimentConfig` (an instance is validated as is;
    anything else goes through :func:`load_config`)."""
    exp = cfg if isinstance(cfg, ExperimentConfig) else load_config(cfg, strict=strict)
    return exp.validate()


def structured(schema: type = ExperimentConfig) -> DictConfig:
    """The omegaconf structured config for ``schema`` (for Hydra ``ConfigStore`` or merging)."""
    return OmegaConf.structured(schema)

DEFAULT_PREEMPT_SIGNALS = ("SIGTERM",)
"""The signals that mean "this run is being preempted" unless configured."""

FAST_FORWARD_MODES = ("sampler", "replay")
"""How a mid-epoch resume passes the batches already trained on (``recover.fast_forward``):
``sampler`` draws and drops their indices without fetching a sample (map-style datasets, whose
workers get their random streams back; an ``IterableDataset`` with ``state_dict`` /
``load_state_dict`` gets its state back instead); ``replay`` fetches them through the dataset."""

_FORBIDDEN = {"SIGKILL", "SIGSTOP"}


def parse_signals(value: Any, field: str = "preempt_signals") -> tuple[signal.Signals, ...]:
    """Signal names (``"SIGTERM"``, ``"USR1"``) or numbers -> signals; ``None`` or empty: none."""
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        value = [value]
    if not isinstance(value, Iterable):
        raise ConfigError(field, f"expected a list of signal names such as ['SIGTERM', 'SIGUSR1'], got {value!r}")
    out: list[signal.Signals] = []
    for item in value:
        try:
            if isinstance(item, bool):
                raise ValueError
            if isinstance(item, int):
                sig = signal.Signals(item)
            else:
                name = str(item).upper()
                sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        except (KeyError, ValueError):
            raise ConfigError(field, f"unknown signal {item!r}; allowed: signal names such as SIGTERM, SIGUSR1, "
                                     "SIGUSR2, SIGINT (or their numbers)") from None
        if sig.name in _FORBIDDEN:
            raise ConfigError(field, f"{sig.name} cannot be caught; allowed: any other signal, such as SIGTERM")
        if sig not in out:
            out.append(sig)
    return tuple(out)
