"""HF exports of PEFT (LoRA) models: the adapter as ``peft`` saves it, the merged full weights,
or both; the live model is never changed (losses equal a run without exports)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from areal_lightning import HFSaverCallback, RecoverCallback
from tests.conftest import Crash, CrashAt, LMModule, make_trainer, tiny_llama, token_loader
from tests.harness.losses import last_losses
from tests.harness.refcache import environment_key, shared

peft = pytest.importorskip("peft")


def lora_model(base_dir: Path, compiled: str | None = None) -> torch.nn.Module:
    """A LoRA Llama on a base saved in ``base_dir`` (so the adapter names a loadable base).
    ``compiled``: ``"base"`` (``get_peft_model(torch.compile(base))``) or ``"peft"``
    (``torch.compile(get_peft_model(base))``); the eager backend (see tests/test_compile.py)."""
    from transformers import AutoModelForCausalLM

    if not base_dir.exists():
        tiny_llama().save_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    if compiled == "base":
        base = torch.compile(base, backend="eager")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
                             init_lora_weights="gaussian")
    model = peft.get_peft_model(base, config)
    return torch.compile(model, backend="eager") if compiled == "peft" else model


def fit(root: Path, export: str | None, mode: str = "sync", crash_at: int | None = None,
        compiled: str | None = None, base: Path | None = None) -> LMModule:
    """Two epochs of 8 steps of a LoRA model on ``base`` (default: ``root``'s sibling ``base``)."""
    pl.seed_everything(0, verbose=False)
    module = LMModule(lora_model(base or root.parent / "base", compiled))
    where = dict(fileroot=root, experiment_name="e", trial_name="t", user="u")
    callbacks: list = [RecoverCallback(**where, freq_steps=4)]
    if export is not None:
        callbacks.append(HFSaverCallback(**where, freq_steps=4, mode=mode, peft_export=export))  # 4..16: the last step
    if crash_at is None:
        make_trainer(callbacks, max_epochs=2).fit(module, token_loader())
    else:
        with pytest.raises(Crash):
            make_trainer([CrashAt(crash_at), *callbacks], max_epochs=2).fit(module, token_loader())
    return module


def uninterrupted(tmp_path_factory, export: str | None, mode: str = "sync") -> tuple[Path, list[float]]:
    """``(root, losses)`` of ``fit(root, export, mode)``, once per suite run (shared by the
    workers: tests/harness/refcache.py); its base model is ``root.parent / "base"``."""
    def produce(folder: Path) -> list[float]:
        return fit(folder / "run", export, mode).losses

    folder, losses = shared(tmp_path_factory, {"peft-fit": [export, mode], "env": environment_key()}, produce)
    return folder / "run", losses


def exports(root: Path) -> list[Path]:
    folder = root / "checkpoints" / "u" / "e" / "t" / "default"
    return sorted((p for p in folder.glob("epoch*") if p.is_dir()), key=lambda p: int(p.name.split("globalstep")[1]))


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 11).view(1, 8)).logits


@pytest.mark.parametrize(("export", "mode"), [("adapter", "sync"), ("merged", "async"), ("both", "sync"),
                                              ("both", "async")])
def test_lora_exports_load_the_standard_way_and_leave_training_unchanged(tmp_path, tmp_path_factory, export,
                                                                        mode) -> None:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    want = uninterrupted(tmp_path_factory, None)[1]
    module = fit(tmp_path / "run", export, mode)
    assert module.losses == want  # the live model is not changed by the exports
    last = exports(tmp_path / "run")[-1]
    live = logits(module.model)
    if export in ("merged", "both"):
        assert (last / "config.json").is_file() and not (last / "adapter_config.json").exists()
        merged = AutoModelForCausalLM.from_pretrained(last)
        assert not any("lora" in k for k in merged.state_dict())
        torch.testing.assert_close(logits(merged), live, rtol=1e-5, atol=1e-5)
    if export in ("adapter", "both"):
        folder = last / "adapter" if export == "both" else last
        assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
        adapter = AutoPeftModelForCausalLM.from_pretrained(folder)
        torch.testing.assert_close(logits(adapter), live, rtol=1e-6, atol=1e-6)
    assert not any(getattr(m, "merged", False) for m in module.model.modules())  # never merged in place


class TwoAdapters(LMModule):
    """Two LoRA adapters on one base, trained in turn: ``a`` in even epochs, ``b`` in odd ones."""

    def on_train_epoch_start(self) -> None:
        self.model.set_adapter("a" if self.current_epoch % 2 == 0 else "b")


class LiveLogits(pl.Callback):
    """After the saver's epoch-end export: the live model's logits (the export is of them)."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        with torch.no_grad():
            self.logits.append(pl_module.model(input_ids=torch.arange(3, 11).view(1, 8)).logits)


def test_merged_exports_follow_the_adapter_the_user_switched_to(tmp_path) -> None:
    """A user who switches the active adapter between exports gets each export merged with the
    adapter active at that step (not the one active at the first export)."""
    from transformers import AutoModelForCausalLM

    tiny_llama().save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"),
                                adapter_name="a")
    model.add_adapter("b", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian"))
    live = LiveLogits()
    saver = HFSaverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", user="u", freq_epochs=1,
                            peft_export="merged")
    make_trainer([saver, live], max_epochs=2).fit(TwoAdapters(model), token_loader())
    assert len(exports(tmp_path)) == 2 and not torch.allclose(live.logits[0], live.logits[1], atol=1e-3)
    for folder, want in zip(exports(tmp_path), live.logits):
        torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(folder)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["dora", "ia3"])
def test_a_merged_export_of_an_adapter_that_cannot_be_merged_is_refused_before_training(tmp_path, kind) -> None:
    """DoRA (its merge rescales the weight) and IA3 (no weight delta): the merged export is refused
    at setup, naming the layer and what is supported; the adapter export works for both."""
    from transformers import AutoModelForCausalLM

    tiny_llama().save_pretrained(tmp_path / "base")
    config = (peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True) if kind == "dora" else
              peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]))
    where = dict(fileroot=tmp_path, experiment_name="e", trial_name="t", user="u", freq_steps=4)
    module = LMModule(peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), config))
    with pytest.raises(TypeError, match=rf"merged export: the {'DoRA' if kind == 'dora' else 'ia3'} Linear layer "
                                        r"'model.layers.0.self_attn.q_proj' \(adapter 'default'\) cannot be merged on "
                                        r"the fly; supported: adapters that add a weight delta"):
        make_trainer([HFSaverCallback(**where, peft_export="both")]).fit(module, token_loader())
    assert module.losses == [] and not (tmp_path / "checkpoints").exists()
    make_trainer([HFSaverCallback(**where, peft_export="adapter")]).fit(module, token_loader())
    assert (exports(tmp_path)[-1] / "adapter_model.safetensors").is_file()


def test_peft_export_is_validated_naming_the_field(tmp_path) -> None:
    from areal_lightning import ConfigError

    with pytest.raises(ConfigError, match="peft_export.*adapter, merged, both"):
        HFSaverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", freq_steps=1, peft_export="full")


def test_a_lora_run_resumes_exactly_with_exports_equal_to_the_uninterrupted_runs(tmp_path, tmp_path_factory) -> None:
    """RecoverCallback on a LoRA model (frozen base): crash after step 10, the rerun trains the
    uninterrupted run's losses, and every export after the resume is byte-for-byte its export."""
    ref_root, want = uninterrupted(tmp_path_factory, "both", "async")
    base = ref_root.parent / "base"
    fit(tmp_path / "run", "both", "async", crash_at=10, base=base)
    got = fit(tmp_path / "run", "both", "async", base=base)
    assert got.losses == want[-len(got.losses):] and len(got.losses) == 8  # resumed after step 8
    ref, run = exports(ref_root), exports(tmp_path / "run")
    assert [p.name for p in run] == [p.name for p in ref]
    for a, b in zip(ref, run):
        for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), (b, name)


def run_script(root: Path, *args: str) -> subprocess.CompletedProcess:
    """``tests/scripts/train_peft.py`` into ``root`` (Lightning launches the other ranks)."""
    script = Path(__file__).parent / "scripts" / "train_peft.py"
    # peft writes the set target_modules in hash order: one hash seed makes configs comparable.
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    return subprocess.run([sys.executable, str(script), "--root", str(root), *args], capture_output=True, text=True,
                          timeout=300, cwd=root.parent, env=env)


def step_losses(root: Path, rank: int) -> dict[int, str]:
    """Each step's loss (hex) on ``rank``; a step done again after a kill: its last value."""
    return last_losses(root / f"losses.rank{rank}")


@pytest.mark.parametrize("compiled", ["base", "peft"])
def test_a_compiled_lora_model_exports_and_resumes_uncompiled_with_the_plain_runs_exports(tmp_path, tmp_path_factory,
                                                                                          compiled) -> None:
    """``torch.compile`` inside the PEFT model (its base) or around it: exports and recover
    checkpoints use the plain names. A compiled run crashes after step 10 and is resumed
    uncompiled: the losses continue the plain run's, and every export (steps 4 and 8 from the
    compiled model, 12 and 16 from the plain one) is byte-for-byte the plain run's (the adapter
    names the same base folder and loads onto a plain base)."""
    ref_root, want = uninterrupted(tmp_path_factory, "both", "async")
    base = ref_root.parent / "base"  # the same base folder: the adapter configs name it
    fit(tmp_path / "run", "both", "async", crash_at=10, compiled=compiled, base=base)
    got = fit(tmp_path / "run", "both", "async", base=base)
    assert got.losses == want[-len(got.losses):] and len(got.losses) == 8  # resumed after step 8
    ref, run = exports(ref_root), exports(tmp_path / "run")
    assert [p.name for p in run] == [p.name for p in ref]
    for a, b in zip(ref, run):
        for name in ("model.safetensors", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), (b, name)


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "devices", "export", "mode", "kill", "compiled", "method"), [
    ("ddp", 1, "both", "async", 10, False, "gather"),
    ("ddp", 2, "merged", "sync", None, False, "gather"),
    ("fsdp1", 2, "both", "sync", 10, False, "gather"),
    ("fsdp2", 2, "both", "async", 6, True, "dcp"),
    ("fsdp1", 2, "adapter", "async", None, True, "dcp"),
])
def test_lora_exports_on_every_strategy_and_a_sigkilled_run_continues_exactly(tmp_path, strategy, devices, export,
                                                                              mode, kill, compiled, method) -> None:
    """A LoRA Llama (frozen base) on one process, or on 2 ranks under DDP, FSDP1 (use_orig_params)
    and FSDP2 (fully_shard): the last export loads the standard way and gives the live model's
    logits after the last step (FSDP: merged from the full tensors gathered to rank 0). With
    ``kill``: every rank is SIGKILLed after that step and the same command started again: each
    step's loss on each rank and every export file are byte-for-byte the uninterrupted run's.
    ``compiled``: the model is ``torch.compile``d after sharding (with ``kill``: in the killed run
    only; the rerun and the reference are not). ``method``: ``sharded_method`` (PEFT exports
    are gathered whatever it is)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    args = ("--strategy", strategy, "--devices", str(devices), "--export", export, "--mode", mode, "--method", method)
    ref = tmp_path / "ref"
    proc = run_script(ref, *args, *(("--compile",) if compiled and kill is None else ()))
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = 32 // devices  # 2 epochs of 16 batches, split between the ranks
    last = exports(ref)[-1]
    assert last.name.endswith(f"globalstep{steps - 1}")
    live = torch.load(ref / "live_logits.pt")
    if export in ("merged", "both"):
        torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(last)), live, rtol=1e-5, atol=1e-5)
    if export in ("adapter", "both"):
        folder = last / "adapter" if export == "both" else last
        torch.testing.assert_close(logits(AutoPeftModelForCausalLM.from_pretrained(folder)), live,
                                   rtol=1e-6, atol=1e-6)
    if kill is None and strategy == "fsdp1":  # the live model is not changed by the exports: the losses of a
        plain = tmp_path / "plain"  # run without them (one process: test_lora_exports_load_the_standard_way...)
        proc = run_script(plain, *args[:4], "--export", "none", *(("--compile",) if compiled else ()))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert exports(plain) == []
        for rank in range(devices):
            assert step_losses(plain, rank) == step_losses(ref, rank)
    if kill is None:
        return
    run = tmp_path / "run"
    proc = run_script(run, *args, "--kill-at-step", str(kill), *(("--compile",) if compiled else ()))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    proc = run_script(run, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(devices):
        assert step_losses(run, rank) == step_losses(ref, rank)
        assert len((run / f"losses.rank{rank}").read_text().splitlines()) > steps  # steps were done again
    assert [p.name for p in exports(run)] == [p.name for p in exports(ref)]
    for a, b in zip(exports(ref), exports(run)):
        files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
        for name in files:  # (the adapter's config and model card name the base model's folder)
            want = (a / name).read_bytes().replace(bytes(ref), bytes(run))
            assert (b / name).read_bytes() == want, (b, name)
    assert (run / "live_logits.pt").read_bytes() == (ref / "live_logits.pt").read_bytes()


def test_a_peft_model_is_exported_by_default_as_its_adapter_with_max_keep_and_telemetry(tmp_path) -> None:
    """No PEFT setting: ``HFSaverCallback`` takes the PeftModel (it was refused as "not a
    PreTrainedModel") and writes the adapter, as ``PeftModel.save_pretrained`` would; ``max_keep``
    prunes the older exports and each export reaches the loggers (``checkpoint/hf/*``)."""
    import csv

    pl.seed_everything(0, verbose=False)
    module = LMModule(lora_model(tmp_path / "base"))
    saver = HFSaverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", user="u", freq_steps=4, max_keep=2)
    logger = pl.loggers.CSVLogger(tmp_path / "logs", name="", version=0)
    make_trainer([saver], max_epochs=2, logger=logger).fit(module, token_loader())
    assert [p.name for p in exports(tmp_path)] == ["epoch1epochstep3globalstep11", "epoch1epochstep7globalstep15"]
    for folder in exports(tmp_path):
        assert sorted(p.name for p in folder.iterdir() if p.suffix in (".json", ".safetensors")) == \
            ["adapter_config.json", "adapter_model.safetensors"]
    with open(tmp_path / "logs" / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("checkpoint/hf/bytes")]
    assert [int(row["step"]) for row in rows] == [4, 8, 12, 16]
    size = sum(p.stat().st_size for p in exports(tmp_path)[-1].rglob("*") if p.is_file())
    assert float(rows[-1]["checkpoint/hf/bytes"]) == size


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class LoRAOverMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = peft.get_peft_model(MLP(), peft.LoraConfig(r=2, target_modules=["lin"], init_lora_weights="gaussian"))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(ids[:, :4].float() / 16).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_peft_model_over_a_plain_module_exports_its_adapter_and_its_merged_export_is_refused(tmp_path) -> None:
    """An adapter over a plain ``nn.Module`` is saved as ``peft`` saves it (``PeftModel.from_pretrained``
    on a fresh module gives the live outputs); a merged export has no config or class to be
    written with: refused at setup (before the first step), saying what was found and what is
    supported."""
    where = dict(fileroot=tmp_path, experiment_name="e", trial_name="t", user="u")
    module = LoRAOverMLP()
    make_trainer([HFSaverCallback(**where, freq_steps=16)], max_epochs=2).fit(module, token_loader())
    (last,) = exports(tmp_path)
    loaded = peft.PeftModel.from_pretrained(MLP(), last)
    probe = torch.arange(8.0).view(2, 4)
    torch.testing.assert_close(loaded(probe), module.model(probe))

    saver = HFSaverCallback(**{**where, "fileroot": tmp_path / "merged"}, freq_steps=1, peft_export="both")
    with pytest.raises(TypeError, match=r"attribute 'model' of LoRAOverMLP: the PeftModel wraps a MLP, not a "
                                        r"transformers.PreTrainedModel, so it has no merged HF export \(supported: "):
        make_trainer([saver], max_epochs=1).fit(LoRAOverMLP(), token_loader())
    assert not (tmp_path / "merged" / "checkpoints").exists()


def test_an_adapter_export_over_a_base_with_no_name_is_refused_at_setup_and_merged_loads(tmp_path) -> None:
    """A LoRA model over a base built from a config (no name or path: ``adapter_config.json`` would
    say ``"base_model_name_or_path": null``, and ``AutoPeftModelForCausalLM`` would look for it on the
    Hub) with the default ``peft_export="adapter"``: refused at setup, before the first step, naming
    the field and the exports that load; nothing is written. ``peft_export="merged"`` on the same
    model: the last export loads with ``AutoModelForCausalLM`` and gives the live model's logits.
    A name given by the user (the base saved, its path set in the adapter's config): the adapter
    export loads with ``AutoPeftModelForCausalLM``."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from areal_lightning.errors import ConfigError

    def lora_from_config(save_base: Path | None = None) -> torch.nn.Module:
        base = tiny_llama()
        if save_base is not None:
            base.save_pretrained(save_base)
        torch.manual_seed(1)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          init_lora_weights="gaussian"))
        if save_base is not None:
            model.peft_config["default"].base_model_name_or_path = str(save_base)
        return model

    def run(root: Path, module: LMModule, **saver) -> None:
        where = dict(fileroot=root, experiment_name="e", trial_name="t", user="u")
        make_trainer([RecoverCallback(**where, freq_steps=4), HFSaverCallback(**where, freq_steps=4, **saver)],
                     max_epochs=1).fit(module, token_loader())

    pl.seed_everything(0, verbose=False)
    module = LMModule(lora_from_config())
    with pytest.raises(ConfigError, match=r"peft_export: HFSaverCallback\(name='default'\): 'adapter' \(the default\) .*'default' has no "
                                          r"base_model_name_or_path.*peft_export='merged' or 'both'"):
        run(tmp_path / "adapter", module)
    assert module.losses == []  # no step ran; only the trial's lock file was made (by RecoverCallback's setup)
    assert [p.name for p in (tmp_path / "adapter").rglob("*") if p.is_file()] == [".lock"]

    pl.seed_everything(0, verbose=False)
    module = LMModule(lora_from_config())
    run(tmp_path / "merged", module, peft_export="merged")
    last = exports(tmp_path / "merged")[-1]
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(last)), logits(module.model),
                               rtol=1e-5, atol=1e-5)

    module = LMModule(lora_from_config(save_base=tmp_path / "base"))
    run(tmp_path / "named", module)
    last = exports(tmp_path / "named")[-1]
    torch.testing.assert_close(logits(AutoPeftModelForCausalLM.from_pretrained(last)), logits(module.model),
                               rtol=1e-6, atol=1e-6)
