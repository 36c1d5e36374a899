"""The demo's configuration: the training job, the kill demonstration, the experiment paths
(``configs/demo.yaml`` has the same fields), and its constants."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence


from areal_lightning.config import (
    ConfigError,
    ExperimentConfig,
    RecoverConfig,
    SaverConfig,
)
from areal_lightning.errors import AreaLightningError

if TYPE_CHECKING:
    pass


SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789+="
REFERENCE_SUFFIX = "-reference"
"""The uninterrupted reference run trains trial ``{trial_name}-reference``."""
MODEL_NAME = "default"
"""The demo's model folder (``HFSaverCallback`` / ``RecoverCallback`` ``name``)."""
STALL_TIMEOUT_S = 300.0
"""A worker that records no step for this long is killed and the demo fails."""
PAUSE_ENV = "AREAL_LIGHTNING_DEMO_PAUSE_AT"
"""Set for the first start of the killed run only: the worker stops itself (SIGSTOP) right
after this optimizer step, once a recover checkpoint is durable, and the demo SIGKILLs it
there -- a step boundary chosen in advance, whatever the machine's load."""


class DemoMismatchError(AreaLightningError, RuntimeError):
    """The killed + resumed demo run did not reproduce the uninterrupted run bit for bit
    (or a worker failed); the message says what differs and where the logs are."""


@dataclass
class DemoTrainConfig:
    """Training settings of the demo (the ``train:`` section of ``configs/demo.yaml``)."""

    seed: int = 0
    max_epochs: int = 8
    max_steps: int = -1
    num_samples: int = 4096
    batch_size: int = 64
    lr: float = 1e-3
    max_operand: int = 50
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_generations: int = 4
    accelerator: str = "cpu"
    devices: int = 1
    progress_bar: bool = True

    def validate(self, prefix: str = "train") -> "DemoTrainConfig":
        """Check ranges. Returns ``self``."""
        for name in ("max_epochs", "num_samples", "batch_size", "max_operand", "hidden_size", "num_layers",
                     "num_heads", "devices"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{prefix}.{name}", f"expected a positive integer, got {getattr(self, name)}")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"{prefix}.max_steps", f"expected -1 (no limit) or a positive integer, got {self.max_steps}")
        if self.lr <= 0:
            raise ConfigError(f"{prefix}.lr", f"expected a positive number, got {self.lr}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"{prefix}.hidden_size", f"must be a multiple of num_heads={self.num_heads}")
        if self.num_generations < 0:
            raise ConfigError(f"{prefix}.num_generations", f"expected >= 0, got {self.num_generations}")
        return self

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of one epoch (the last batch may be smaller)."""
        return math.ceil(self.num_samples / self.batch_size)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run (``max_epochs`` epochs, capped by ``max_steps``)."""
        total = self.max_epochs * self.steps_per_epoch
        return min(total, self.max_steps) if self.max_steps > 0 else total


@dataclass
class DemoKillConfig:
    """The SIGKILL demonstration (the ``kill:`` section of ``configs/demo.yaml``).

    Attributes:
        enabled: train in worker processes, SIGKILL one mid-run, start it again with the
            same command and compare its losses with an uninterrupted reference run;
            ``false``: train once, in this process.
        at_step: kill the worker right after this optimizer step (counted from 1): it stops
            itself there and the demo sends the SIGKILL (with a seconds trigger only: at the
            first step from then on at which a recover checkpoint is durable). It must lie
            after the first recover checkpoint, before the last step, and not on a checkpoint
            step. ``null``: halfway between the two recover checkpoints around the middle of the run.
    """

    enabled: bool = True
    at_step: int | None = None

    def validate(self, prefix: str = "kill") -> "DemoKillConfig":
        """Check the types (the range is checked against the whole config by :class:`DemoConfig`)."""
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"{prefix}.enabled", f"expected true or false, got {self.enabled!r}")
        s = self.at_step
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s <= 0):
            raise ConfigError(f"{prefix}.at_step", f"expected a positive integer or null (automatic), got {s!r}")
        return self


def _default_recover() -> RecoverConfig:
    return RecoverConfig(mode="on", freq_steps=50)


@dataclass
class DemoConfig(ExperimentConfig):
    """The demo's whole config: the experiment (paths, ``saver:``, ``recover:``) plus ``train:``
    and ``kill:``."""

    experiment_name: str = "demo"
    saver: SaverConfig = field(default_factory=lambda: SaverConfig(freq_epochs=2, freq_steps=100, max_keep=3))
    recover: RecoverConfig = field(default_factory=_default_recover)
    train: DemoTrainConfig = field(default_factory=DemoTrainConfig)
    kill: DemoKillConfig = field(default_factory=DemoKillConfig)

    def validate(self) -> "DemoConfig":
        """Validate the experiment part, ``train:`` and ``kill:`` (the kill step against the run)."""
        super().validate()
        self.train.validate()
        self.kill.validate()
        if self.kill.enabled:
            self.kill_step()
        return self

    def recover_steps(self) -> list[int]:
        """The steps (from 1) after which a recover checkpoint is taken by the step and epoch
        triggers (a seconds trigger adds unpredictable ones)."""
        r, t = self.recover, self.train
        n, spe = t.total_steps, t.steps_per_epoch
        steps = set(range(r.freq_steps, n + 1, r.freq_steps)) if r.freq_steps else set()
        if r.freq_epochs:
            steps |= {e * spe for e in range(r.freq_epochs, t.max_epochs + 1, r.freq_epochs) if e * spe <= n}
        return sorted(steps)

    def kill_step(self) -> int:
        """The step after which the worker is killed: ``kill.at_step``, or the automatic one.

        Raises:
            ConfigError: naming ``kill.enabled``, ``recover.freq_steps`` or ``kill.at_step``
                when the kill cannot land between two recover checkpoints.
        """
        if not self.recover.enabled:
            raise ConfigError("kill.enabled", f"the kill demonstration resumes from recover checkpoints: it needs "
                                              f"recover.mode: on (got {self.recover.mode!r}); or set kill.enabled=false")
        r, ckpts, n = self.recover, self.recover_steps(), self.train.total_steps
        if not (r.freq_steps or r.freq_epochs or r.freq_secs):
            raise ConfigError("recover.freq_steps", "the kill demonstration needs a recover trigger "
                                                    "(recover.freq_steps, freq_epochs or freq_secs)")
        if not ckpts and r.freq_secs is None:
            raise ConfigError("recover.freq_steps", f"no recover checkpoint falls within the run's {n} steps "
                                                    f"(freq_steps={r.freq_steps}, freq_epochs={r.freq_epochs}): "
                                                    "lower it, or train longer")
        if self.kill.at_step is not None:
            s = self.kill.at_step
            first = ckpts[0] if ckpts else 0
            if not first < s < n:
                raise ConfigError("kill.at_step", f"expected a step after the first recover checkpoint (step {first}) "
                                                  f"and before the last step ({n}), got {s}")
            if s in ckpts:
                raise ConfigError("kill.at_step", f"step {s} is a recover checkpoint step (checkpoints after steps "
                                                  f"{_short_list(ckpts)}); pick a step between two of them")
            return s
        if not ckpts:  # seconds trigger only: the kill waits for the first durable checkpoint
            return max(1, n // 2)
        bounds = [c for c in ckpts if c < n] + [n]
        gaps = [(c, nxt) for c, nxt in zip(bounds, bounds[1:]) if nxt - c >= 2]
        if not gaps:
            raise ConfigError("kill.at_step", f"no step lies between two recover checkpoints (after steps "
                                              f"{_short_list(ckpts)}) before the last step ({n}): lower "
                                              "recover.freq_steps or train longer")
        before_middle = [g for g in gaps if g[0] <= n / 2]
        c, nxt = before_middle[-1] if before_middle else gaps[0]
        return c + (nxt - c) // 2


def _short_list(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"
