"""One configurable small training job for the resume matrix (``tests/test_matrix.py``).

    python tests/scripts/train_matrix.py --job JSON --root DIR --trace FILE
        [--crash-at STEP [--crash-mode raise|pause]] [--epochs N]

The job (a :class:`Job` as JSON) picks the data (map-style, with augmentation noise drawn from
the global torch RNG in ``__getitem__``, or an ``IterableDataset`` without ``__len__``, with or
without its own ``state_dict``, in a ``DataLoader`` or torchdata's ``StatefulDataLoader``), the loaders (one, a dict of two, a ``LightningDataModule``),
automatic or manual optimisation (actor + critic), validation settings, ModelCheckpoint +
EarlyStopping, the Trainer options (``devices=2, strategy="ddp"`` included) and the
RecoverCallback triggers.

Everything the run does is appended, in order, to a trace (``FILE.rank{r}``, one JSON list a
line, flushed at once so that a SIGKILL loses nothing already written):

- ``["loss", epoch, batch_idx, global_step, hex]`` from ``training_step`` (``global_step`` before
  the batch's optimizer steps; ``float.hex`` of the loss, ``actor|critic`` in manual optimisation);
- ``["metric", step, [[key, value], ...]]`` from the in-memory :class:`RecordingLogger`
  (floats as ``float.hex``);
- ``["ev", kind, epoch, batch_idx, global_step]`` loop events (``batch_start``, ``batch_end``,
  ``val_start``, ``val_end``, ``epoch_end``, ``train_end``; none in the sanity check) and
  ``save`` (a RecoverCallback save starts).

``--crash-at STEP`` stops the run at the end of the batch where ``trainer.global_step == STEP``
(a callback placed before RecoverCallback): ``raise`` raises :class:`Crash`; ``pause`` touches
``FILE.paused.rank{r}`` and sleeps, for the caller to SIGKILL the process group. A run that
finishes writes ``FILE.result.rank{r}.json`` (:func:`result`). The test imports this module
and runs the same :func:`fit` in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, Dataset, IterableDataset

from areal_lightning import RecoverCallback

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")

FEATURES = 8
BATCH = 4


@dataclass(frozen=True)
class Job:
    """What is trained (the recover triggers do not change the training)."""

    data: str = "plain"  # plain | augment | iterable | iterable_stateful | iterable_stateful_sdl
    workers: int = 0
    persistent: bool = False  # persistent_workers=True
    augment_rng: str = "torch"  # data="augment": noise from torch | random | numpy | all (in the worker with workers)
    worker_init: bool = False  # a worker_init_fn seeding NumPy from torch's worker seed, as many scripts do
    prefetch: int | None = None  # DataLoader(prefetch_factor=...)
    sdl: bool = False  # the map-style data in torchdata's StatefulDataLoader instead of a DataLoader
    loaders: str = "single"  # single | dict2 | datamodule
    manual: bool = False  # actor + critic, two optimisers, manual_backward
    mc_es: bool = False  # ModelCheckpoint(monitor=val_loss, save_top_k=2) + EarlyStopping
    n_train: int = 40  # 10 batches of 4
    epochs: int = 2
    devices: int = 1  # 2: strategy="ddp" on CPU
    trainer: tuple = ()  # extra Trainer kwargs as ((name, value), ...)
    freq_steps: int | None = 4
    freq_epochs: int | None = None
    fast_forward: str = "sampler"  # RecoverCallback(fast_forward=...): it never changes the training
    strategy: str = "ddp"  # with devices > 1: ddp | fsdp1 (FSDP1 on CPU)
    hooks: bool = False  # state changed in every hook of a step (see HookState, Counter, CountingStopper)
    bn: bool = False  # BatchNorm, and the GAN pattern: a forward in train mode at the module's epoch end
    io_mode: str = "sync"  # RecoverCallback(io_mode=...)
    async_executor: str = "thread"  # RecoverCallback(async_executor=...)
    freq_secs: int | None = None  # seconds trigger on a clock that advances 1 s per optimizer step
    memory: bool = False  # RecoverCallback(memory=...): the memory tier every step, in {root}/memory

    def trainer_kwargs(self) -> dict[str, Any]:
        return dict(self.trainer)

    def training_key(self) -> Job:
        """The job without the recover triggers: runs with equal keys train identically."""
        return dataclasses.replace(self, freq_steps=None, freq_epochs=None, fast_forward="sampler", io_mode="sync",
                                   freq_secs=None, async_executor="thread", memory=False)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        data = json.loads(text)
        data["trainer"] = tuple((k, v) for k, v in data["trainer"])
        return cls(**data)


# -- trace -------------------------------------------------------------------------------------


def rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class Trace:
    """The ordered record of one run (in memory; also appended to ``path.rank{r}`` if given)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.items: list[list] = []
        self.path = path
        self._file = None

    def add(self, *item: Any) -> None:
        entry = json.loads(json.dumps(list(item)))  # the same JSON form in-process and from a file
        self.items.append(entry)
        if self.path is not None:
            if self._file is None:
                self._file = open(f"{self.path}.rank{rank()}", "a")
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()

    @staticmethod
    def read(path: str | Path, r: int = 0) -> list[list]:
        p = Path(f"{path}.rank{r}")
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, (bool, int)):
        return v
    return float(v).hex()


class RecordingLogger(Logger):
    """An in-memory Logger: every ``log_metrics`` call becomes one trace entry."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.trace.add("metric", step, sorted([k, _value(v)] for k, v in metrics.items()))


class Marker(Callback):
    """Loop events into the trace (placed first: its hooks run before the other callbacks')."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def _ev(self, kind: str, trainer: pl.Trainer, batch_idx: int | None = None) -> None:
        self.trace.add("ev", kind, trainer.current_epoch, batch_idx, trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._ev("batch_start", trainer, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._ev("batch_end", trainer, batch_idx)

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._ev("val_start", trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._ev("val_end", trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._ev("epoch_end", trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._ev("train_end", trainer)


class Crash(Exception):
    pass


class CrashAt(Callback):
    """At the end of the batch where ``global_step == step``: raise, or touch a file and sleep
    (for a SIGKILL from outside), or ``preempt``: send this process SIGTERM (the step is then
    saved as a preemption checkpoint and the run stops with ``Preempted``)."""

    def __init__(self, step: int, mode: str = "raise", pause_file: str | None = None) -> None:
        self.step, self.mode, self.pause_file = step, mode, pause_file

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or getattr(self, "_sent", False):
            return
        if self.mode == "preempt":
            self._sent = True
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.mode == "raise":
            raise Crash(f"crash at step {self.step}")
        for cb in trainer.callbacks:  # an async save in flight becomes durable before the kill
            if isinstance(cb, RecoverCallback):
                cb.wait()
        Path(f"{self.pause_file}.rank{rank()}").touch()
        time.sleep(600)  # the test kills the process group with SIGKILL


# -- data --------------------------------------------------------------------------------------


class Regression(Dataset):
    """Deterministic random regression data; ``augment`` adds noise drawn from the process's
    global RNG (``torch``, ``random`` or NumPy): a worker's own stream with ``num_workers > 0``."""

    def __init__(self, n: int, seed: int, augment: str | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, FEATURES, generator=g), torch.randn(n, 1, generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.augment in ("torch", "all"):
            x = x + 0.1 * torch.randn(FEATURES)
        if self.augment in ("random", "all"):
            x = x * (1.0 + 0.1 * random.random())
        if self.augment in ("numpy", "all"):
            x = x + torch.from_numpy(0.1 * np.random.standard_normal(FEATURES).astype(np.float32))
        return x, self.y[i]


class Stream(IterableDataset):
    """An IterableDataset without ``__len__``: each pass is a permutation drawn from the global
    torch RNG when iteration starts."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, FEATURES, generator=g), torch.randn(n, 1, generator=g)

    def _order(self) -> tuple[list[int], int]:
        return torch.randperm(len(self.x)).tolist(), 0

    def __iter__(self):
        order, start = self._order()
        for j in range(start, len(order)):
            self._at = (order, j + 1)
            yield self.x[order[j]], self.y[order[j]]


class StatefulStream(Stream):
    """:class:`Stream` with its own ``state_dict`` / ``load_state_dict`` (the permutation and the
    number of samples yielded; a loaded state is continued by the next ``iter``)."""

    def __init__(self, n: int, seed: int) -> None:
        super().__init__(n, seed)
        self._at: tuple[list[int], int] | None = None
        self._loaded: tuple[list[int], int] | None = None

    def _order(self) -> tuple[list[int], int]:
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            return loaded
        return super()._order()

    def state_dict(self) -> dict[str, Any]:
        order, pos = self._at if self._at is not None else ([], 0)
        return {"order": list(order), "pos": pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = (list(state["order"]), int(state["pos"])) if state["order"] else None


def train_loader(job: Job) -> Any:
    if job.data == "iterable":
        return DataLoader(Stream(job.n_train, 7), batch_size=BATCH)
    if job.data == "iterable_stateful":
        return DataLoader(StatefulStream(job.n_train, 7), batch_size=BATCH)
    if job.data == "iterable_stateful_sdl":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(StatefulStream(job.n_train, 7), batch_size=BATCH)
    ds = Regression(job.n_train, 7, augment=job.augment_rng if job.data == "augment" else None)
    extra: dict[str, Any] = {"worker_init_fn": seed_numpy_per_worker} if job.worker_init else {}
    if job.prefetch is not None:
        extra["prefetch_factor"] = job.prefetch
    if job.sdl:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=job.workers,
                                  persistent_workers=job.persistent, **extra)
    return DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=job.workers, persistent_workers=job.persistent,
                      **extra)


def seed_numpy_per_worker(worker_id: int) -> None:
    """The usual worker_init_fn: NumPy seeded from the worker's torch seed."""
    np.random.seed(torch.initial_seed() % 2**32)


def val_loader() -> DataLoader:
    return DataLoader(Regression(16, 99), batch_size=BATCH)


def train_loaders(job: Job) -> Any:
    if job.loaders == "dict2":
        second = Regression(24, 5, augment=job.augment_rng if job.data == "augment" else None)
        return {"a": train_loader(job), "b": DataLoader(second, batch_size=BATCH, shuffle=True, num_workers=job.workers)}
    return train_loader(job)


class DataModule(pl.LightningDataModule):
    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job

    def train_dataloader(self):
        return train_loaders(self.job)

    def val_dataloader(self):
        return val_loader()


# -- model -------------------------------------------------------------------------------------


def mlp(bn: bool = False) -> torch.nn.Module:
    norm = [torch.nn.BatchNorm1d(16)] if bn else []
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), *norm, torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))


class Counter(Callback):
    """A user callback with state that every hook of a step changes; its batch end also draws
    from the global torch RNG (so the RNG state saved must be the one after it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts = {"batch_end": 0, "epoch_end": 0, "val_end": 0}
        self.draws = 0.0

    @property
    def state_key(self) -> str:
        return f"Counter[{self.name}]"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts["batch_end"] += 1
        self.draws += torch.rand(1).item()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.counts["epoch_end"] += 1

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.counts["val_end"] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "draws": self.draws}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counts, self.draws = dict(state_dict["counts"]), state_dict["draws"]


class CountingStopper(EarlyStopping):
    """A monitoring callback (Lightning runs its ``on_train_epoch_end`` after the module's)."""

    def __init__(self) -> None:
        super().__init__(monitor="train_loss_avg", patience=1000, check_on_train_epoch_end=True)
        self.epoch_end_calls = 0

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.epoch_end_calls += 1
        super().on_train_epoch_end(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "epoch_end_calls": self.epoch_end_calls}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.epoch_end_calls = state_dict["epoch_end_calls"]


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))


class Net(pl.LightningModule):
    def __init__(self, trace: Trace, job: Job) -> None:
        super().__init__()
        self.trace = trace
        self.job = job
        self.net = mlp(job.bn)
        if job.hooks:
            self.register_buffer("loss_ema", torch.zeros(()))  # updated in on_train_batch_end
            self.counts = {"batch_end": 0, "epoch_end": 0, "val_end": 0}
            if job.strategy != "fsdp1":
                self.ema = mlp(job.bn).requires_grad_(False)  # an EMA of the weights, as users keep one
                self.ema.load_state_dict(self.net.state_dict())
        if job.manual:
            self.critic = mlp()
            self.automatic_optimization = False

    def _record(self, batch_idx: int, global_step: int, text: str) -> None:
        self.trace.add("loss", self.current_epoch, batch_idx, global_step, text)

    def training_step(self, batch, batch_idx):
        mse = torch.nn.functional.mse_loss
        step = self.trainer.global_step  # before this batch's optimizer steps
        extra = None
        if isinstance(batch, dict):
            batch, extra = batch["a"], batch["b"]
        x, y = batch
        if self.job.manual:
            opt_actor, opt_critic = self.optimizers()
            critic_loss = mse(self.critic(x), y)
            opt_critic.zero_grad()
            self.manual_backward(critic_loss)
            opt_critic.step()
            actor_loss = mse(self.net(x), y) + 0.1 * self.critic(x).detach().mean()
            opt_actor.zero_grad()
            self.manual_backward(actor_loss)
            opt_actor.step()
            for sched in self.lr_schedulers():
                sched.step()
            self._record(batch_idx, step, f"{actor_loss.item().hex()}|{critic_loss.item().hex()}")
            loss = actor_loss.detach()
        else:
            loss = mse(self.net(x), y)
            if extra is not None:
                loss = loss + 0.5 * mse(self.net(extra[0]), extra[1])
            self._record(batch_idx, step, loss.item().hex())
        self.log("train_loss", loss, on_step=True)
        self.log("train_loss_avg", loss, on_step=False, on_epoch=True)  # epoch-aggregated
        return None if self.job.manual else loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if not self.job.hooks:
            return
        self.counts["batch_end"] += 1
        loss = outputs["loss"] if isinstance(outputs, dict) else torch.zeros(())
        mean = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        self.loss_ema.mul_(0.9).add_(0.1 * mean)
        if hasattr(self, "ema"):
            with torch.no_grad():
                for e, p in zip(self.ema.parameters(), self.net.parameters()):
                    e.mul_(0.9).add_(p.detach(), alpha=0.1)
        self.log("loss_ema", self.loss_ema, on_step=True)

    def on_train_epoch_end(self) -> None:
        if not self.job.hooks and not self.job.bn:
            return
        if self.job.hooks:
            self.counts["epoch_end"] += 1
            self.log("epoch_ends", float(self.counts["epoch_end"]))
        if self.job.bn:  # the GAN example's pattern: the generator runs in train mode at epoch end
            with torch.no_grad():
                self.net(torch.randn(8, FEATURES, device=self.device))

    def on_validation_end(self) -> None:
        if self.job.hooks and not self.trainer.sanity_checking:
            self.counts["val_end"] += 1

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.job.hooks:
            checkpoint["counts"] = dict(self.counts)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.job.hooks:
            self.counts = dict(checkpoint["counts"])

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), on_epoch=True)

    def configure_optimizers(self):
        if self.job.manual:
            opts = [torch.optim.AdamW(self.net.parameters(), lr=0.01), torch.optim.AdamW(self.critic.parameters(),
                                                                                         lr=0.02)]
            return opts, [{"scheduler": schedule(o), "interval": "step"} for o in opts]
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}


# -- one fit -----------------------------------------------------------------------------------


class SpiedRecover(RecoverCallback):
    """Notes in the trace where each recover save happened (its session's ``save``)."""

    def __init__(self, trace: Trace, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trace = trace

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        session = self._session
        if session is None:
            return
        save = session.save

        def spied_save(point: Any = None, shared: bool = True) -> None:
            self.trace.add("ev", "save", trainer.current_epoch, None, trainer.global_step)  # either tier
            save(point, shared=shared)

        session.save = spied_save  # type: ignore[method-assign]


def recover_callback(job: Job, root: Path, trace: Trace) -> RecoverCallback:
    return SpiedRecover(trace, fileroot=root / "recover", experiment_name="matrix", trial_name="t", user="u",
                        freq_steps=job.freq_steps, freq_epochs=job.freq_epochs, freq_secs=job.freq_secs,
                        io_mode=job.io_mode, async_executor=job.async_executor, fast_forward=job.fast_forward,
                        memory={"root": str(root / "memory")} if job.memory else None)


def _hex(v: Any) -> str | None:
    return None if v is None else float(v).hex()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def weights(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, str]:
    """A digest of every parameter and buffer of the trained model (full tensors)."""
    if "FSDP" in type(trainer.strategy).__name__:  # full tensors on every rank (a collective)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
    else:
        state = module.state_dict()
    return {k: _digest(v) for k, v in sorted(state.items())}


def result(trainer: pl.Trainer, rc: RecoverCallback, mc: ModelCheckpoint | None, es: EarlyStopping | None,
           module: pl.LightningModule | None = None) -> dict:
    """What a finished run ends with (besides its trace)."""
    out: dict[str, Any] = {
        "resumed_from": dataclasses.asdict(rc.resumed_from) if rc.resumed_from is not None else None,
        "global_step": trainer.global_step, "current_epoch": trainer.current_epoch,
    }
    if module is not None:
        out["weights"] = weights(trainer, module)
        out["hook_state"] = {"module": getattr(module, "counts", None),
                             "callbacks": {cb.state_key: json.loads(json.dumps(cb.state_dict(), default=_value))
                                           for cb in trainer.callbacks
                                           if isinstance(cb, (Counter, CountingStopper))}}
    if mc is not None:
        out["model_checkpoint"] = {
            "best_model_score": _hex(mc.best_model_score),
            "best_model_path": Path(mc.best_model_path).name,
            "kept": sorted([Path(p).name, _hex(s)] for p, s in mc.best_k_models.items()),
            "files": sorted(p.name for p in Path(mc.dirpath).iterdir()),
        }
    if es is not None:
        out["early_stopping"] = {"wait_count": es.wait_count, "stopped_epoch": es.stopped_epoch,
                                 "best_score": _hex(es.best_score)}
    return out


def fit(job: Job, root: Path, trace: Trace, crash_at: int | None = None, crash_mode: str = "raise",
        epochs: int | None = None, pause_file: str | None = None) -> dict:
    """One ``trainer.fit`` of ``job`` with its RecoverCallback trial under ``root``."""
    root = Path(root)
    pl.seed_everything(0, verbose=False)
    module = Net(trace, job)
    callbacks: list = [Marker(trace)]
    mc = es = None
    if job.mc_es:
        mc = ModelCheckpoint(dirpath=root / "mc", monitor="val_loss", save_top_k=2, filename="{epoch}-{step}")
        es = EarlyStopping(monitor="val_loss", patience=2)
        callbacks += [mc, es]
    if crash_at is not None:
        callbacks.append(CrashAt(crash_at, crash_mode, pause_file))
    if job.hooks:
        callbacks += [Counter("before"), CountingStopper()]
    rc = recover_callback(job, root, trace)
    callbacks.append(rc)
    if job.hooks:
        callbacks.append(Counter("after"))
    opts: dict[str, Any] = dict(num_sanity_val_steps=0)
    opts.update(job.trainer_kwargs())
    if job.devices > 1:
        opts.update(devices=job.devices, strategy=strategy(job.strategy))
    trainer = pl.Trainer(max_epochs=epochs or job.epochs, accelerator="cpu", logger=RecordingLogger(trace),
                         enable_checkpointing=job.mc_es, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1, callbacks=callbacks, **opts)
    if job.freq_secs is not None:  # a deterministic clock: one second per optimizer step
        rc.freq._clock = lambda: float(trainer.global_step)
    if job.loaders == "datamodule":
        trainer.fit(module, datamodule=DataModule(job))
    else:
        trainer.fit(module, train_loaders(job), val_loader())
    return result(trainer, rc, mc, es, module)


def strategy(name: str) -> Any:
    if name == "fsdp1":
        from tests.fsdp1_cpu import CPUFSDPStrategy

        return CPUFSDPStrategy()
    return name


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True, help="a Job as JSON")
    p.add_argument("--root", required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--crash-mode", default="pause", choices=["raise", "pause", "preempt"])
    p.add_argument("--epochs", type=int, default=None)
    args = p.parse_args()
    trace = Trace(args.trace)
    out = fit(Job.from_json(args.job), Path(args.root), trace, args.crash_at, args.crash_mode, args.epochs,
              pause_file=f"{args.trace}.paused")
    Path(f"{args.trace}.result.rank{rank()}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
