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
    out: dict[int, str] = {}
    for line in (root / "losses.jsonl").read_text().splitlines():
        item = json.loads(line)
        out[item["step"]] = item["loss"]
    return out


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
    load_user_checkpoint(ckpt)


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
    for name in ("last.ckpt", "step=16.ckpt"):
        load_user_checkpoint(folder / name)


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
            self.losses: dict[int, str] = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses[self.trainer.global_step] = loss.item().hex()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    def loader():
        g = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g), torch.randn(40, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)

    return pl, Net, loader


class Crash(Exception):
    pass


def fit(namespace: str, root: Path, crash_at: int | None = None, plugins: list | None = None,
        extra: list | None = None):
    from areal_lightning import RecoverCallback

    pl, Net, loader = lightning_classes(namespace)

    class CrashAt(pl.callbacks.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == crash_at:
                raise Crash(crash_at)

    pl.seed_everything(0, verbose=False)
    module = Net()
    recover = RecoverCallback(fileroot=root / "ckpt", experiment_name="e", trial_name="t", user="u", freq_steps=4)
    trainer = pl.Trainer(default_root_dir=root, max_epochs=2, accelerator="cpu", devices=1, logger=False,
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
    assert got.losses == {s: v for s, v in want.losses.items() if s >= 4}  # resumed after the save of step 4
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
    assert min(module.losses) == 20 and more.global_step == 30
