"""HF exports of PEFT (LoRA) models: the adapter as ``peft`` saves it, the merged full weights,
or both; the live model is never changed (losses equal a run without exports)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from areal_lightning import HFSaverCallback, RecoverCallback
from tests.conftest import Crash, CrashAt, LMModule, make_trainer, tiny_llama, token_loader

peft = pytest.importorskip("peft")


def lora_model(base_dir: Path) -> torch.nn.Module:
    """A LoRA Llama on a base saved in ``base_dir`` (so the adapter names a loadable base)."""
    from transformers import AutoModelForCausalLM

    if not base_dir.exists():
        tiny_llama().save_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
                             init_lora_weights="gaussian")
    return peft.get_peft_model(base, config)


def fit(root: Path, export: str | None, mode: str = "sync", crash_at: int | None = None) -> LMModule:
    pl.seed_everything(0, verbose=False)
    module = LMModule(lora_model(root.parent / "base"))
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



def exports(root: Path) -> list[Path]:
    folder = root / "checkpoints" / "u" / "e" / "t" / "default"
    return sorted((p for p in folder.glob("epoch*") if p.is_dir()), key=lambda p: int(p.name.split("globalstep")[1]))


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 11).view(1, 8)).logits


@pytest.mark.parametrize(("export", "mode"), [("adapter", "sync"), ("merged", "async"), ("both", "sync"),
                                              ("both", "async")])
def test_lora_exports_load_the_standard_way_and_leave_training_unchanged(tmp_path, export, mode) -> None:
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    want = fit(tmp_path / "plain", None).losses
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


def test_peft_export_is_validated_naming_the_field(tmp_path) -> None:
    from areal_lightning import ConfigError

    with pytest.raises(ConfigError, match="peft_export.*adapter, merged, both"):
        HFSaverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", freq_steps=1, peft_export="full")


def test_a_lora_run_resumes_exactly_with_exports_equal_to_the_uninterrupted_runs(tmp_path) -> None:
    """RecoverCallback on a LoRA model (frozen base): crash after step 10, the rerun trains the
    uninterrupted run's losses, and every export after the resume is byte-for-byte its export."""
    want = fit(tmp_path / "ref", "both", "async")
    fit(tmp_path / "run", "both", "async", crash_at=10)
    got = fit(tmp_path / "run", "both", "async")
    assert got.losses == want.losses[-len(got.losses):] and len(got.losses) == 8  # resumed after step 8
    ref, run = exports(tmp_path / "ref"), exports(tmp_path / "run")
    assert [p.name for p in run] == [p.name for p in ref]
    for a, b in zip(ref, run):
        for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), (b, name)


@pytest.mark.slow
def test_lora_exports_under_ddp_on_two_ranks(tmp_path) -> None:
    """2-rank DDP (Lightning launches the second process), async exports of both kinds: the last
    export gives the live model's logits after the last step, merged and as an adapter."""
    import subprocess
    import sys

    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    script = Path(__file__).parent / "scripts" / "train_peft.py"
    proc = subprocess.run([sys.executable, str(script), "--root", str(tmp_path), "--devices", "2", "--mode", "async",
                           "--export", "both"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = exports(tmp_path)[-1]
    assert last.name.endswith("globalstep15")
    live = torch.load(tmp_path / "live_logits.pt")
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(last)), live, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits(AutoPeftModelForCausalLM.from_pretrained(last / "adapter")), live,
                               rtol=1e-6, atol=1e-6)


def test_a_peft_model_is_exported_by_default_as_its_adapter(tmp_path) -> None:
    """No PEFT setting: ``HFSaverCallback`` takes the PeftModel (it was refused as "not a
    PreTrainedModel") and writes the adapter, as ``PeftModel.save_pretrained`` would."""
    pl.seed_everything(0, verbose=False)
    module = LMModule(lora_model(tmp_path / "base"))
    make_trainer([HFSaverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", user="u", freq_steps=16)],
                 max_epochs=2).fit(module, token_loader())
    (last,) = exports(tmp_path)
    assert sorted(p.name for p in last.iterdir() if p.suffix in (".json", ".safetensors")) == \
        ["adapter_config.json", "adapter_model.safetensors"]
