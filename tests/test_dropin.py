"""A drop-in for the scripts users already have: either Lightning namespace, Lightning's defaults,
LightningCLI, their own ModelCheckpoint files and loggers continued as they were.

``tests/scripts/user_script.py`` is such a script (see its doc). Each case runs it uninterrupted,
SIGKILLed mid-epoch, and again with the same command; the losses, and the ``lightning_logs/``
tree (every file but TensorBoard's event files; checkpoint files by their weights), must equal
the uninterrupted run's, with no "dirpath has changed" warning.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness.losses import last_losses

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "user_script.py"
NAMESPACES = ["lightning.pytorch", "pytorch_lightning"]

pytestmark = pytest.mark.timeout(600)


def run_script(args: list[str], root: Path, namespace: str, kill_at: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "AREAL_NAMESPACE": namespace, "AREAL_LOSSES": str(root / "losses.jsonl"),
           "PYTHONPATH": str(REPO)}
    env.pop("AREAL_KILL_AT", None)
    if kill_at is not None:
        env["AREAL_KILL_AT"] = str(kill_at)
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    if kill_at is not None:
        assert proc.returncode == -9, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(root: Path) -> dict[int, str]:
    """The last loss written for each step (a resumed run writes the steps after the checkpoint again)."""
    return last_losses(root / "losses.jsonl")


def tree(root: Path) -> dict[str, object]:
    """Every file under ``root`` but TensorBoard's event files: text as text, checkpoints by weights."""
    out: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.name.startswith("events.out.tfevents"):
            continue
        rel = str(path.relative_to(root))
        if path.suffix == ".ckpt":
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
            out[rel] = {k: v.tolist() for k, v in ckpt["state_dict"].items()} | {"global_step": ckpt["global_step"]}
        elif path.name == "metrics.csv":
            out[rel] = csv_rows(path)
        else:
            out[rel] = path.read_text()
    return out


def csv_rows(path: Path) -> list[dict[str, str]]:
    """A ``metrics.csv``'s rows as written, without the columns of our own save timings
    (``checkpoint/recover/*``: seconds and bytes of each save, which differ from run to run)."""
    with open(path, newline="") as f:
        rows = [{k: v for k, v in row.items() if not k.startswith("checkpoint/")} for row in csv.DictReader(f)]
    return [row for row in rows if any(v for k, v in row.items() if k not in ("step", "epoch"))]


def interrupted_and_rerun(args_of, tmp_path: Path, namespace: str, kill_at: int) -> tuple[Path, Path, str]:
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    run_script(args_of(ref), ref, namespace)
    run_script(args_of(run), run, namespace, kill_at=kill_at)
    rerun = run_script(args_of(run), run, namespace)
    assert losses(run) == losses(ref)
    return ref, run, rerun.stderr + rerun.stdout


def best_and_last(run: Path, ref: Path) -> None:
    """The rerun's ModelCheckpoint bookkeeping (``best_model_path``, ``last_model_path``) is the
    uninterrupted run's, and ``load_from_checkpoint`` loads every file it names."""
    got, want = (json.loads((root / "result.json").read_text()) for root in (run, ref))
    assert got == want and got
    for entry in got:
        for path in {p for p in entry.values() if p}:
            load_user_checkpoint(run / path)


def load_user_checkpoint(path: str | Path) -> None:
    """``Model.load_from_checkpoint`` on a file the user's ModelCheckpoint wrote."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        user_script = importlib.import_module("user_script")
    finally:
        sys.path.remove(str(SCRIPT.parent))
    model = user_script.Model.load_from_checkpoint(str(path), map_location="cpu")
    assert isinstance(model, user_script.Model)


@pytest.mark.slow
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_lightning_defaults_continue_in_the_same_version(tmp_path, namespace) -> None:
    """Default logger and ModelCheckpoint: the rerun continues in ``version_0`` with the same files."""
    ref, run, output = interrupted_and_rerun(lambda root: ["plain", str(root)], tmp_path, namespace, kill_at=19)
    assert "dirpath has changed" not in output
    assert tree(run / "lightning_logs") == tree(ref / "lightning_logs")
    ckpt = run / "lightning_logs" / "version_0" / "checkpoints" / "epoch=2-step=36.ckpt"
    assert ckpt.is_file()  # Lightning's own single-file format, not a DCP directory
    best_and_last(run, ref)


@pytest.mark.slow
def test_model_checkpoint_bookkeeping_and_fixed_version_csv_rows_continue(tmp_path) -> None:
    """Monitored top-k + last + every_n_train_steps ModelCheckpoints and a fixed-version CSVLogger:
    the files written after the recover checkpoint are not left as stale copies (no ``-v1``), the
    best/last bookkeeping loads, and ``metrics.csv`` holds every row once."""
    def args(root: Path) -> list[str]:
        return ["plain", str(root), "--checkpoints", "monitor", "--csv-version", "fixed"]

    ref, run, output = interrupted_and_rerun(args, tmp_path, "lightning.pytorch", kill_at=19)
    assert "dirpath has changed" not in output
    got, want = tree(run / "lightning_logs"), tree(ref / "lightning_logs")
    assert sorted(got) == sorted(want)
    assert got == want
    rows = csv_rows(run / "lightning_logs" / "fixed" / "metrics.csv")
    assert len(rows) > 36 and [r["train_loss"] for r in rows if r["train_loss"]] == \
        [r["train_loss"] for r in csv_rows(ref / "lightning_logs" / "fixed" / "metrics.csv") if r["train_loss"]]
    folder = run / "lightning_logs" / "version_0" / "checkpoints"
    assert "step=16.ckpt" in {p.name for p in folder.iterdir()}  # written after the checkpoint, then again
    load_user_checkpoint(folder / "step=16.ckpt")
    best_and_last(run, ref)


# -- in-process: either namespace, the user's CheckpointIO and files ---------------------------


def lightning_classes(namespace: str):
    """A module and its data built on ``namespace``'s classes (a Trainer accepts only its own)."""
    pl = importlib.import_module(namespace)
    importlib.import_module(namespace + ".callbacks")
    importlib.import_module(namespace + ".plugins.io")

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
            self.losses: dict[tuple[int, int], str] = {}  # by (epoch, batch)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses[(self.current_epoch, batch_idx)] = loss.item().hex()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def loader():
        g = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)

    return pl, Net, loader


class Crash(Exception):
    pass


def fit(namespace: str, root: Path, crash_at: int | None = None, plugins: list | None = None,
        extra: list | None = None, max_epochs: int = 2, logger: object = False):
    from areal_lightning import RecoverCallback

    pl, Net, loader = lightning_classes(namespace)

    class CrashAt(pl.callbacks.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == crash_at:
                raise Crash(crash_at)

    pl.seed_everything(0, verbose=False)
    module = Net()
    recover = RecoverCallback(fileroot=root / "ckpt", experiment_name="e", trial_name="t", user="u", freq_steps=4)
    trainer = pl.Trainer(default_root_dir=root, max_epochs=max_epochs, accelerator="cpu", devices=1, logger=logger,
                         enable_progress_bar=False, enable_model_summary=False, plugins=plugins or [],
                         callbacks=[recover, CrashAt(), *(extra or [])])
    if crash_at is None:
        trainer.fit(module, loader())
    else:
        with pytest.raises(Crash):
            trainer.fit(module, loader())
    return trainer, module


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("io", ["none", "dcp", "async"])
def test_either_namespace_with_any_checkpoint_io(tmp_path, namespace, io) -> None:
    """``RecoverCallback`` under either namespace with no plugin, ``DCPCheckpointIO`` or the
    user's ``AsyncCheckpointIO``: the crash resumes exactly, and the user's own checkpoints keep
    the format of their CheckpointIO (Lightning's single file, or DCP when they chose it)."""
    from areal_lightning import DCPCheckpointIO

    pl = importlib.import_module(namespace)

    def plugins() -> list:
        return {"none": [], "dcp": [DCPCheckpointIO("sync")],
                "async": [pl.plugins.io.AsyncCheckpointIO()]}[io]

    def user_ckpt(folder: str = "user") -> list:
        return [pl.callbacks.ModelCheckpoint(dirpath=tmp_path / folder, save_last=True, every_n_train_steps=3)]

    _, want = fit(namespace, tmp_path / "ref", plugins=plugins(), extra=user_ckpt("ref_user"))
    fit(namespace, tmp_path / "run", crash_at=7, plugins=plugins(), extra=user_ckpt())
    trainer, got = fit(namespace, tmp_path / "run", plugins=plugins(), extra=user_ckpt())
    assert got.losses == {k: v for k, v in want.losses.items() if k >= (0, 4)}  # resumed after the save of step 4
    last = tmp_path / "user" / "last.ckpt"
    assert last.is_dir() == (io == "dcp")  # DCP only where the user passed DCPCheckpointIO
    assert sorted(p.name for p in last.parent.iterdir()) == sorted(p.name for p in (tmp_path / "ref_user").iterdir())
    if io != "dcp":
        assert torch.load(last, weights_only=False)["global_step"] == \
            torch.load(tmp_path / "ref_user" / "last.ckpt", weights_only=False)["global_step"]
        _, Net, _ = lightning_classes(namespace)
        Net.load_from_checkpoint(last)
        assert type(trainer.strategy.checkpoint_io).__name__ == ("AsyncCheckpointIO" if io == "async"
                                                                   else "TorchCheckpointIO")


def test_a_user_checkpoint_resumes_with_fit_ckpt_path(tmp_path) -> None:
    """``trainer.save_checkpoint`` of the user is a Lightning file, and ``fit(ckpt_path=...)`` of
    it resumes Lightning's way while RecoverCallback is attached."""
    trainer, _ = fit("lightning.pytorch", tmp_path / "a")
    trainer.save_checkpoint(tmp_path / "mine.ckpt")
    assert (tmp_path / "mine.ckpt").is_file()
    pl, Net, loader = lightning_classes("lightning.pytorch")
    from areal_lightning import RecoverCallback

    more = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False,
                      callbacks=[RecoverCallback(fileroot=tmp_path / "b", experiment_name="e", trial_name="t")])
    module = Net()
    more.fit(module, loader(), ckpt_path=tmp_path / "mine.ckpt")
    assert min(module.losses) == (2, 0) and more.global_step == 30


# -- LightningCLI ---------------------------------------------------------------------------------

CLI_CONFIG = """\
seed_everything: 0
trainer:
  max_epochs: 3
  default_root_dir: .
  log_every_n_steps: 1
  accelerator: cpu
  devices: 1
  enable_progress_bar: false
  callbacks:
    - class_path: areal_lightning.RecoverCallback
      init_args:
        fileroot: ckpt
        experiment_name: cli
        trial_name: t0
        freq_steps: 5
model:
  lr: 0.01
"""

CLI_ARGS = ["--seed_everything", "0", "--trainer.max_epochs", "3", "--trainer.default_root_dir", ".",
            "--trainer.log_every_n_steps", "1", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
            "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks+=areal_lightning.RecoverCallback", "--trainer.callbacks.fileroot", "ckpt",
            "--trainer.callbacks.experiment_name", "cli", "--trainer.callbacks.trial_name", "t0",
            "--trainer.callbacks.freq_steps", "5"]


@pytest.mark.slow
@pytest.mark.parametrize(("namespace", "given"), [("lightning.pytorch", "yaml"), ("pytorch_lightning", "command line"),
                                                 ("pytorch_lightning", "yaml with the memory tier")])
def test_lightning_cli_rerun_of_the_same_command_continues(tmp_path, namespace, given) -> None:
    """``fit --config cfg.yaml`` (callbacks by ``class_path``) or the callback given on the command
    line: SIGKILLed mid-epoch, the same command continues bit for bit, in the same version
    folder with the same ``config.yaml`` and checkpoint files. With the memory tier (its section
    in the YAML), from the slot of step 18, newer than the shared tier's step 15."""
    memory = "        memory:\n          enabled: true\n          root: shm\n"

    def args(root: Path) -> list[str]:
        if given.startswith("yaml"):
            config = CLI_CONFIG.replace("        freq_steps: 5\n", "        freq_steps: 5\n" + memory) \
                if "memory" in given else CLI_CONFIG
            (root / "cfg.yaml").write_text(config)
            return ["fit", "--config", "cfg.yaml"]
        return ["fit", *CLI_ARGS]

    ref, run, output = interrupted_and_rerun(args, tmp_path, namespace, kill_at=19)
    assert "dirpath has changed" not in output
    if "memory" in given:
        assert "resuming from the memory tier" in output and "after global step 17 " in output, output[-3000:]
        assert not (run / "shm").exists() or not any((run / "shm").rglob("SEALED.json"))  # removed at the end
    got = tree(run / "lightning_logs")
    assert got == tree(ref / "lightning_logs")
    assert "version_0/config.yaml" in got and "areal_lightning.RecoverCallback" in got["version_0/config.yaml"]
    best_and_last(run, ref)


def test_lightning_cli_help_documents_the_callbacks(tmp_path) -> None:
    """``--trainer.callbacks.help areal_lightning.RecoverCallback`` lists every argument with its doc."""
    for name, expect in [("RecoverCallback", ["fileroot", "the trial's folder", "freq_steps", "io_mode"]),
                         ("HFSaverCallback", ["fileroot", "model_attr", "max_keep"])]:
        out = subprocess.run([sys.executable, str(SCRIPT), "fit", "--trainer.callbacks.help",
                              f"areal_lightning.{name}"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr[-2000:]
        for word in expect:
            assert word in out.stdout, (name, word)


# -- Lightning's own callbacks beside ours ------------------------------------------------------

BUILTINS = {
    "early_stopping": lambda c: c.EarlyStopping(monitor="loss", patience=1, min_delta=10.0,
                                                check_on_train_epoch_end=True),
    "lr_monitor": lambda c: c.LearningRateMonitor(logging_interval="step"),
    "timer": lambda c: c.Timer(duration="00:01:00:00"),
    "swa": lambda c: c.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1),
    "ema": lambda c: c.EMAWeightAveraging(decay=0.9),
    "accumulation": lambda c: c.GradientAccumulationScheduler({0: 1, 1: 2}),
    "model_checkpoint": lambda c: c.ModelCheckpoint(monitor="loss", save_top_k=2, save_last=True,
                                                    every_n_train_steps=3),
}


def same(a: object, b: object) -> bool:
    """Equal states, tensors bit for bit."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


CASES = [(name, 13) for name in sorted(BUILTINS)] + [("swa", 22), ("swa", 25)]


@pytest.mark.parametrize(("name", "crash_at"), CASES)
def test_lightning_callbacks_beside_ours_resume_exactly(tmp_path, name, crash_at) -> None:
    """Each of Lightning's stateful callbacks beside RecoverCallback: a crash (mid-epoch 1; for
    SWA also after epoch 1's end and mid-epoch 2) and the rerun give the uninterrupted run's
    losses, weights, logged rows and callback state (the Timer's elapsed time continues from the
    checkpoint's)."""
    pl, _, _ = lightning_classes("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    class TimerSpy(pl.callbacks.Callback):
        """The Timer's saved elapsed time, and what the Timer says when training starts again."""

        def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            timer = next(cb for cb in trainer.callbacks if isinstance(cb, pl.callbacks.Timer))
            self.saved = checkpoint["callbacks"][timer.state_key]["time_elapsed"]["train"]

        def on_train_start(self, trainer, pl_module) -> None:
            timer = next(cb for cb in trainer.callbacks if isinstance(cb, pl.callbacks.Timer))
            self.at_start = timer.time_elapsed("train")

    def run(root: Path, crash: int | None = None):
        made = BUILTINS[name](pl.callbacks)
        spy = TimerSpy() if name == "timer" else pl.callbacks.Callback()
        logger = CSVLogger(root, name="logs", version="fixed")
        trainer, module = fit("lightning.pytorch", root, crash_at=crash, extra=[made, spy], max_epochs=3,
                              logger=logger)
        return trainer, module, made, spy

    _, want, ref_cb, _ = run(tmp_path / "ref")
    run(tmp_path / "run", crash=crash_at)
    trainer, got, cb, spy = run(tmp_path / "run")
    assert got.losses == {k: v for k, v in want.losses.items() if k >= min(got.losses)}
    assert min(got.losses) > (0, 0)  # it resumed
    assert same(got.state_dict(), want.state_dict())
    if name == "timer":
        assert spy.saved > 0 and spy.at_start >= spy.saved  # continued from the checkpoint's elapsed time
    elif name == "model_checkpoint":
        def strip(state: dict) -> dict:
            return {k: (os.path.basename(v) if isinstance(v, str) else v) for k, v in state.items()
                    if k not in ("dirpath", "best_k_models")}
        assert same(strip(cb.state_dict()), strip(ref_cb.state_dict()))
        assert sorted(os.listdir(cb.dirpath)) == sorted(os.listdir(ref_cb.dirpath))
    else:
        assert same(cb.state_dict(), ref_cb.state_dict())
    assert csv_rows(tmp_path / "run" / "logs" / "fixed" / "metrics.csv") == \
        csv_rows(tmp_path / "ref" / "logs" / "fixed" / "metrics.csv")


def test_wandb_offline_continues_the_same_run(tmp_path, recwarn) -> None:
    """``WandbLogger(offline=True)``: the rerun continues the interrupted run's id (no new run;
    the one Lightning opened for the start is dropped), and the default ModelCheckpoint, whose
    folder is named after the run id, keeps its files and bookkeeping."""
    wandb = pytest.importorskip("wandb")
    os.environ.setdefault("WANDB_SILENT", "true")
    from lightning.pytorch.loggers import WandbLogger

    def run(root: Path, crash: int | None = None):
        logger = WandbLogger(save_dir=str(root), project="p", offline=True)
        try:
            trainer, _ = fit("lightning.pytorch", root, crash_at=crash, max_epochs=3, logger=logger)
        finally:
            wandb.finish()  # a new process has no run in progress
        return trainer, logger

    _, ref_logger = run(tmp_path / "ref")
    _, first = run(tmp_path / "run", crash=13)
    trainer, again = run(tmp_path / "run")
    assert again.version == first.version
    assert not [w for w in recwarn if "dirpath has changed" in str(w.message)]
    runs = sorted(p.name for p in (tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{first.version}" in name for name in runs), runs  # (+"-1" in the same second)
    folder = tmp_path / "run" / "p" / first.version / "checkpoints"
    assert trainer.checkpoint_callback.dirpath == str(folder)
    assert sorted(os.listdir(folder)) == sorted(os.listdir(tmp_path / "ref" / "p" / ref_logger.version / "checkpoints"))
    assert [p.name for p in (tmp_path / "run" / "p").iterdir()] == [first.version]
