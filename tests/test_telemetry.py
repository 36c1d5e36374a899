"""Checkpoint telemetry reaches the user's Lightning loggers; no logger means no error."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger

from areal_lightning import HFSaverCallback, RecoverCallback
from tests.conftest import LMModule, make_trainer, tiny_llama, token_loader

KEYS = [f"checkpoint/{kind}/{m}" for kind in ("hf", "recover") for m in ("blocked_s", "write_s", "bytes", "gbps")]


def callbacks(root: Path, mode: str) -> list:
    common = dict(fileroot=root, experiment_name="e", trial_name="t", user="u", freq_steps=2)
    return [HFSaverCallback(mode=mode, **common), RecoverCallback(io_mode=mode, **common)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_csv_logger_gets_every_checkpoint_metric(tmp_path, mode) -> None:
    logger = CSVLogger(tmp_path / "logs", name="run")
    trainer = make_trainer(callbacks(tmp_path, mode), max_epochs=1, logger=logger, log_every_n_steps=1)
    trainer.fit(LMModule(tiny_llama()), token_loader(n_batches=6))
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    for key in KEYS:
        values = [float(r[key]) for r in rows if r.get(key)]
        assert len(values) >= 3, key  # saves after steps 2, 4, 6
        assert all(v >= 0 for v in values), key
    nbytes = [float(r["checkpoint/recover/bytes"]) for r in rows if r.get("checkpoint/recover/bytes")]
    assert min(nbytes) > 50_000  # the tiny Llama's weights + Adam state
    ages = [float(r["checkpoint/recover/age_s"]) for r in rows if r.get("checkpoint/recover/age_s")]
    assert ages and all(a >= 0 for a in ages)
    saves = [r for r in rows if r.get("checkpoint/recover/bytes")]
    for r in saves:  # one rank: it wrote every byte, and hashed them as it wrote them
        assert float(r["checkpoint/recover/rank_bytes"]) == float(r["checkpoint/recover/bytes"])
        assert float(r["checkpoint/recover/hash_s"]) > 0
        if mode == "sync":  # a sync save holds training for all of its duration (it was reported as 0)
            assert float(r["checkpoint/recover/blocked_s"]) >= float(r["checkpoint/recover/write_s"]) > 0


def test_no_logger_is_fine(tmp_path) -> None:
    trainer = make_trainer(callbacks(tmp_path, "async"), max_epochs=1, logger=False)
    trainer.fit(LMModule(tiny_llama()), token_loader(n_batches=4))
    assert (tmp_path / "checkpoints" / "u" / "e" / "t" / "recover_info" / "checkpoint_info.json").exists()


def test_tensorboard_logger_gets_the_metrics(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path / "tb", name="run")
    make_trainer(callbacks(tmp_path, "sync"), max_epochs=1, logger=logger, log_every_n_steps=1).fit(
        LMModule(tiny_llama()), token_loader(n_batches=4))
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    assert set(KEYS) <= set(acc.Tags()["scalars"])
