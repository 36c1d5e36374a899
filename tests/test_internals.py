"""Pins every Lightning private attribute areal-lightning relies on, each in one test named
after its accessor in ``areal_lightning/lightning/_internals.py``, against real Lightning
objects; and checks that no other module of the package touches those names."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

# The whole module runs under either Lightning namespace: lightning.pytorch here, and
# pytorch_lightning in a subprocess (test_every_accessor_is_pinned_under_pytorch_lightning).
NAMESPACE = os.environ.get("AREAL_NAMESPACE", "lightning.pytorch")
FABRIC = {"lightning.pytorch": "lightning.fabric", "pytorch_lightning": "lightning_fabric"}[NAMESPACE]
pl = importlib.import_module(NAMESPACE)
DistributedSamplerWrapper = importlib.import_module(FABRIC + ".utilities.distributed").DistributedSamplerWrapper
find_free_network_port = importlib.import_module(FABRIC + ".plugins.environments.lightning").find_free_network_port
Callback = pl.callbacks.Callback
CSVLogger = pl.loggers.CSVLogger
AsyncCheckpointIO = pl.plugins.io.AsyncCheckpointIO
FSDPStrategy, ModelParallelStrategy, DDPStrategy = (pl.strategies.FSDPStrategy, pl.strategies.ModelParallelStrategy,
                                                    pl.strategies.DDPStrategy)

from areal_lightning import DCPCheckpointIO
from areal_lightning.lightning import _internals as internals

PACKAGE = Path(__file__).resolve().parents[1] / "areal_lightning"


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(n: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 4)), batch_size=2)


def trainer(callbacks: list, tmp_path: Path, **kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    return pl.Trainer(callbacks=callbacks, **{**options, **kwargs})


class Probe(Callback):
    """Wires the accessors in setup, records what they return during fit."""

    def __init__(self) -> None:
        self.patch = internals.Patch()
        self.seen: dict[str, object] = {}

    def setup(self, trainer, pl_module, stage):
        def make_resume(original):
            def resume_start(checkpoint_path=None, weights_only=None):
                self.seen["resume_path"] = checkpoint_path
                original(checkpoint_path, weights_only)
                self.seen["loaded"] = internals.loaded_checkpoint(trainer)
            return resume_start

        def make_loader(original):
            def dataloader():
                self.seen["loader_built"] = True
                return original()
            return dataloader

        internals.wrap_resume_start(trainer, self.patch, make_resume)
        internals.wrap_train_dataloader(trainer, self.patch, make_loader)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.setdefault("loaders", internals.train_loaders(trainer))
        self.seen.setdefault("prefetched", internals.prefetched_batches(trainer))

    def teardown(self, trainer, pl_module, stage):
        self.patch.undo()


@pytest.fixture
def fitted(tmp_path: Path) -> tuple[Probe, pl.Trainer, DataLoader]:
    """A fit resumed from a Lightning checkpoint, with the probe wired."""
    first = trainer([], tmp_path)
    first.fit(Tiny(), loader())
    ckpt = tmp_path / "first.ckpt"
    first.save_checkpoint(ckpt)
    probe, data = Probe(), loader()
    second = trainer([probe], tmp_path, max_epochs=2)
    second.fit(Tiny(), data, ckpt_path=ckpt)
    return probe, second, data


def test_wrap_resume_start(fitted) -> None:
    probe, t, _ = fitted
    assert probe.seen["resume_path"] is not None  # called with the resolved path, after setup
    connector = t._checkpoint_connector
    assert "resume_start" not in connector.__dict__  # Patch.undo restored the class method


def test_wrap_train_dataloader(fitted) -> None:
    probe, t, _ = fitted
    assert probe.seen["loader_built"] is True
    assert "dataloader" not in t.fit_loop._data_source.__dict__


def test_loaded_checkpoint(fitted) -> None:
    probe, _, _ = fitted
    loaded = probe.seen["loaded"]
    assert isinstance(loaded, dict) and loaded["global_step"] == 4 and "state_dict" in loaded


def test_dump_checkpoint(tmp_path: Path) -> None:
    """What trainer.save_checkpoint writes: the same keys, the callbacks' states and hooks run."""
    t = trainer([], tmp_path)
    t.fit(Tiny(), loader(4))
    dumped = internals.dump_checkpoint(t)
    assert dumped["global_step"] == t.global_step and "state_dict" in dumped and "optimizer_states" in dumped
    assert {"loops", "callbacks", "lr_schedulers", "epoch"} <= set(dumped)


def test_train_loaders(fitted) -> None:
    probe, _, data = fitted
    assert probe.seen["loaders"] == [data]


class Stream(IterableDataset):
    """An unsized dataset: Lightning's fetcher reads one batch ahead to detect the end."""

    def __iter__(self):
        return iter([torch.randn(4) for _ in range(6)])


def test_prefetched_batches(fitted, tmp_path: Path) -> None:
    probe, _, _ = fitted
    assert probe.seen["prefetched"] == 0  # a sized loader: nothing is fetched ahead
    unsized = Probe()
    trainer([unsized], tmp_path / "unsized").fit(Tiny(), DataLoader(Stream(), batch_size=2, collate_fn=lambda b: [torch.stack(b)]))
    assert unsized.seen["prefetched"] == 1


def test_user_checkpoint_io(tmp_path: Path) -> None:
    assert internals.user_checkpoint_io(trainer([], tmp_path).strategy) is None
    io = DCPCheckpointIO("sync")
    assert internals.user_checkpoint_io(trainer([], tmp_path, plugins=[io]).strategy) is io


def test_unwrap_checkpoint_io() -> None:
    io = DCPCheckpointIO("sync")
    assert internals.unwrap_checkpoint_io(AsyncCheckpointIO(io)) is io
    assert internals.unwrap_checkpoint_io(io) is io


def test_fsdp_state_dict_type() -> None:
    strategy = FSDPStrategy(state_dict_type="full")
    assert internals.fsdp_state_dict_type(strategy) == "full"


def test_set_fsdp_state_dict_type() -> None:
    strategy = FSDPStrategy(state_dict_type="full")
    internals.set_fsdp_state_dict_type(strategy, "sharded")
    assert internals.fsdp_state_dict_type(strategy) == "sharded"
    assert FSDPStrategy(state_dict_type="sharded").__dict__.keys() == strategy.__dict__.keys()


def test_saves_distributed_checkpoint() -> None:
    assert internals.saves_distributed_checkpoint(ModelParallelStrategy(save_distributed_checkpoint=False)) is False
    assert internals.saves_distributed_checkpoint(ModelParallelStrategy()) is True


def test_set_save_distributed_checkpoint() -> None:
    strategy = ModelParallelStrategy(save_distributed_checkpoint=False)
    internals.set_save_distributed_checkpoint(strategy, True)
    assert internals.saves_distributed_checkpoint(strategy) is True


def test_can_redirect_logger(tmp_path: Path) -> None:
    assert internals.can_redirect_logger(CSVLogger(tmp_path))
    assert not internals.can_redirect_logger(object())


def test_redirect_logger(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="run")
    _ = logger.experiment  # opens version_0
    internals.redirect_logger(logger, 3)
    assert logger.version == 3 and Path(logger.log_dir).name == "version_3"
    logger.log_metrics({"x": 1.0}, step=0)
    logger.save()
    assert (tmp_path / "run" / "version_3" / "metrics.csv").is_file()


def _offline_wandb(tmp_path: Path):
    pytest.importorskip("wandb")
    os.environ.setdefault("WANDB_SILENT", "true")
    return pl.loggers.WandbLogger(save_dir=str(tmp_path), project="p", offline=True)


def test_can_redirect_wandb(tmp_path: Path) -> None:
    assert internals.can_redirect_wandb(_offline_wandb(tmp_path))
    assert not internals.can_redirect_wandb(CSVLogger(tmp_path))


def test_redirect_wandb(tmp_path: Path) -> None:
    logger = _offline_wandb(tmp_path)
    first = logger.experiment.id
    logger.experiment.finish()
    logger = _offline_wandb(tmp_path)
    fresh = logger.experiment  # a new run id, as a new start opens
    assert fresh.id != first
    assert internals.redirect_wandb(logger, first) is fresh
    assert logger.version == first and logger.experiment.id == first  # the same run continues
    logger.experiment.finish()


def test_wrapped_sampler() -> None:
    inner = RandomSampler(range(10))
    wrapper = DistributedSamplerWrapper(inner, num_replicas=2, rank=0)
    assert internals.wrapped_sampler(wrapper) is inner
    assert internals.wrapped_sampler(inner) is inner


def test_callback_state_key() -> None:
    ModelCheckpoint = pl.callbacks.ModelCheckpoint

    class Mine(Callback):
        pass

    assert internals.callback_state_key(Mine(), name="critic").endswith("Mine{'name': 'critic'}")
    assert ModelCheckpoint().state_key.startswith("ModelCheckpoint{")  # Lightning's callbacks use the same


def test_patch() -> None:
    class Obj:
        def method(self) -> str:
            return "class"

    obj, patch = Obj(), internals.Patch()
    patch.set(obj, "method", lambda: "patched")
    assert obj.method() == "patched"
    patch.undo()
    assert obj.method() == "class"


def test_every_accessor_is_pinned_here() -> None:
    here = sys.modules[__name__]
    missing = [name for name in internals.__all__ if not callable(getattr(here, f"test_{name.lower()}", None))]
    assert not missing, f"accessors of _internals.py without a test_<name> here: {missing}"


@pytest.mark.parametrize("library", ["lightning", "torch"])
def test_no_other_module_touches_the_librarys_private_names(library: str) -> None:
    """Every Lightning (torch) private name the package uses appears in its adapter module only:
    lightning/_internals.py (_torch_internals.py). Our own attributes may share a Lightning
    private's name (``self._version``); none may share a torch private's."""
    from areal_lightning import _torch_internals

    adapter = internals if library == "lightning" else _torch_internals
    adapter_file = Path(adapter.__file__).resolve()
    patterns = {name: re.compile(rf"(\.{re.escape(name)}\b|\bimport [^\n]*\b{re.escape(name)}\b)")
                for name in adapter.PRIVATE_NAMES}
    offenders = []
    for source in sorted(PACKAGE.rglob("*.py")):
        if source.resolve() == adapter_file:
            continue
        for lineno, line in enumerate(source.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for name, pattern in patterns.items():
                own = library == "lightning" and re.search(rf"self\.{re.escape(name)}\b", code)
                if pattern.search(code) and not own:
                    offenders.append(f"{source.relative_to(PACKAGE.parent)}:{lineno}: {name}: {line.strip()}")
    assert not offenders, f"{library} private names outside {adapter_file.name}:\n" + "\n".join(offenders)
    text = adapter_file.read_text()
    assert all(name in text for name in adapter.PRIVATE_NAMES)


# Private names of other libraries than Lightning and torch the package uses, and where.
OTHER_LIBRARIES_PRIVATE = {
    "_getdtype": "write/hf.py",  # safetensors' dtype names (DCP HF export check)
    "_inverted_registry": "write/dcp_format.py",  # copyreg's extension codes (no public query): load_plain
}
ADAPTERS = {"lightning/_internals.py", "_torch_internals.py"}


def _defined_names(trees: dict) -> set[str]:
    """The names the package defines itself: functions, classes, arguments, variables, and
    attributes it sets on its own objects (``self.``/``cls.``, or prefixed ``_areal``). A write to
    another library's object (``trainer._x = ...``) defines nothing."""
    import ast

    defined: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                defined.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
    return defined


def _foreign_private_uses(trees: dict, defined: set[str]) -> list[str]:
    import ast

    offenders = []
    for source, tree in trees.items():
        rel = str(source.relative_to(PACKAGE))
        if rel in ADAPTERS:
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("areal_lightning"):
                names = [alias.name for alias in node.names]
                names += [part for part in (node.module or "").split(".") if part.startswith("_")]
            for name in names:
                if name.startswith("_") and not name.startswith("__") and not name.startswith("_areal") \
                        and name not in defined and OTHER_LIBRARIES_PRIVATE.get(name) != rel:
                    offenders.append(f"{rel}:{node.lineno}: {name}")
    return offenders


def test_no_other_module_touches_any_private_name_of_another_library() -> None:
    """Generic: a private attribute (``x._name``, read or written) or private import that the
    package does not define itself belongs to Lightning or torch (only in their adapter module)
    or is one of the listed others."""
    import ast

    trees = {source: ast.parse(source.read_text()) for source in sorted(PACKAGE.rglob("*.py"))}
    offenders = _foreign_private_uses(trees, _defined_names(trees))
    assert not offenders, "private names of other libraries outside the adapter modules:\n" + "\n".join(offenders)


def test_the_guard_catches_a_write_to_a_foreign_private_attribute() -> None:
    """The guard itself: a module that sets another library's private attribute is caught."""
    import ast

    source = PACKAGE / "lightning" / "example_offender.py"
    tree = ast.parse("def f(trainer):\n    trainer._made_up_private = 1\n")
    assert _foreign_private_uses({source: tree}, _defined_names({source: tree})) == \
        ["lightning/example_offender.py:2: _made_up_private"]
    tree = ast.parse("from torch.utils.data._utils.pin_memory import pin_memory\n")
    assert _foreign_private_uses({source: tree}, set()) == ["lightning/example_offender.py:1: _utils"]


class StepProbe(Callback):
    """Wires the save-point accessors; records, at each of them, what Lightning has run so far."""

    def __init__(self) -> None:
        self.patch = internals.Patch()
        self.events: list[tuple] = []

    def setup(self, trainer, pl_module, stage):
        def make_step_end(original):
            def on_advance_end(data_fetcher):
                original(data_fetcher)
                self.events.append(("step_end", trainer.global_step, internals.epoch_loop_ends(trainer)))
            return on_advance_end

        def make_epoch_end(original):
            def on_advance_end():
                original()
                self.events.append(("epoch_end", trainer.global_step, trainer.current_epoch))
            return on_advance_end

        internals.wrap_step_end(trainer, self.patch, make_step_end)
        internals.wrap_epoch_end(trainer, self.patch, make_epoch_end)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.events.append(("batch_end", trainer.global_step))

    def on_validation_end(self, trainer, pl_module):
        self.events.append(("val_end", trainer.global_step, trainer.sanity_checking))

    def on_train_epoch_end(self, trainer, pl_module):
        self.events.append(("train_epoch_end", trainer.global_step))

    def teardown(self, trainer, pl_module, stage):
        self.patch.undo()


class TinyVal(Tiny):
    def validation_step(self, batch, batch_idx):
        self.log("val", self.layer(batch[0]).mean())

    def val_dataloader(self):
        return loader(4)


def _probe_fit(tmp_path: Path) -> tuple[StepProbe, pl.Trainer]:
    probe = StepProbe()
    t = trainer([probe], tmp_path, val_check_interval=2, num_sanity_val_steps=1)
    t.fit(TinyVal(), loader(6))  # 3 batches; validation after batch 1 and at the epoch's end
    return probe, t


def test_wrap_step_end(tmp_path: Path) -> None:
    probe, t = _probe_fit(tmp_path)
    # after each batch's hooks and after the validation due after it
    assert probe.events[:5] == [("val_end", 0, True), ("batch_end", 1), ("step_end", 1, False), ("batch_end", 2),
                                ("val_end", 2, False)]
    assert probe.events[5] == ("step_end", 2, False)
    assert "on_advance_end" not in t.fit_loop.epoch_loop.__dict__


def test_epoch_loop_ends(tmp_path: Path) -> None:
    probe, _ = _probe_fit(tmp_path)
    assert [e[2] for e in probe.events if e[0] == "step_end"] == [False, False, True]  # the last batch ends the epoch


def test_wrap_epoch_end(tmp_path: Path) -> None:
    probe, t = _probe_fit(tmp_path)
    # after the last batch, its validation and every on_train_epoch_end; the epoch counted complete
    assert probe.events[-3:] == [("step_end", 3, True), ("train_epoch_end", 3), ("epoch_end", 3, 1)]
    assert "on_advance_end" not in t.fit_loop.__dict__


class ResumeProbe(Callback):
    """Records the loop events of a resumed fit and wires continue_after_save_point."""

    def __init__(self, epoch_end) -> None:
        self.patch = internals.Patch()
        self.epoch_end = epoch_end
        self.events: list[tuple] = []

    def setup(self, trainer, pl_module, stage):
        internals.continue_after_save_point(trainer, self.patch, lambda: self.epoch_end)

    def on_train_epoch_start(self, trainer, pl_module):
        self.events.append(("epoch_start", trainer.current_epoch))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # with the step the loggers log this batch at (Lightning's _batches_that_stepped)
        self.events.append(("batch", trainer.current_epoch, batch_idx, trainer.global_step,
                            trainer.fit_loop.epoch_loop._batches_that_stepped))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.events.append(("val_end", trainer.global_step))

    def teardown(self, trainer, pl_module, stage):
        self.patch.undo()


class SaveAt(Callback):
    """Saves a Lightning checkpoint at the save point after global step ``step``."""

    def __init__(self, step: int, path: Path, epoch_end: bool) -> None:
        self.patch, self.step, self.path, self.epoch_end = internals.Patch(), step, path, epoch_end

    def setup(self, trainer, pl_module, stage):
        def make(original):
            def on_advance_end(*args):
                original(*args)
                if trainer.global_step == self.step and not self.path.exists():
                    trainer.save_checkpoint(self.path)
            return on_advance_end

        (internals.wrap_epoch_end if self.epoch_end else internals.wrap_step_end)(trainer, self.patch, make)

    def teardown(self, trainer, pl_module, stage):
        self.patch.undo()


@pytest.mark.parametrize("epoch_end", [False, True])
def test_continue_after_save_point(tmp_path: Path, epoch_end: bool) -> None:
    """A checkpoint taken at the save point after step 2 (validation due there) / after the
    first epoch (3 steps) continues with the next step: nothing run twice, nothing skipped;
    with ``max_steps`` (Lightning restarts even finished epochs then) too."""
    step = 3 if epoch_end else 2
    for extra in ({}, {"max_steps": 7}):
        ckpt = tmp_path / f"save-{epoch_end}-{bool(extra)}.ckpt"
        full = ResumeProbe(None)
        trainer([full, SaveAt(step, ckpt, epoch_end)], tmp_path, val_check_interval=2, num_sanity_val_steps=0,
                max_epochs=3, **extra).fit(TinyVal(), loader(6))
        resumed = ResumeProbe(epoch_end)
        trainer([resumed], tmp_path, val_check_interval=2, num_sanity_val_steps=0, max_epochs=3,
                **extra).fit(TinyVal(), loader(6), ckpt_path=ckpt)
        first = next(i for i, e in enumerate(full.events) if e[0] == "batch" and e[3] == step)
        want = [e for e in full.events[first:]]
        if epoch_end:
            want = full.events[first - 1:]  # the next epoch's start
        assert resumed.events == want, (extra, resumed.events, want)


def test_cluster_environment(tmp_path: Path) -> None:
    LightningEnvironment = importlib.import_module(NAMESPACE + ".plugins.environments").LightningEnvironment

    env = LightningEnvironment()
    t = trainer([], tmp_path, plugins=[env])
    assert not hasattr(t.strategy, "cluster_environment")  # single device: no public accessor
    assert internals.cluster_environment(t) is env


class EpochLogged(Tiny):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("m", loss, on_step=False, on_epoch=True)
        self.log("top", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("s", loss, on_step=True, on_epoch=False)
        return loss


class EpochProbe(Callback):
    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(internals.train_epoch_metrics(trainer))


def test_train_epoch_metrics(tmp_path: Path) -> None:
    probe = EpochProbe()
    trainer([probe], tmp_path).fit(EpochLogged(), loader(8))
    first, last = probe.seen[0], probe.seen[-1]
    assert set(last) == {"training_step.m", "training_step.top"}  # on_step-only values have no aggregate
    assert int(last["training_step.m"]["cumulated_batch_size"]) == 8  # 4 batches of 2
    assert int(first["training_step.m"]["cumulated_batch_size"]) == 2
    assert "cumulated_batch_size" not in last["training_step.top"]


def test_continue_train_epoch_metrics(tmp_path: Path) -> None:
    probe = EpochProbe()
    trainer([probe], tmp_path).fit(EpochLogged(), loader(8))
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in probe.seen[1].items()}  # after 2 batches
    top = float(saved["training_step.top"]["value"])

    class Fold(Callback):
        def __init__(self) -> None:
            self.pending, self.after = saved, None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 0:
                internals.continue_train_epoch_metrics(trainer, self.pending)
                self.after = internals.train_epoch_metrics(trainer)

    fold = Fold()
    trainer([fold], tmp_path / "b").fit(EpochLogged(), loader(8))
    assert fold.pending == {}  # every saved key was folded in
    assert int(fold.after["training_step.m"]["cumulated_batch_size"]) == 4 + 2  # saved after 2 batches, + 1
    assert float(fold.after["training_step.top"]["value"]) >= top


@pytest.fixture
def one_rank_group():
    """A one-process gloo group (DDP needs one), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_network_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp_strategy():

    return DDPStrategy(parallel_devices=[torch.device("cpu")], bucket_cap_mb=0.02)  # ~one 64x64 Linear per bucket


def _three_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))


def test_ddp_bucket_layout(one_rank_group) -> None:
    ddp = _ddp_strategy()._setup_model(_three_layers())
    assert internals.ddp_bucket_layout(Tiny()) is None  # not a DDP
    ddp(torch.randn(2, 64)).sum().backward()
    assert not ddp._has_rebuilt_buckets  # DDP rebuilds at the next forward; the accessor does it now
    layout = internals.ddp_bucket_layout(ddp)
    assert ddp._has_rebuilt_buckets and sorted(sum(layout, [])) == list(range(6))
    for _ in range(2):  # training on: DDP reports the same layout (last layer's gradients first)
        ddp(torch.randn(2, 64)).sum().backward()
    text = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    assert layout == [[int(i) for i in b.split()] for b in text.split(",")] and layout[0][0] == 5


def test_wrap_ddp_setup_model(one_rank_group) -> None:
    strategy, patch = _ddp_strategy(), internals.Patch()
    assert internals.wrap_ddp_setup_model(Tiny(), patch, lambda: None) is False  # not a DDPStrategy
    layout: list = [[0, 1], [2, 3], [4, 5]]
    assert internals.wrap_ddp_setup_model(strategy, patch, lambda: layout) is True
    default = _ddp_strategy()._setup_model(_three_layers())
    given = strategy._setup_model(_three_layers())
    for ddp in (default, given):
        ddp(torch.randn(2, 64)).sum().backward()
    assert default._get_ddp_logging_data()["bucket_sizes"] == "49920"  # DDP's first iteration: one bucket
    assert given._get_ddp_logging_data()["bucket_sizes"] == "16640, 16640, 16640"
    layout[:] = [[0, 1, 2]]  # not this model's parameters: DDP's own layout
    assert strategy._setup_model(_three_layers())._get_ddp_logging_data()["bucket_sizes"] == "49920"
    patch.undo()
    assert "_setup_model" not in strategy.__dict__


def test_ddp_forward_sync(one_rank_group) -> None:
    ddp = _ddp_strategy()._setup_model(_three_layers())
    assert internals.ddp_forward_sync(Tiny()) is None  # not a DDP
    assert internals.ddp_forward_sync(ddp) is True  # a new DDP broadcasts buffers at its first forward
    with torch.no_grad():  # a forward without gradient synchronization: no broadcast at the next one
        ddp(torch.randn(2, 64))
    assert internals.ddp_forward_sync(ddp) is False
    ddp(torch.randn(2, 64)).sum().backward()
    assert internals.ddp_forward_sync(ddp) is True


def test_set_ddp_forward_sync(one_rank_group) -> None:
    ddp = _ddp_strategy()._setup_model(_three_layers())
    internals.set_ddp_forward_sync(ddp, False)
    assert internals.ddp_forward_sync(ddp) is False and ddp.will_sync_module_buffers() is False
    internals.set_ddp_forward_sync(Tiny(), False)  # not a DDP: nothing to set


def test_wrap_ddp_setup_model_calls_after_with_the_built_ddp(one_rank_group) -> None:
    strategy, patch, seen = _ddp_strategy(), internals.Patch(), []
    internals.wrap_ddp_setup_model(strategy, patch, lambda: None, after=seen.append)
    built = strategy._setup_model(_three_layers())
    assert seen == [built] and isinstance(built, torch.nn.parallel.DistributedDataParallel)
    patch.undo()


@pytest.mark.skipif(NAMESPACE != "lightning.pytorch", reason="runs the module under the other namespace")
def test_every_accessor_is_pinned_under_pytorch_lightning() -> None:
    """Every test of this module, under ``import pytorch_lightning`` (its own copies of the classes)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           "-n", "0", __file__], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1],
                          env={**os.environ, "AREAL_NAMESPACE": "pytorch_lightning"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
