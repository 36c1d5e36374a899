"""The demo job: a tiny Llama learns addition (``"17+25=42"``) while HFSaverCallback exports it
and RecoverCallback makes it survive a SIGKILL.

Nothing is downloaded: the model is built from a ``LlamaConfig`` and the character-level
tokenizer with the ``tokenizers`` library (wrapped as ``PreTrainedTokenizerFast``, so a real
``tokenizer.json`` is exported). Run it with ``areal-lightning demo [--config FILE] [key=value ...]``.

With ``kill.enabled`` (the default) the training runs in worker processes
(``python -m areal_lightning.tools.demo --worker CONFIG --losses FILE``, each appending its
per-step losses to ``FILE``): the trial is trained once without interruption (the reference,
trial ``{trial_name}-reference``) and, side by side, once more in trial ``{trial_name}``,
whose worker gets a real ``SIGKILL`` mid-epoch, between two recover checkpoints, is started
again with the same command, resumes from the last recover checkpoint and finishes. The
demo prints both runs' per-step losses, compares every one bit for bit (and the final HF
exports byte for byte) and raises :class:`DemoMismatchError` when anything differs.
With ``kill.enabled: false`` it trains once, in this process.

Step numbers in the demo's output and summary count optimizer steps from 1 (``trainer.global_step``
after the step); the folder names and ``recover_info/`` count from 0 (step 250 is ``globalstep249``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from areal_lightning.config import (
    ConfigError,
    ExperimentConfig,
    RecoverConfig,
    SaverConfig,
    load_config,
)
from areal_lightning.errors import AreaLightningError
from areal_lightning.layout import TrialLayout

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["DemoConfig", "DemoTrainConfig", "DemoKillConfig", "DemoMismatchError", "build_tokenizer",
           "AdditionDataset", "TinyCausalLM", "run_demo"]

log = logging.getLogger(__name__)

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


def build_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast`` for digits, ``+`` and ``=`` (adds ``<bos>``)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


class AdditionDataset(Dataset):
    """``num_samples`` strings ``"a+b=c"`` with ``0 <= a, b < max_operand``, tokenised and padded."""

    def __init__(self, tokenizer: Any, num_samples: int, max_operand: int, seed: int) -> None:
        rng = random.Random(seed)
        texts = []
        for _ in range(num_samples):
            a, b = rng.randrange(max_operand), rng.randrange(max_operand)
            texts.append(f"{a}+{b}={a + b}")
        ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        self.seq_len = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id
        self.input_ids = torch.tensor([x + [pad] * (self.seq_len - len(x)) for x in ids])
        self.attention_mask = (self.input_ids != pad).long()
        # Learn the answer only: the operands are random, so predicting them is noise.
        eq = tokenizer.convert_tokens_to_ids("=")
        answer = (self.input_ids == eq).long().cumsum(dim=1) - (self.input_ids == eq).long()
        self.labels = self.input_ids.masked_fill((answer == 0) | (self.attention_mask == 0), -100)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "labels": self.labels[i]}


_CLASSES: dict[str, type] = {}


def _tiny_causal_lm_class() -> type:
    """``TinyCausalLM``, defined on first use: importing this module does not import Lightning
    (the demo's parent process only starts workers, reads files and generates)."""
    if "TinyCausalLM" in _CLASSES:
        return _CLASSES["TinyCausalLM"]
    import lightning.pytorch as pl

    class TinyCausalLM(pl.LightningModule):
        """A LightningModule holding a tiny ``LlamaForCausalLM`` as ``self.model`` and its ``tokenizer``."""

        def __init__(self, tokenizer: Any, cfg: DemoTrainConfig, seq_len: int = 16) -> None:
            super().__init__()
            from transformers import LlamaConfig, LlamaForCausalLM

            self.tokenizer = tokenizer
            self.lr = cfg.lr
            mcfg = LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.hidden_size * 2,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_heads,
                max_position_embeddings=max(32, seq_len * 2),
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                tie_word_embeddings=False,
            )
            self.model = LlamaForCausalLM(mcfg)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

    TinyCausalLM.__module__, TinyCausalLM.__qualname__ = __name__, "TinyCausalLM"  # picklable by name
    _CLASSES["TinyCausalLM"] = TinyCausalLM
    return TinyCausalLM


def __getattr__(name: str) -> Any:  # TinyCausalLM without importing Lightning with this module
    if name == "TinyCausalLM":
        return _tiny_causal_lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def generate(model_dir: Path, prompts: Sequence[str]) -> list[str]:
    """Load an export with ``AutoModelForCausalLM`` / ``AutoTokenizer`` and complete ``prompts`` greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            enc = tok(p, return_tensors="pt")
            gen = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
            outs.append(tok.decode(gen[0], skip_special_tokens=True))
    return outs


# ---------------------------------------------------------------------------------------
# Training (in this process, or in a worker process)
# ---------------------------------------------------------------------------------------


def _loss_file(path: Path) -> Any:
    """A Lightning callback writing the per-step losses to ``path`` (see ``_LossFile``)."""
    import lightning.pytorch as pl

    from areal_lightning.lightning import RecoverCallback

    class _LossFile(pl.Callback):
        """Appends one JSON line per optimizer step (``{"step", "loss": float.hex(), "epoch", "batch"}``)
        plus ``start`` / ``resumed`` / ``end`` events to ``path``, each line with one ``write`` (a
        SIGKILL never leaves half a line). It runs before ``RecoverCallback`` saves the step."""

        def __init__(self, path: Path) -> None:
            self.path = Path(path)
            self._fd: int | None = None
            self._first = True

        def _write(self, row: dict[str, Any]) -> None:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(self._fd, (json.dumps(row) + "\n").encode())

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.is_global_zero:
                self._write({"event": "start", "pid": os.getpid(), "t": time.time()})

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if not trainer.is_global_zero:
                return
            if self._first:
                self._first = False
                recover = next((c for c in trainer.callbacks if isinstance(c, RecoverCallback)), None)
                step = recover.resumed_from if recover is not None else None
                if step is not None:  # 0-based indices of the last step in the checkpoint
                    self._write({"event": "resumed", "global_step": step.global_step, "epoch": step.epoch,
                                 "epoch_step": step.epoch_step})
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None:
                self._write({"step": trainer.global_step, "loss": float(loss.detach().float().item()).hex(),
                             "epoch": trainer.current_epoch, "batch": batch_idx, "t": time.time()})

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.is_global_zero:
                self._write({"event": "end", "global_step": trainer.global_step, "t": time.time()})
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    return _LossFile(path)


def _pause_at(step: int) -> Any:
    """A Lightning callback that stops this process (SIGSTOP) right after optimizer step ``step``
    (from 1), or the first step after it, at which a recover checkpoint is durable: the
    handshake with the demo, which then SIGKILLs the stopped worker."""
    import lightning.pytorch as pl

    from areal_lightning.lightning import RecoverCallback

    class _PauseAt(pl.Callback):
        def __init__(self) -> None:
            self.paused = False

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self.paused or trainer.global_step < step:
                return
            recover = next(c for c in trainer.callbacks if isinstance(c, RecoverCallback))
            recover.wait()  # an async save in flight becomes durable first
            if recover.store.exists():
                self.paused = True
                os.kill(os.getpid(), signal.SIGSTOP)  # stays stopped until the demo's SIGKILL

    return _PauseAt()


def _fit(cfg: DemoConfig, extra_callbacks: Sequence[pl.Callback] = ()) -> tuple[pl.Trainer, list[pl.Callback]]:
    """Train the demo model with the callbacks of ``cfg`` (a rerun resumes from its recover checkpoint)."""
    import lightning.pytorch as pl

    from areal_lightning.lightning import callbacks_from_config

    t = cfg.train
    pl.seed_everything(t.seed, workers=True, verbose=False)
    tokenizer = build_tokenizer()
    data = AdditionDataset(tokenizer, t.num_samples, t.max_operand, t.seed)
    loader = DataLoader(data, batch_size=t.batch_size, shuffle=True)
    module = _tiny_causal_lm_class()(tokenizer, t, seq_len=data.seq_len)
    callbacks = callbacks_from_config(cfg, strict=False)
    trainer = pl.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        max_epochs=t.max_epochs,
        max_steps=t.max_steps,
        callbacks=[*extra_callbacks, *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=t.progress_bar,
        enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(module, loader)
    return trainer, callbacks


def worker_threads() -> int:
    """Intra-op threads of each worker: the reference and the killed run train side by side
    with the same count (half the CPUs this process may use, 1 to 4: the model is tiny)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(1, min(4, cpus // 2))


def _worker_main(argv: Sequence[str]) -> int:
    """``python -m areal_lightning.tools.demo --worker CONFIG.json --losses FILE``: one training run."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m areal_lightning.tools.demo",
                                     description="A worker of `areal-lightning demo` (one training run).")
    parser.add_argument("--worker", required=True, metavar="CONFIG", help="the demo config (JSON or YAML)")
    parser.add_argument("--losses", required=True, metavar="FILE", help="append the per-step losses here")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.worker, schema=DemoConfig)
    callbacks = [_loss_file(Path(args.losses))]
    if os.environ.get(PAUSE_ENV):
        callbacks.append(_pause_at(int(os.environ[PAUSE_ENV])))  # after the step's losses line
    _fit(cfg, callbacks)
    return 0


# ---------------------------------------------------------------------------------------
# The kill demonstration (in the parent process)
# ---------------------------------------------------------------------------------------


@dataclass
class _Launch:
    """What one start of a worker recorded in its losses file."""

    pid: int | None = None
    losses: dict[int, str] = field(default_factory=dict)  # step (from 1) -> float.hex()
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # step -> (epoch, batch)
    resumed_after: int | None = None  # steps in the checkpoint it resumed from
    resumed_info: dict[str, Any] | None = None
    ended_at: int | None = None


def _read_launches(path: Path) -> list[_Launch]:
    """The starts recorded in a losses file, in order (a partial last line is ignored)."""
    launches: list[_Launch] = []
    if not path.is_file():
        return launches
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        event = row.get("event")
        if event == "start":
            launches.append(_Launch(pid=row.get("pid")))
            continue
        if not launches:
            launches.append(_Launch())
        cur = launches[-1]
        if event == "resumed":
            cur.resumed_after = int(row["global_step"]) + 1
            cur.resumed_info = row
        elif event == "end":
            cur.ended_at = int(row["global_step"])
        elif "step" in row:
            cur.losses[int(row["step"])] = row["loss"]
            cur.where[int(row["step"])] = (int(row.get("epoch", -1)), int(row.get("batch", -1)))
    return launches


class _Tail:
    """Reads the step lines a worker appends, incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last_step, self.last_seen = path, 0, 0, time.monotonic()

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.last_step
        end = chunk.rfind(b"\n")
        if end >= 0:
            self.offset += end + 1
            for line in chunk[:end].splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if "step" in row:
                    self.last_step = int(row["step"])
                    self.last_seen = time.monotonic()
        return self.last_step


class _Worker:
    """One worker command (the same command for the first start and the restart)."""

    def __init__(self, label: str, command: list[str], log_path: Path, losses: Path) -> None:
        self.label, self.command, self.log_path, self.losses = label, command, log_path, losses
        self.proc: subprocess.Popen | None = None
        self.tail = _Tail(losses)
        self.starts = 0

    def start(self, pause_at: int | None = None) -> None:
        """Start the command; ``pause_at``: the worker stops itself after that step (see :data:`PAUSE_ENV`)."""
        env = dict(os.environ)
        env.pop(PAUSE_ENV, None)
        if pause_at is not None:
            env[PAUSE_ENV] = str(pause_at)
        # The worker imports the same areal_lightning as this process, wherever it was found.
        pkg_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        with open(self.log_path, "ab") as logf:
            logf.write(f"=== start {self.starts + 1}: {' '.join(self.command)}\n".encode())
            logf.flush()
            # Its own process group: the SIGKILL reaches every process of the run.
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.starts += 1
        self.tail.last_seen = time.monotonic()

    def paused(self) -> bool:
        """Whether the worker has stopped itself (SIGSTOP): read without reaping it."""
        if self.proc is None:
            return False
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return info is not None and info.si_code == os.CLD_STOPPED

    def sigkill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def check(self) -> int | None:
        """The exit code once it ended (a failure raises), else ``None``; a stalled worker is killed."""
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is None:
            self.tail.poll()
            if time.monotonic() - self.tail.last_seen > STALL_TIMEOUT_S:
                self.sigkill()
                raise DemoMismatchError(f"{self.label}: no training step for {STALL_TIMEOUT_S:.0f} s; killed it. "
                                        f"Its log: {self.log_path}\n{self.log_tail()}")
            return None
        if rc != 0:
            raise DemoMismatchError(f"{self.label}: the worker failed with exit code {rc}. Its log: "
                                    f"{self.log_path}\n{self.log_tail()}")
        return rc

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _durable_resume_step(trial_dir: Path) -> int | None:
    """Steps (from 1) in the recover checkpoint a start of ``trial_dir`` must resume from, read
    from disk by ``certify``'s independent oracle (the commit protocol), or ``None``."""
    from areal_lightning.tools.certify import expected_resume

    step = expected_resume(trial_dir)
    return None if step is None else step + 1


def _fmt(hexloss: str | None) -> str:
    # 9 significant digits tell every two float32 values apart.
    return "-" if hexloss is None else f"{float.fromhex(hexloss):.9g}"


def _same_files(a: Path, b: Path) -> tuple[bool, int]:
    """Are the two folders' files byte-identical? ``(equal, number of files)``."""
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    if fa != fb:
        return False, len(fa)
    return all((a / p).read_bytes() == (b / p).read_bytes() for p in fa), len(fa)


def compare_runs(reference: dict[int, str], before_kill: dict[int, str], after_resume: dict[int, str],
                 resumed_from: int, killed_at: int, total: int) -> dict[str, Any]:
    """Compare the killed + resumed run with the uninterrupted reference, loss by loss (bits).

    ``before_kill``: the first start's losses (steps 1..killed_at); ``after_resume``: the
    restart's (resumed_from+1..total); ``reference``: the uninterrupted run's (1..total).
    Returns ``{"match": bool, "differ": [steps], "missing": [steps], "replay_match": bool,
    "groups": [(first, last, label, equal, count)]}``.
    """
    combined = {s: v for s, v in before_kill.items() if s <= resumed_from}
    combined.update(after_resume)
    steps = range(1, total + 1)
    missing = [s for s in steps if s not in combined or s not in reference]
    differ = [s for s in steps if s in combined and s in reference and combined[s] != reference[s]]
    replayed = range(resumed_from + 1, killed_at + 1)
    replay_differ = [s for s in replayed if before_kill.get(s) is None or before_kill.get(s) != after_resume.get(s)]
    groups = []
    for lo, hi, label in ((1, resumed_from, "first start, before the kill, vs reference"),
                          (resumed_from + 1, killed_at,
                           "trained twice (before the kill, again after the resume) vs reference"),
                          (killed_at + 1, total, "after the resume vs reference")):
        if hi >= lo:
            span = range(lo, hi + 1)
            equal = sum(1 for s in span if s in combined and combined[s] == reference.get(s)
                        and (s not in replayed or before_kill.get(s) == combined[s]))
            groups.append((lo, hi, label, equal, len(span)))
    extra = sorted(set(after_resume) - set(steps)) + sorted(set(reference) - set(steps))
    return {"match": not missing and not differ and not replay_differ and not extra and len(combined) == total,
            "differ": differ, "missing": missing, "replay_differ": replay_differ, "replay_match": not replay_differ,
            "groups": groups, "combined": combined}


def _table_steps(resumed_from: int, killed_at: int, total: int) -> list[int | None]:
    """The rows of the table: around the checkpoint, around the kill, the last step (None = '...')."""
    want = [resumed_from, resumed_from + 1, resumed_from + 2, killed_at - 1, killed_at, killed_at + 1,
            killed_at + 2, total]
    rows: list[int | None] = []
    for s in sorted({s for s in want if 1 <= s <= total}):
        if rows and rows[-1] is not None and s > rows[-1] + 1:
            rows.append(None)
        rows.append(s)
    return rows


def _print_table(say: Callable[[str], None], reference: dict[int, str], before: dict[int, str],
                 after: dict[int, str], resumed_from: int, killed_at: int, total: int) -> None:
    say(f"  {'step':>6}  {'loss before kill':>16}  {'after resume':>14}  {'reference':>14}")
    for s in _table_steps(resumed_from, killed_at, total):
        if s is None:
            say(f"  {'...':>6}")
            continue
        b, a, r = before.get(s), after.get(s), reference.get(s)
        run = a if a is not None else b
        same = run is not None and run == r and (a is None or b is None or a == b)
        notes = ["same bits" if same else "DIFFERENT"]
        if s == resumed_from:
            notes.append("<- recover checkpoint; resumed from here")
        if s == killed_at:
            notes.append("<- SIGKILL here")
        if s == total:
            notes.append("<- last step")
        say(f"  {s:>6}  {_fmt(b):>16}  {_fmt(a):>14}  {_fmt(r):>14}  {'  '.join(notes)}")


def _run_killed_and_reference(cfg: DemoConfig, say: Callable[[str], None],
                              before_resume: Callable[[Path], None] | None) -> dict[str, Any]:
    """Train ``cfg`` side by side as the reference and as the run that gets killed; compare."""
    t0 = time.monotonic()

    def note(msg: str) -> None:
        say(f"demo [{time.monotonic() - t0:5.1f}s] {msg}")

    t = cfg.train
    total, kill_at, ckpts = t.total_steps, cfg.kill_step(), cfg.recover_steps()
    ref_cfg = dataclasses.replace(cfg, trial_name=cfg.trial_name + REFERENCE_SUFFIX)
    layouts = {name: TrialLayout(Path(c.fileroot), c.resolved_user, c.experiment_name, c.trial_name)
               for name, c in (("run", cfg), ("ref", ref_cfg))}
    for layout in layouts.values():
        if layout.trial_dir.exists():  # a previous demo's trial would resume (and do nothing)
            note(f"removing the previous demo trial {layout.trial_dir}")
            shutil.rmtree(layout.trial_dir)
    work = Path(tempfile.mkdtemp(prefix="areal-lightning-demo-"))
    threads = worker_threads()
    workers = {}
    for name, c in (("run", cfg), ("ref", ref_cfg)):
        conf = dataclasses.asdict(c)
        conf["train"]["progress_bar"] = False
        (work / f"{name}.json").write_text(json.dumps(conf, indent=1))
        command = [sys.executable, "-m", "areal_lightning.tools.demo", "--worker", str(work / f"{name}.json"),
                   "--losses", str(work / f"{name}-losses.jsonl"), "--threads", str(threads)]
        workers[name] = _Worker(f"{c.trial_name} worker", command, work / f"{name}.log", work / f"{name}-losses.jsonl")
    run, ref = workers["run"], workers["ref"]
    run_dir, ref_dir = layouts["run"].trial_dir, layouts["ref"].trial_dir
    note(f"training {total} steps twice, side by side, in two worker processes ({threads} thread(s) each):")
    say(f"  {ref_dir}  never interrupted (the reference)")
    say(f"  {run_dir}  recover checkpoints after steps {_short_list(ckpts) or '(seconds trigger)'}; "
        f"SIGKILLed after step {kill_at}, then started again with the same command:")
    say(f"    {' '.join(run.command)}")
    ok, shown = False, [time.monotonic()]

    def progress() -> None:  # a line every 15 s while the workers train
        if time.monotonic() - shown[0] >= 15:
            shown[0] = time.monotonic()
            at = [f"{c.trial_name} at step {w.tail.last_step}/{total}" if w.tail.last_step else
                  f"{c.trial_name} starting (imports, setup{', resume' if w.starts > 1 else ''})"
                  for c, w in ((cfg, run), (ref_cfg, ref))]
            note(", ".join(at))

    try:
        ref.start()
        run.start(pause_at=kill_at)
        # 1. the first start, until it stops itself right after the kill step (a recover checkpoint durable)
        while not run.paused():
            ref.check()
            if run.check() is not None:
                raise DemoMismatchError(f"{run.label} finished all {total} steps before it could be killed (no recover "
                                        f"checkpoint was durable after step {kill_at}); lower kill.at_step")
            progress()
            time.sleep(0.01)
        run.tail.poll()
        note(f"{cfg.trial_name}: the worker stopped itself after step {run.tail.last_step}, as asked (a step "
             "boundary chosen in advance)")
        pid = run.proc.pid  # type: ignore[union-attr]
        run.sigkill()
        rc_killed = run.proc.returncode  # type: ignore[union-attr]
        first = _read_launches(run.losses)[-1]
        killed_at = max(first.losses, default=0)
        epoch, batch = first.where.get(killed_at, (-1, -1))
        durable = _durable_resume_step(run_dir)  # what a restart must resume from, read after the kill
        later = [c for c in ckpts if c > (durable or 0)]
        between = durable is not None and killed_at > durable and killed_at not in ckpts
        where = "mid-epoch" if batch + 1 < t.steps_per_epoch else "at the end of the epoch"
        note(f"{cfg.trial_name}: SIGKILL -> pid {pid} (exit code {rc_killed}) after step {killed_at}, {where} "
             f"(epoch {epoch}, batch {batch + 1} of {t.steps_per_epoch}), between the recover checkpoints after steps "
             f"{durable} (durable) and {later[0] if later else '-'}" if between else
             f"{cfg.trial_name}: SIGKILL -> pid {pid} (exit code {rc_killed}) after step {killed_at}, {where}; the last "
             f"durable recover checkpoint is the one after step {durable}")
        if before_resume is not None:
            before_resume(work)
        # 2. the same command again: it must resume from that checkpoint and finish
        note(f"{cfg.trial_name}: starting the same command again")
        run.start()
        run.tail.last_step = 0  # until the restart records its first step
        while run.check() is None:
            ref.check()
            progress()
            time.sleep(0.05)
        while ref.check() is None:
            progress()
            time.sleep(0.05)
        launches = _read_launches(run.losses)
        second = launches[-1] if len(launches) >= 2 else _Launch()
        ref_launches = _read_launches(ref.losses)
        reference = ref_launches[-1].losses if ref_launches else {}
        resumed_from = second.resumed_after
        info = second.resumed_info or {}
        if resumed_from is None:
            note(f"{cfg.trial_name}: the restarted worker did NOT resume from a recover checkpoint (it started afresh)")
            resumed_from = 0
        else:
            note(f"{cfg.trial_name}: resumed from the recover checkpoint after step {resumed_from} "
                 f"(recover_info/step_info.json: epoch {info.get('epoch')}, epoch_step {info.get('epoch_step')}, "
                 f"global_step {info.get('global_step')}), trained steps {resumed_from + 1}-{killed_at} again, "
                 f"finished at step {second.ended_at}")
        cmp = compare_runs(reference, first.losses, second.losses, resumed_from, killed_at, total)
        say("")
        say("Per-step training loss, killed + resumed run vs the uninterrupted reference (compared as float bits):")
        _print_table(say, reference, first.losses, second.losses, resumed_from, killed_at, total)
        for lo, hi, label, equal, count in cmp["groups"]:
            say(f"  steps {lo:>4}-{hi:<4} {label}: {equal}/{count} bit-identical")
        # 3. the final HF exports of both trials, byte for byte
        run_exports = [p for _, p in layouts["run"].list_exports(MODEL_NAME)]
        ref_exports = [p for _, p in layouts["ref"].list_exports(MODEL_NAME)]
        exports_match: bool | None = None
        if run_exports or ref_exports:
            exports_match, nfiles = False, 0
            if [p.name for p in run_exports] == [p.name for p in ref_exports]:
                exports_match, nfiles = _same_files(run_exports[-1], ref_exports[-1])
            say(f"  final HF export {run_exports[-1].name if run_exports else '-'}: "
                + (f"{nfiles} files byte-identical to the reference's" if exports_match
                   else "DIFFERENT from the reference's (or other exports)"))
        checks = [
            (rc_killed == -signal.SIGKILL, f"the worker was not ended by SIGKILL (exit code {rc_killed})"),
            (second.resumed_after is not None and resumed_from == durable,
             f"the restart resumed after step {second.resumed_after}, but the durable recover checkpoint is the one "
             f"after step {durable}"),
            (resumed_from < killed_at, f"the kill (after step {killed_at}) came no later than the checkpoint "
                                       f"(after step {resumed_from})"),
            (second.ended_at == total, f"the resumed run ended at step {second.ended_at}, not {total}"),
            (cmp["match"], f"{len(cmp['differ'])} of {total} per-step losses differ from the uninterrupted run's "
                           f"(first at steps {cmp['differ'][:3]}), {len(cmp['missing'])} missing, "
                           f"{len(cmp['replay_differ'])} of the steps trained twice differ"),
            (exports_match is not False, "the final HF export differs from the reference's"),
        ]
        problems = [msg for good, msg in checks if not good]
        if not problems:
            verdict = (f"VERDICT: PASS - killed after step {killed_at}, resumed from the checkpoint after step "
                       f"{resumed_from}: all {total} per-step losses are bit-for-bit those of the uninterrupted run"
                       + (", and so is the final HF export" if exports_match else ""))
        else:
            verdict = "VERDICT: FAIL - " + "; ".join(problems)
        say(verdict)
        say("")
        ok = not problems
        return {
            "killed_at_step": killed_at, "killed_epoch": epoch, "killed_batch": batch,
            "killed_signal": -rc_killed if rc_killed is not None and rc_killed < 0 else None,
            "killed_between_checkpoints": between, "durable_checkpoint_step": durable,
            "resumed_from_step": second.resumed_after, "resumed_step_info": info,
            "losses_match": bool(cmp["match"]), "exports_match": exports_match,
            "verdict": verdict, "problems": problems, "global_step": second.ended_at or 0,
            "reference_trial_dir": str(ref_dir), "work_dir": str(work), "worker_command": run.command,
            "losses": {"before_kill": first.losses, "after_resume": second.losses, "reference": reference},
        }
    finally:
        for w in workers.values():
            w.sigkill()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            note(f"the workers' logs and losses are kept in {work}")


def run_demo(config: Any = None, overrides: Sequence[str] = (), *, check: bool = True, echo: bool = True,
             before_resume: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Train the demo model with the callbacks of ``config``; return a summary dict.

    ``config`` is a YAML path, dict, ``DemoConfig`` or ``None`` (built-in defaults);
    ``overrides`` are dotlist entries (``train.max_epochs=1``).

    With ``kill.enabled`` the demo trains in worker processes: an uninterrupted reference
    (trial ``{trial_name}-reference``) and, side by side, the trial ``{trial_name}``, whose
    worker is SIGKILLed after ``kill.at_step`` and started again with the same command. It
    prints the per-step losses of both and a verdict; the summary then also holds
    ``killed_at_step``, ``resumed_from_step`` (steps in the recover checkpoint the restart
    resumed from), ``losses_match`` and ``exports_match`` (bools), ``verdict``, ``losses``
    (``{"before_kill", "after_resume", "reference"}``: ``{step: float.hex()}``). Both trials
    start fresh (a previous demo's folders are removed). With ``kill.enabled: false`` it trains
    once in this process (``killed_at_step`` etc. are ``None``; a rerun resumes).

    Args:
        check: raise :class:`DemoMismatchError` (after printing the verdict) when the resumed
            run differs from the reference; ``False`` returns the summary (``problems`` lists
            what differs). A worker that fails or stalls raises it either way.
        echo: print the demonstration (the CLI prints the rest of the summary).
        before_resume: called with the workers' folder after the kill, before the restart
            (tests use it to make the restart differ and see the verdict fail).
    """
    # Overrides apply on top of the demo's defaults (a section built from a partial mapping
    # would otherwise start from the generic SaverConfig / RecoverConfig defaults).
    cfg: DemoConfig = load_config(DemoConfig() if config is None else config, overrides, schema=DemoConfig)
    t = cfg.train

    def say(line: str = "") -> None:
        if echo:
            print(line, flush=True)

    summary: dict[str, Any] = {"killed_at_step": None, "resumed_from_step": None, "losses_match": None,
                               "exports_match": None}
    if cfg.kill.enabled:
        summary.update(_run_killed_and_reference(cfg, say, before_resume))
    else:
        trainer, _ = _fit(cfg)
        summary["global_step"] = trainer.global_step
    if check and summary.get("problems"):
        raise DemoMismatchError(f"{summary['verdict']} (logs and losses: {summary['work_dir']})")
    summary.update({"exports": [], "generations": []})
    layout = TrialLayout(Path(cfg.fileroot), cfg.resolved_user, cfg.experiment_name, cfg.trial_name)
    if cfg.saver.enabled:
        summary["trial_dir"] = str(layout.trial_dir)
        summary["exports"] = [str(p) for _, p in layout.list_exports(MODEL_NAME)]
        if summary["exports"] and t.num_generations:
            rng = random.Random(t.seed + 1)
            pairs = [(rng.randrange(t.max_operand), rng.randrange(t.max_operand)) for _ in range(t.num_generations)]
            prompts = [f"{a}+{b}=" for a, b in pairs]
            summary["generations"] = list(zip(prompts, generate(Path(summary["exports"][-1]), prompts)))
            summary["expected"] = [str(a + b) for a, b in pairs]
    return summary


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
