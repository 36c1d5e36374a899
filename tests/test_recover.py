"""RecoverCallback in-process: corruption, mismatches, hooks, loaders, and the Lightning internals it relies on.

Crashes here are exceptions raised from a callback (fast); the SIGKILL matrix is in
``test_recover_e2e.py``.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from areal_lightning import (
    CheckpointCorruptError,
    ConfigError,
    DCPCheckpointIO,
    RecoverCallback,
    StepInfo,
    callbacks_from_config,
)
from areal_lightning.commit.recover_store import INFO_FILES
from areal_lightning.errors import RecoverMismatchError, TrialLockedError
from tests.conftest import Crash, CrashAt, LMModule, tiny_llama, token_loader


class Data(Dataset):
    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Net(pl.LightningModule):
    def __init__(self, use_estimated: bool = False, **hparams: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        self.use_estimated = use_estimated
        self.losses: dict[int, str] = {}
        self.resumed_with: list[StepInfo] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.hparams.get("outside"):
            loss = loss + 0 * self.outside[0].sum()  # stepped with no gradient: it stays 0
        self.losses[self.trainer.global_step + 1] = loss.item().hex()
        return loss

    def configure_optimizers(self):
        if self.use_estimated:
            assert self.trainer.estimated_stepping_batches > 0  # Lightning issue #20550
        params = list(self.parameters())
        if self.hparams.get("outside"):  # a parameter the optimizer steps that is not the module's
            self.outside = [torch.nn.Parameter(torch.zeros(3))]  # (a list: not registered)
            params += self.outside
        opt = torch.optim.AdamW(params, lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_resume(self, trainer, step_info) -> None:
        self.resumed_with.append(step_info)



def recover(root: Path, **kwargs: Any) -> RecoverCallback:
    kwargs.setdefault("freq_steps", 4)
    return RecoverCallback(fileroot=root, experiment_name="e", trial_name="t", user="u", **kwargs)


def trainer(callbacks: list, **kwargs: Any) -> pl.Trainer:
    opts: dict[str, Any] = dict(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    opts.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **opts)


def plain_loader(**kwargs: Any) -> DataLoader:
    return DataLoader(Data(), batch_size=4, shuffle=True, **kwargs)


def run(root: Path, crash_at: int | None = None, loader_fn=plain_loader, module_kwargs: dict | None = None,
        cb_kwargs: dict | None = None, **trainer_kwargs: Any) -> Net:
    pl.seed_everything(0, verbose=False)
    module = Net(**(module_kwargs or {}))
    callbacks: list = [recover(root, **(cb_kwargs or {}))]
    if crash_at is not None:
        callbacks.insert(0, CrashAt(crash_at))
    t = trainer(callbacks, **trainer_kwargs)
    if crash_at is None:
        t.fit(module, loader_fn())
    else:
        with pytest.raises(Crash):
            t.fit(module, loader_fn())
    return module


def interrupted_equals_uninterrupted(tmp_path: Path, crash_at: int, **kwargs: Any) -> Net:
    want = run(tmp_path / "ref", **kwargs).losses
    first = run(tmp_path / "run", crash_at=crash_at, **kwargs).losses
    second = run(tmp_path / "run", **kwargs)
    assert {**first, **second.losses} == want
    for step, loss in second.losses.items():
        assert first.get(step, loss) == loss  # recomputed steps are identical too
    return second


def trial(root: Path) -> Path:
    return root / "checkpoints" / "u" / "e" / "t"


# -- exactness variants ------------------------------------------------------------------


def test_exception_crash_resumes_exactly_and_calls_hooks(tmp_path) -> None:
    import warnings

    seen: list[tuple[int, int]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = interrupted_equals_uninterrupted(
            tmp_path, crash_at=6,
            cb_kwargs={"on_resume": lambda tr, m, s: seen.append((s.global_step, s.weight_version))})
    # Lightning warns that a plain DataLoader resumed mid-epoch "is not resumable": here it is.
    assert not [w for w in caught if "not resumable" in str(w.message)]
    assert seen == [(3, 4)]  # the last checkpoint was after step 4 (0-based index 3)
    assert resumed.resumed_with == [StepInfo(epoch=0, epoch_step=3, global_step=3, steps_per_epoch=10)]
    assert resumed.resumed_with[0].next() == StepInfo(0, 4, 4, 10)


def test_estimated_stepping_batches_with_a_stateful_loader(tmp_path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    interrupted_equals_uninterrupted(tmp_path, crash_at=6, module_kwargs={"use_estimated": True},
                                     loader_fn=lambda: StatefulDataLoader(Data(), batch_size=4, shuffle=True))


def test_two_train_loaders(tmp_path) -> None:
    class TwoLoaderNet(Net):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch["a"], batch_idx) + 0 * self.net(batch["b"][0]).sum()

    def loaders():
        return {"a": plain_loader(), "b": DataLoader(Data(24), batch_size=4, shuffle=True)}

    want = None
    for root, crash in (("ref", None), ("run", 7), ("run", None)):
        pl.seed_everything(0, verbose=False)
        module = TwoLoaderNet()
        cbs: list = [recover(tmp_path / root)] + ([CrashAt(crash)] if crash else [])
        t = trainer(cbs)
        if crash:
            with pytest.raises(Crash):
                t.fit(module, loaders())
            first = module.losses
        else:
            t.fit(module, loaders())
            if root == "ref":
                want = module.losses
            else:
                assert {**first, **module.losses} == want


def test_gradient_accumulation_saves_only_after_optimizer_steps(tmp_path) -> None:
    interrupted_equals_uninterrupted(tmp_path, crash_at=3, accumulate_grad_batches=2, cb_kwargs={"freq_steps": 2})


def test_explicit_ckpt_path_wins_over_a_damaged_auto_checkpoint(tmp_path) -> None:
    run(tmp_path, crash_at=9)
    keep = tmp_path / "copy"
    shutil.copytree(trial(tmp_path) / "default" / "recover_checkpoint", keep)
    shard = next((trial(tmp_path) / "default" / "recover_checkpoint").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 0xFF]))
    pl.seed_everything(0, verbose=False)
    module = Net()
    trainer([recover(tmp_path)]).fit(module, plain_loader(), ckpt_path=keep)
    assert min(module.losses) == 9  # resumed after step 8 from the explicit copy


# -- corruption and mismatches: clear errors, nothing touched --------------------------------


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(trial(root).rglob("*")) if p.is_file() and p.name != ".lock"}


def damage_shard(t: Path) -> Path:
    shard = next((t / "default" / "recover_checkpoint").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard


def truncate_shard(t: Path) -> Path:
    shard = next((t / "default" / "recover_checkpoint").glob("__0_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    return shard


def truncate_metadata(t: Path) -> Path:
    meta = t / "default" / "recover_checkpoint" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:20])
    return meta


def delete_metadata(t: Path) -> Path:
    meta = t / "default" / "recover_checkpoint" / ".metadata"
    meta.unlink()
    return meta


def garbage_json(name: str):
    def damage(t: Path) -> Path:
        path = t / "recover_info" / name
        path.write_text("{not json")
        return path
    return damage


def missing_json(name: str):
    def damage(t: Path) -> Path:
        path = t / "recover_info" / name
        path.unlink()
        return path
    return damage


def other_step(t: Path) -> Path:
    path = t / "recover_info" / "step_info.json"
    data = json.loads(path.read_text())
    data["global_step"] = 99
    path.write_text(json.dumps(data))
    return path


DAMAGE = {
    # found at load, by the rank reading the item, which the message names
    "flipped-byte-in-shard": (damage_shard, "fails its CRC32C check in '"),
    "truncated-shard": (truncate_shard, "truncated"),
    "truncated-metadata": (truncate_metadata, "truncated"),
    "missing-metadata": (delete_metadata, "missing"),
    "garbage-checkpoint-info": (garbage_json("checkpoint_info.json"), "not valid JSON"),
    "garbage-step-info": (garbage_json("step_info.json"), "not valid JSON"),
    "missing-dataloader-info": (missing_json("dataloader_info.json"), "missing"),
    "info-for-another-step": (other_step, "does not describe the checkpoint"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_gives_a_clear_error_and_touches_nothing(tmp_path, case) -> None:
    run(tmp_path, crash_at=6)
    damage, words = DAMAGE[case]
    bad_file = damage(trial(tmp_path))
    before = snapshot(tmp_path)
    module = Net()
    with pytest.raises(CheckpointCorruptError) as info:
        trainer([recover(tmp_path)]).fit(module, plain_loader())
    assert str(bad_file) in str(info.value) and words in str(info.value)
    assert "delete" in str(info.value).lower()  # says what to do
    assert module.losses == {}  # never a silent fresh start
    assert snapshot(tmp_path) == before


def test_a_checkpoint_with_the_earlier_whole_file_crc32_manifest_still_resumes_and_is_fully_checked(tmp_path) -> None:
    """Manifests written before per-item CRC32C list ``{"size", "crc32"}`` (zlib, whole
    file): such a checkpoint still resumes exactly, and a flipped byte is still found, by
    the full pass before loading (its items carry no checksum a load could verify)."""
    import zlib

    want = run(tmp_path / "ref").losses
    run(tmp_path / "run", crash_at=6)
    t = trial(tmp_path / "run")
    ckpt_dir, info_path = t / "default" / "recover_checkpoint", t / "recover_info" / "checkpoint_info.json"
    info = json.loads(info_path.read_text())
    info["files"] = {p.name: {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())}
                     for p in sorted(ckpt_dir.iterdir())}
    del info["checksum"]
    info_path.write_text(json.dumps(info))
    pristine = t.parent / "pristine"
    shutil.copytree(t, pristine)
    shard = damage_shard(t)
    with pytest.raises(CheckpointCorruptError, match=f"{shard} fails its CRC32 check"):
        trainer([recover(tmp_path / "run")]).fit(Net(), plain_loader())
    shutil.rmtree(t)
    shutil.copytree(pristine, t)
    resumed = run(tmp_path / "run")
    assert resumed.losses == {k: v for k, v in want.items() if k >= min(resumed.losses)} and min(resumed.losses) <= 6


def test_a_mid_epoch_position_of_a_distributed_sampler_is_refused_by_a_plain_loader() -> None:
    """A mid-epoch checkpoint counts batches of the saved sampler's order: a run whose loader
    draws another order (one process without a DistributedSampler) is refused before its first
    batch, naming both samplers; at an epoch boundary any loader continues."""
    from torch.utils.data.distributed import DistributedSampler

    from areal_lightning.capture.loader import LoaderTracker

    def resumed(saved: str, boundary: bool, loader: DataLoader) -> Any:
        tracker = LoaderTracker()
        tracker.load_state_dict({"at_boundary": boundary, "loaders": {"0": {
            "batches_done": 3, "sampler": saved, "stateful": False, "batch_size": 4, "num_workers": 0,
            "iter_rng": torch.get_rng_state(), "first_rng": torch.get_rng_state()}}}, torch.get_rng_state())
        return next(iter(tracker.track(loader, 0)))

    with pytest.raises(RecoverMismatchError, match="after 3 batches of an epoch drawn by a DistributedSampler, but "
                                                   "this run draws its batches with a RandomSampler"):
        resumed("DistributedSampler", False, DataLoader(Data(), batch_size=4, shuffle=True))
    with pytest.raises(RecoverMismatchError, match="drawn by a RandomSampler, but this run draws its batches with a "
                                                   "DistributedSampler.*one process without a DistributedSampler"):
        resumed("RandomSampler", False, DataLoader(Data(), batch_size=4,
                                                   sampler=DistributedSampler(Data(), num_replicas=2, rank=0)))
    assert resumed("DistributedSampler", True, DataLoader(Data(), batch_size=4, shuffle=True)) is not None
    assert resumed("SequentialSampler", False, DataLoader(Data(), batch_size=4)) is not None


def test_deleting_recover_info_starts_fresh(tmp_path) -> None:
    run(tmp_path, crash_at=6)
    shutil.rmtree(trial(tmp_path) / "recover_info")
    module = run(tmp_path)
    assert min(module.losses) == 1


def test_recover_info_is_json_and_describes_the_checkpoint(tmp_path) -> None:
    run(tmp_path, crash_at=6)
    info_dir = trial(tmp_path) / "recover_info"
    assert sorted(p.name for p in info_dir.iterdir()) == sorted(INFO_FILES)
    info = {p.name: json.loads(p.read_text()) for p in info_dir.iterdir()}
    assert info["step_info.json"]["global_step"] == 3 and info["step_info.json"]["next"]["global_step"] == 4
    ckpt = info["checkpoint_info.json"]
    assert ckpt["global_step"] == 4 and ckpt["world_size"] == 1 and ckpt["strategy"] == "SingleDeviceStrategy"
    assert set(ckpt["versions"]) == {"torch", "lightning", "transformers", "areal_lightning"}
    files = {p.name for p in (trial(tmp_path) / "default" / "recover_checkpoint").iterdir()}
    assert set(ckpt["files"]) == files and ".metadata" in files
    assert info["dataloader_info.json"]["batches_done"] == 4
    assert info["dataloader_info.json"]["loaders"][0]["class"] == "DataLoader"


@pytest.mark.parametrize("outside", [False, True], ids=["module-parameters", "a-parameter-outside-the-module"])
def test_optimizer_states_are_keyed_by_name_unless_a_parameter_has_none(tmp_path, outside) -> None:
    """Every optimizer state keyed by parameter name (any strategy family resumes it), unless
    the optimizer steps a parameter outside the LightningModule: then by position, as Lightning
    keys it, and ``checkpoint_info.json`` says which; both resume exactly."""
    interrupted_equals_uninterrupted(tmp_path, crash_at=6, module_kwargs={"outside": outside})
    ckpt = json.loads((trial(tmp_path / "run") / "recover_info" / "checkpoint_info.json").read_text())
    assert ckpt["optimizer_keys"] == ("index" if outside else "names")
    loaded = DCPCheckpointIO().load_checkpoint(trial(tmp_path / "run") / "default" / "recover_checkpoint")
    keys = set(loaded["optimizer_states"][0]["state"])
    assert keys == ({0, 1, 2, 3, 4} if outside else {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"})


# -- modes, validation, wiring ----------------------------------------------------------------


def test_mode_off_neither_saves_nor_resumes(tmp_path) -> None:
    run(tmp_path, crash_at=6)
    before = snapshot(tmp_path)
    module = run(tmp_path, cb_kwargs={"mode": "off"})
    assert min(module.losses) == 1
    assert snapshot(tmp_path) == before


def test_bad_arguments_name_the_field(tmp_path) -> None:
    for kwargs, field in ((dict(mode="maybe"), "recover.mode"), (dict(freq_steps=0), "recover.freq_steps"),
                          (dict(retries=-1), "recover.retries"), (dict(io_mode="fast"), "io_mode"),
                          (dict(name="recover_info"), "name"), (dict(on_resume=3), "on_resume")):
        with pytest.raises(ConfigError) as info:
            recover(tmp_path, **kwargs)
        assert info.value.field == field


def test_a_second_run_on_the_same_trial_is_refused(tmp_path) -> None:
    class SecondRun(Callback):
        def on_train_batch_end(self, trainer_, pl_module, outputs, batch, batch_idx) -> None:
            if trainer_.global_step == 1:
                trainer([recover(tmp_path)]).fit(Net(), plain_loader())

    with pytest.raises(TrialLockedError, match="being trained by another process"):
        trainer([recover(tmp_path), SecondRun()]).fit(Net(), plain_loader())


def test_a_changed_num_workers_is_a_recover_mismatch(tmp_path) -> None:
    run(tmp_path, crash_at=6, loader_fn=lambda: plain_loader(num_workers=2))
    with pytest.raises(RecoverMismatchError, match=r"num_workers=1, but the checkpoint was written with "
                                                   r"num_workers=2.*Use num_workers=2, or delete .* to start fresh"):
        run(tmp_path, loader_fn=lambda: plain_loader(num_workers=1))
    resumed = run(tmp_path, loader_fn=lambda: plain_loader(num_workers=2))  # nothing was changed by the refusal
    assert min(resumed.losses) == 5


def test_the_worker_processes_of_an_unfinished_epoch_end_with_fit_as_without_the_callback(tmp_path) -> None:
    """A run stopped mid-epoch (``max_steps``) leaves no DataLoader worker running once ``fit``
    returns, as plain Lightning leaves none: the callback keeps no reference to the epoch's
    iterator. (Were it kept, the workers would live on until the garbage collector broke the
    cycle, and its finalizers, run in an unlucky order, wait 5 s for each worker.)"""
    import gc
    import multiprocessing

    def workers_left(callbacks: list) -> int:
        pl.seed_everything(0, verbose=False)
        trainer(callbacks, max_steps=6).fit(Net(), plain_loader(num_workers=2))  # 10 batches an epoch
        return len(multiprocessing.active_children())

    gc.collect()
    gc.disable()  # only references count: no collection may end the workers behind the test's back
    try:
        assert workers_left([]) == 0  # plain Lightning
        assert workers_left([recover(tmp_path)]) == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("change", ["batch_size", "shorter_dataset"])
def test_a_changed_loader_or_dataset_is_a_recover_mismatch_with_the_remedy(tmp_path, change) -> None:
    run(tmp_path, crash_at=6)  # checkpoint after step 4: 4 of the epoch's 10 batches trained
    loader = (lambda: DataLoader(Data(), batch_size=5, shuffle=True)) if change == "batch_size" else \
        (lambda: DataLoader(Data(12), batch_size=4, shuffle=True))
    with pytest.raises(RecoverMismatchError) as info:
        run(tmp_path, loader_fn=loader)
    assert f"delete {trial(tmp_path) / 'recover_info'} to start fresh" in str(info.value) or \
        "delete recover_info/ to start fresh" in str(info.value)
    assert ("batch_size=5" if change == "batch_size" else "ended after 3 batches") in str(info.value)


def test_both_callbacks_together_async(tmp_path, tokenizer) -> None:
    """HF exports and recover checkpoints share the model folder; neither cleans up the other."""
    cfg = {"fileroot": str(tmp_path), "experiment_name": "e", "trial_name": "t", "user": "u",
           "saver": {"freq_steps": 1, "mode": "async"}, "recover": {"mode": "on", "freq_steps": 1}}
    cbs = callbacks_from_config(cfg)
    assert [type(c).__name__ for c in cbs] == ["HFSaverCallback", "RecoverCallback"]
    trainer(cbs, max_epochs=1, plugins=[DCPCheckpointIO("async")]).fit(
        LMModule(tiny_llama(), tokenizer=tokenizer), token_loader(n_batches=4))
    names = sorted(p.name for p in (trial(tmp_path) / "default").iterdir())
    assert names == ["epoch0epochstep0globalstep0", "epoch0epochstep1globalstep1", "epoch0epochstep2globalstep2",
                     "epoch0epochstep3globalstep3", "recover_checkpoint"]
    saver_info = json.loads((trial(tmp_path) / "recover_info" / "saver_info.json").read_text())
    assert saver_info[cbs[0].state_key]["freq"]["last_fired_step"] == 4


def test_lightning_internals_auto_resume_relies_on(tmp_path) -> None:
    """Pins Lightning 2.6: the checkpoint path is resolved before callback hooks, and passes
    through ``_checkpoint_connector.resume_start`` right after ``setup`` (our hook); the train
    loaders come from ``fit_loop._data_source.dataloader``. The OnExceptionCheckpoint route
    (Lightning issue #19827: ckpt_path=None becomes "last") is not used."""
    import inspect

    from lightning.pytorch.trainer.connectors.checkpoint_connector import (
        _CheckpointConnector,
    )

    assert list(inspect.signature(_CheckpointConnector.resume_start).parameters)[:3] == [
        "self", "checkpoint_path", "weights_only"]
    src = inspect.getsource(_CheckpointConnector._restore_modules_and_callbacks)
    assert "self.resume_start(checkpoint_path" in src
    t = trainer([])
    assert callable(t.fit_loop._data_source.dataloader)
    # With OnExceptionCheckpoint present Lightning turns ckpt_path=None into "last" (the bug).
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    oe = OnExceptionCheckpoint(dirpath=tmp_path, filename="oe")
    t2 = trainer([oe], enable_checkpointing=True)  # a Checkpoint: refused with enable_checkpointing=False
    t2.state.fn = TrainerFn.FITTING
    with pytest.warns(UserWarning, match="no last checkpoint available"):
        assert t2._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, None, True, False) is None


def test_deleting_recover_info_after_a_crash_before_the_swap_still_starts_fresh(tmp_path, monkeypatch) -> None:
    """A complete new recover_info waits beside the old one (crash right before the swap);
    the user deletes recover_info/: the next run starts fresh, it does not roll forward."""
    from areal_lightning import CheckpointWriteError
    from areal_lightning._fault import ENV_VAR, reset_fault_counts

    reset_fault_counts()
    monkeypatch.setenv(ENV_VAR, "recover.swap.begin@2")
    pl.seed_everything(0, verbose=False)
    with pytest.raises(CheckpointWriteError, match="recover.swap.begin"):
        trainer([recover(tmp_path)]).fit(Net(), plain_loader())
    monkeypatch.delenv(ENV_VAR)
    assert any(p.name.startswith(".tmp-recover_info-8-") for p in trial(tmp_path).iterdir())
    shutil.rmtree(trial(tmp_path) / "recover_info")
    module = run(tmp_path)
    assert min(module.losses) == 1


class _Opaque:
    """A hyper-parameter value that is not a tensor, container or primitive."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.mark.parametrize("memory", [False, True], ids=["shared-tier", "memory-tier"])
def test_auto_resume_unpickles_with_weights_only_unless_told_otherwise(tmp_path, memory) -> None:
    """Auto-resume loads the non-tensor state with weights_only=True: an arbitrary object in
    the hyper-parameters of a checkpoint written with weights_only=False (a run with the default
    refuses it at its first save: tests/test_loadable_state.py) is refused with an explanation
    (nothing touched: with the memory tier, whose step is loaded while it is chosen, its slots
    too); allowlisting the type or weights_only=False (trusted storage) resumes."""
    tier = {"memory": {"root": str(tmp_path / "shm")}} if memory else {}
    run(tmp_path, crash_at=6, module_kwargs={"opaque": _Opaque(3)}, cb_kwargs={"weights_only": False, **tier})
    before = snapshot(tmp_path)
    slots = {str(p): p.read_bytes() for p in sorted((tmp_path / "shm").rglob("*")) if p.is_file()}
    assert bool(slots) == memory
    with pytest.raises(pickle.UnpicklingError, match="weights_only=True.*add_safe_globals"):
        run(tmp_path, module_kwargs={"opaque": _Opaque(3)}, cb_kwargs=tier)
    assert snapshot(tmp_path) == before
    if memory:  # every slot still sealed, no byte changed (the view folder a load reads aside)
        assert {k: v for k, v in ((str(p), p.read_bytes()) for p in sorted((tmp_path / "shm").rglob("*"))
                                  if p.is_file()) if "/resume/" not in k} == slots
    with torch.serialization.safe_globals([_Opaque]):
        resumed = run(tmp_path, module_kwargs={"opaque": _Opaque(3)}, cb_kwargs=tier)
    assert min(resumed.losses) == (6 if memory else 5)  # the slot of step 5, the checkpoint of step 4
    module = run(tmp_path, module_kwargs={"opaque": _Opaque(3)}, cb_kwargs={"weights_only": False}, max_epochs=3)
    assert min(module.losses) == max(resumed.losses) + 1  # resumed from its end, trusting the storage


def test_resharding_maps_a_distributed_sampler_position_or_explains_why_not() -> None:
    """Mid-epoch positions map by samples consumed when exact; otherwise a clear error (the
    2-process runs in tests/test_distributed.py prove the mapped runs train every sample once)."""
    from areal_lightning.capture.loader import remap_position

    def state(batches: int, sampler: str = "DistributedSampler", stateful: bool = False) -> dict:
        return {"at_boundary": False, "loaders": {"0": {"batches_done": batches, "sampler": sampler,
                                                        "stateful": stateful, "batch_size": 4}}}

    assert remap_position(state(3), 2, 1)["loaders"]["0"]["batches_done"] == 6
    assert remap_position(state(4), 1, 2)["loaders"]["0"]["batches_done"] == 2
    assert remap_position(state(3), 4, 2)["loaders"]["0"]["batches_done"] == 6
    assert remap_position({"at_boundary": True, "loaders": {}}, 1, 8) == {"at_boundary": True, "loaders": {}}
    with pytest.raises(ValueError, match="after 3 batches of the epoch on each of 1 ranks, 3 batches in all; that is "
                                         "not a whole number of batches for each of 2 ranks"):
        remap_position(state(3), 1, 2)
    with pytest.raises(ValueError, match="RandomSampler sampler, whose position cannot be mapped to 2 ranks"):
        remap_position(state(4, "RandomSampler"), 1, 2)
    with pytest.raises(ValueError, match="cannot be mapped"):
        remap_position(state(4, stateful=True), 2, 1)


# -- validation overlapping the checkpoint step (issue 13) --------------------------------


class ValNet(Net):
    """Logs train and validation losses; the validation loader is shuffled (its iterator draws
    from the global RNG, as a user's shuffled or augmented validation loader does)."""

    def __init__(self, **hparams: Any) -> None:
        super().__init__(**hparams)
        self.val_losses: list[tuple[int, str]] = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.val_losses.append((self.trainer.global_step, loss.item().hex()))
        self.log("val_loss", loss)

    def val_dataloader(self):
        return DataLoader(Data(16), batch_size=4, shuffle=True)


@pytest.mark.parametrize("val_check_interval", [4, 0.5], ids=["int", "float"])
def test_validation_due_at_the_checkpoint_step_runs_once_after_the_resume(tmp_path, val_check_interval) -> None:
    """The checkpoint of step 4 (or 5: val_check_interval=0.5 of 10 batches) is taken where a
    validation is due; the resumed run neither skips nor repeats it, and matches bit for bit."""
    freq = 4 if isinstance(val_check_interval, int) else 5
    kwargs: dict[str, Any] = dict(val_check_interval=val_check_interval, num_sanity_val_steps=0,
                                  cb_kwargs={"freq_steps": freq})
    runs = {}
    for name, root, crash in (("ref", "ref", None), ("first", "run", freq + 2), ("second", "run", None)):
        pl.seed_everything(0, verbose=False)
        module = ValNet()
        callbacks: list = [recover(tmp_path / root, **kwargs["cb_kwargs"])]
        if crash is not None:
            callbacks.insert(0, CrashAt(crash))
        t = trainer(callbacks, val_check_interval=val_check_interval, num_sanity_val_steps=0)
        if crash is None:
            t.fit(module, plain_loader())
        else:
            with pytest.raises(Crash):
                t.fit(module, plain_loader())
        runs[name] = module
    ref, first, second = runs["ref"], runs["first"], runs["second"]
    assert {**first.losses, **second.losses} == ref.losses
    assert min(second.losses) == freq + 1  # resumed right after the checkpoint's step
    # Validations: the one of the checkpoint step ran before the crash and is not run again.
    before = [v for v in first.val_losses if v[0] <= freq]
    assert before + second.val_losses == ref.val_losses


# -- fast-forward (issue 13) --------------------------------------------------------------


class CountingData(Data):
    """Appends every fetched index to a file (worker processes too); noise drawn from the
    torch RNG in ``__getitem__`` (augmentation)."""

    def __init__(self, log: Path, augment: bool = False) -> None:
        super().__init__()
        self.log, self.augment = log, augment

    def __getitem__(self, i: int):
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        x, y = super().__getitem__(i)
        return (x + 0.1 * torch.randn_like(x), y) if self.augment else (x, y)


def fetched(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_never_fetches_the_skipped_samples(tmp_path, workers, caplog) -> None:
    """Crash at step 7 of 10 per epoch, checkpoint of step 4: the resumed run fetches the 6
    remaining batches of the epoch and the next epoch's 10, never the 4 trained ones; with
    augmentation drawn from the RNG (in this process, or in the workers' own streams) the losses
    are still the uninterrupted ones."""
    import logging

    augment = True
    counts = {}

    def loader_for(name):
        return lambda: DataLoader(CountingData(tmp_path / f"{name}.log", augment), batch_size=4, shuffle=True,
                                  num_workers=workers)

    want = run(tmp_path / "ref", loader_fn=loader_for("ref")).losses
    first = run(tmp_path / "run", crash_at=7, loader_fn=loader_for("first")).losses
    with caplog.at_level(logging.INFO, logger="areal_lightning"):
        second = run(tmp_path / "run", loader_fn=loader_for("second")).losses
    assert {**first, **second} == want
    counts = {name: fetched(tmp_path / f"{name}.log") for name in ("ref", "second")}
    assert counts["ref"] == 80  # 2 epochs of 40 samples
    # with workers the loader prefetches ahead of the crash, but never the 16 skipped samples
    assert counts["second"] == 80 - 16
    assert "skipped 4 trained batches at the sampler (no sample fetched)" in caplog.text


def test_fast_forward_replay_fetches_the_skipped_samples(tmp_path, caplog) -> None:
    import logging

    def loader_for(name):
        return lambda: DataLoader(CountingData(tmp_path / f"{name}.log"), batch_size=4, shuffle=True)

    kw = {"cb_kwargs": {"fast_forward": "replay"}}
    want = run(tmp_path / "ref", loader_fn=loader_for("ref"), **kw).losses
    first = run(tmp_path / "run", crash_at=7, loader_fn=loader_for("first"), **kw).losses
    with caplog.at_level(logging.INFO, logger="areal_lightning"):
        second = run(tmp_path / "run", loader_fn=loader_for("second"), **kw).losses
    assert {**first, **second} == want
    assert fetched(tmp_path / "second.log") == 80
    assert "replayed 4 trained batches through the dataset in" in caplog.text
    with pytest.raises(ConfigError, match="fast_forward.*allowed: sampler, replay"):
        recover(tmp_path, fast_forward="skip")


# -- preemption (issue 13) -----------------------------------------------------------------


class SignalAt(Callback):
    """Sends a real signal to this process at the end of a step (before RecoverCallback's hook)."""

    def __init__(self, step: int, sig: int = 15, times: int = 1) -> None:
        self.step, self.sig, self.times = step, sig, times

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            import os

            for _ in range(self.times):
                os.kill(os.getpid(), self.sig)


def preempted_run(root: Path, step: int, sig: int = 15, times: int = 1, module_cls=Net, cb_kwargs=None,
                  **trainer_kwargs: Any):
    pl.seed_everything(0, verbose=False)
    module = module_cls()
    t = trainer([SignalAt(step, sig, times), recover(root, **(cb_kwargs or {}))], **trainer_kwargs)
    with pytest.raises(SystemExit) as exit_info:
        t.fit(module, plain_loader())
    return module, exit_info.value.code


def test_sigterm_saves_the_current_step_and_stops_with_the_documented_exit_code(tmp_path, caplog) -> None:
    """Checkpoints every 4 steps, SIGTERM (twice) at step 7: step 7 is checkpointed, the run
    exits 75, and the same command continues at step 8 with nothing redone."""
    import logging
    import signal

    previous = signal.getsignal(signal.SIGTERM)
    want = run(tmp_path / "ref").losses
    with caplog.at_level(logging.WARNING, logger="areal_lightning"):
        first, code = preempted_run(tmp_path / "run", 7, times=2)
    assert code == 75
    assert "SIGTERM: the recover checkpoint of global step 7 is durable" in caplog.text
    assert signal.getsignal(signal.SIGTERM) == previous  # handlers given back
    step = json.loads((trial(tmp_path / "run") / "recover_info" / "step_info.json").read_text())
    assert step["global_step"] == 6  # 0-based index of step 7
    second = run(tmp_path / "run").losses
    assert min(second) == 8 and max(first.losses) == 7
    assert {**first.losses, **second} == want


def test_preemption_at_a_validation_step_saves_after_the_validation(tmp_path) -> None:
    kwargs: dict[str, Any] = dict(val_check_interval=4, num_sanity_val_steps=0)
    pl.seed_everything(0, verbose=False)
    ref = ValNet()
    trainer([recover(tmp_path / "ref")], **kwargs).fit(ref, plain_loader())
    first, code = preempted_run(tmp_path / "run", 8, module_cls=ValNet, **kwargs)
    assert code == 75
    pl.seed_everything(0, verbose=False)
    second = ValNet()
    trainer([recover(tmp_path / "run")], **kwargs).fit(second, plain_loader())
    assert {**first.losses, **second.losses} == ref.losses and min(second.losses) == 9
    assert first.val_losses + second.val_losses == ref.val_losses  # the validation of step 8 ran once


def test_preempt_signals_are_configurable_and_validated(tmp_path) -> None:
    import signal

    first, code = preempted_run(tmp_path / "run", 5, sig=signal.SIGUSR1,
                                cb_kwargs={"preempt_signals": ["SIGTERM", "USR1"], "preempt_exit_code": 99})
    assert code == 99
    for bad, match in ((["SIGKILL"], "SIGKILL cannot be caught"), (["SIGNOPE"], "unknown signal 'SIGNOPE'"),
                       (3.5, "expected a list of signal names")):
        with pytest.raises(ConfigError, match=rf"preempt_signals: .*{match}"):
            recover(tmp_path, preempt_signals=bad)
    with pytest.raises(ConfigError, match="preempt_exit_code: expected an integer from 1 to 255"):
        recover(tmp_path, preempt_exit_code=0)
    # preempt_signals=None: SIGTERM keeps Lightning's own behaviour (stop after the batch, no checkpoint)
    pl.seed_everything(0, verbose=False)
    t = trainer([SignalAt(6), recover(tmp_path / "none", preempt_signals=None)])
    with pytest.raises(SystemExit) as info:
        t.fit(Net(), plain_loader())
    assert info.value.code != 75
    assert json.loads((trial(tmp_path / "none") / "recover_info" / "step_info.json").read_text())["global_step"] == 3


def test_slurm_auto_requeue_signal_saves_then_requeues(tmp_path, monkeypatch) -> None:
    """With SLURMEnvironment(auto_requeue=True), its requeue signal (SIGUSR1) checkpoints the
    current step and runs ``scontrol requeue <job>``, instead of Lightning's save from inside
    the signal handler; no Lightning hpc checkpoint is written."""
    import os
    import signal

    from lightning.pytorch.plugins.environments import SLURMEnvironment

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                       "SLURM_NODEID": "0", "SLURM_JOB_NAME": "train"}.items():
        monkeypatch.setenv(key, value)
    first, code = preempted_run(tmp_path / "run", 6, sig=signal.SIGUSR1,
                                plugins=[SLURMEnvironment(auto_requeue=True)], default_root_dir=tmp_path / "root")
    assert code == 75
    assert calls.read_text().split() == ["requeue", "4242"]
    assert not list((tmp_path / "root").rglob("hpc_ckpt_*"))
    assert json.loads((trial(tmp_path / "run") / "recover_info" / "step_info.json").read_text())["global_step"] == 5


class Recorder(pl.loggers.Logger):
    """An in-memory logger (a user's own Logger subclass): every logged value, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, str, str]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows += [(step, k, float(v).hex()) for k, v in sorted(metrics.items()) if not k.startswith("checkpoint/")]


class EpochMeanNet(Net):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_mean", loss, on_step=False, on_epoch=True)
        self.log("loss_max", loss, on_step=False, on_epoch=True, reduce_fx="max")
        return loss


def test_epoch_aggregated_training_metrics_continue_across_a_mid_epoch_resume(tmp_path) -> None:
    logs = {}
    for name, root, crash in (("ref", "ref", None), ("first", "run", 7), ("second", "run", None)):
        pl.seed_everything(0, verbose=False)
        module, rec = EpochMeanNet(), Recorder()
        callbacks: list = [recover(tmp_path / root)] + ([CrashAt(crash)] if crash else [])
        t = trainer(callbacks, logger=rec, log_every_n_steps=1)
        if crash:
            with pytest.raises(Crash):
                t.fit(module, plain_loader())
        else:
            t.fit(module, plain_loader())
        logs[name] = [r for r in rec.rows if r[1] in ("loss_mean", "loss_max")]
    # epoch 0 was interrupted after step 7 (checkpoint of step 4): its aggregate covers all 10 batches
    assert logs["first"] == []
    assert logs["second"] == logs["ref"] and len(logs["ref"]) == 4


def test_evaluator_info_records_the_validation_schedule_and_position(tmp_path) -> None:
    import datetime

    pl.seed_everything(0, verbose=False)
    trainer([recover(tmp_path)], val_check_interval=4, num_sanity_val_steps=0, max_steps=8).fit(
        ValNet(), plain_loader())
    info = json.loads((trial(tmp_path) / "recover_info" / "evaluator_info.json").read_text())
    # validations after steps 4 and 8; the last save is of step 8, taken after its validation
    assert info["validations_completed"] == 2 and info["last_validation_global_step"] == 8
    assert info["validated_at_this_step"] is True and info["val_check_batch"] == 4
    # a time-based interval (a timedelta) is recorded as text, the save does not fail on it
    pl.seed_everything(0, verbose=False)
    trainer([recover(tmp_path / "t")], val_check_interval=datetime.timedelta(hours=1), num_sanity_val_steps=0,
            max_epochs=1).fit(ValNet(), plain_loader())
    info = json.loads((trial(tmp_path / "t") / "recover_info" / "evaluator_info.json").read_text())
    assert isinstance(info["val_check_interval"], str)
