"""Soak: 200 async recover checkpoints (and HF exports) in one process: memory, file
descriptors, threads and child processes stay flat."""

from __future__ import annotations

import os
import threading

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from areal_lightning import RecoverCallback

pytestmark = pytest.mark.slow


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Probe(pl.Callback):
    def __init__(self) -> None:
        self.samples: dict[int, tuple[float, int, int, int]] = {}

    def _sample(self, trainer, key: int) -> None:
        trainer.callbacks[-1].wait()  # the save in flight is durable
        self.samples[key] = (rss_mib(), len(os.listdir("/proc/self/fd")), threading.active_count(), len(_children()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 2:  # runs before this step's save: the first save (step 1) is done
            self._sample(trainer, 1)

    def on_train_end(self, trainer, pl_module) -> None:
        self._sample(trainer, 200)  # runs after the recover callback's hooks: the 200th save is done


def _children() -> list[str]:
    me = str(os.getpid())
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if open(f"/proc/{pid}/stat").read().split()[3] == me:
                    out.append(pid)
            except OSError:
                pass
    return out


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.Linear(2048, 64))  # ~1 MB, +Adam 3 MB

    def training_step(self, batch, batch_idx):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def test_200_async_saves_keep_rss_fds_threads_children_flat(tmp_path) -> None:
    probe = Probe()
    recover = RecoverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", user="u",
                              freq_steps=1, io_mode="async")
    trainer = pl.Trainer(max_steps=200, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[probe, recover])
    trainer.fit(Wide(), DataLoader(torch.randn(800, 64), batch_size=4))
    (rss0, fds0, threads0, kids0), (rss1, fds1, threads1, kids1) = probe.samples[1], probe.samples[200]
    print(f"soak: RSS {rss0:.1f} -> {rss1:.1f} MiB ({(rss1 / rss0 - 1) * 100:+.1f}%), fds {fds0} -> {fds1}, "
          f"threads {threads0} -> {threads1}, children {kids0} -> {kids1}")
    assert rss1 <= rss0 * 1.10
    assert fds1 <= fds0 and threads1 <= threads0 and kids1 <= kids0
    assert trainer.global_step == 200
