"""``torch.compile``d models: HF exports of the model inside, recover checkpoints that a compiled
and an uncompiled run resume from each other (the state-dict names without ``_orig_mod.``).

``backend="eager"`` keeps CI fast (no C++ toolchain, no inductor compile): it returns torch's
``OptimizedModule`` as any backend does, which is what the plugin handles.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from areal_lightning import HFSaverCallback, RecoverCallback
from areal_lightning.capture.compiled import plain_name, uncompiled
from tests.conftest import Crash, CrashAt, LMModule, make_trainer, tiny_llama, token_loader


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="eager")


def test_uncompiled_finds_the_module_inside_torch_compile() -> None:
    """Pins ``OptimizedModule._orig_mod`` (capture/compiled.py's one private access)."""
    model = tiny_llama()
    wrapped = compiled(model)
    assert type(wrapped).__name__ == "OptimizedModule"
    assert uncompiled(wrapped) is model and uncompiled(model) is model
    names = {plain_name(k) for k in torch.nn.ModuleDict({"m": wrapped}).state_dict()}
    assert names == {f"m.{k}" for k in model.state_dict()}



def run(root: Path, compile_model: bool, crash_at: int | None = None, hf: bool = False) -> LMModule:
    pl.seed_everything(0, verbose=False)
    model = tiny_llama()
    module = LMModule(compiled(model) if compile_model else model)
    where = dict(fileroot=root, experiment_name="e", trial_name="t", user="u")
    callbacks: list = [RecoverCallback(**where, freq_steps=3)]
    if hf:
        callbacks.append(HFSaverCallback(**where, freq_steps=4, mode="sync"))
    if crash_at is not None:
        callbacks.insert(0, CrashAt(crash_at))
    trainer = make_trainer(callbacks, max_epochs=2)
    if crash_at is None:
        trainer.fit(module, token_loader())
    else:
        with pytest.raises(Crash):
            trainer.fit(module, token_loader())
    return module


@pytest.mark.parametrize(("first", "then"), [(True, False), (False, True), (True, True)])
def test_a_checkpoint_written_compiled_resumes_uncompiled_and_back(tmp_path, first, then) -> None:
    want = run(tmp_path / "ref", compile_model=False).losses
    run(tmp_path / "run", compile_model=first, crash_at=7)
    resumed = run(tmp_path / "run", compile_model=then)
    assert resumed.losses == want[-len(resumed.losses):] and len(resumed.losses) == len(want) - 6  # after step 6


def test_a_compiled_model_exports_the_model_inside(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    module = run(tmp_path, compile_model=True, hf=True)
    exports = sorted((tmp_path / "checkpoints" / "u" / "e" / "t" / "default").glob("epoch*globalstep15"))
    assert exports, list((tmp_path / "checkpoints" / "u" / "e" / "t" / "default").iterdir())
    loaded = AutoModelForCausalLM.from_pretrained(exports[-1])
    live = uncompiled(module.model).state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, live[key]), key
