"""HFSaverCallback end to end: real Lightning Trainer, real transformers models, real files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_lightning.errors import ConfigError, UnsupportedModelError
from areal_lightning import HFSaverCallback, parse_export_name
from areal_lightning._fault import ENV_VAR, InjectedFault
from tests.conftest import LMModule, make_trainer, tiny_gpt2, tiny_llama, token_loader


class Snapshots(Callback):
    """Captures the live weights and logits after every optimizer step, keyed by global_step."""

    def __init__(self, probe: torch.Tensor) -> None:
        self.probe = probe
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        model = pl_module.model
        self.weights[trainer.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        was_training = model.training
        model.eval()
        with torch.no_grad():
            self.logits[trainer.global_step] = model(input_ids=self.probe).logits.clone()
        model.train(was_training)


def saver(tmp_path: Path, **kwargs: Any) -> HFSaverCallback:
    return HFSaverCallback(fileroot=tmp_path, experiment_name="exp", trial_name="t0", user="tester", **kwargs)


def export_names(cb: HFSaverCallback) -> list[str]:
    """Export folders by global step, then anything else by name."""
    names = [p.name for p in cb.model_dir.iterdir()]
    return sorted(names, key=lambda n: (0, parse_export_name(n), "") if parse_export_name(n) else (1, None, n))


PROBE = torch.tensor([[1, 5, 6, 7, 8, 9]])


@pytest.mark.parametrize("arch", ["llama", "gpt2_tied"])
def test_two_epoch_run_exports_exact_folders_weights_logits_and_tokenizer(tmp_path, tokenizer, arch) -> None:
    model = tiny_llama() if arch == "llama" else tiny_gpt2()
    module = LMModule(model, tokenizer=tokenizer)
    cb = saver(tmp_path, freq_steps=3, freq_epochs=1, mode="sync")
    snaps = Snapshots(PROBE)
    trainer = make_trainer([cb, snaps], max_epochs=2)
    trainer.fit(module, token_loader(n_batches=8))

    # 8 steps per epoch; steps 3, 6, end of epoch 0 (8), 9, 12, 15, end of epoch 1 (16).
    expected = [
        "epoch0epochstep2globalstep2", "epoch0epochstep5globalstep5", "epoch0epochstep7globalstep7",
        "epoch1epochstep0globalstep8", "epoch1epochstep3globalstep11", "epoch1epochstep6globalstep14",
        "epoch1epochstep7globalstep15",
    ]
    assert export_names(cb) == expected
    assert cb.model_dir == tmp_path / "checkpoints" / "tester" / "exp" / "t0" / "default"

    for name in expected:
        folder = cb.model_dir / name
        steps_done = parse_export_name(name).global_step + 1
        files = {p.name for p in folder.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
        assert "generation_config.json" in files
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
        live = snaps.weights[steps_done]
        got = loaded.state_dict()
        assert set(got) == set(live)
        for key, value in live.items():
            assert torch.equal(got[key], value), (name, key)
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=PROBE).logits, snaps.logits[steps_done]), name
        if arch == "gpt2_tied":
            # Tied: stored once in safetensors, tied again on load.
            assert "lm_head.weight" not in load_file(folder / "model.safetensors")
            assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()

    tok = AutoTokenizer.from_pretrained(cb.model_dir / expected[-1])
    text = "17+25=42"
    assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert cb.last_export == cb.model_dir / expected[-1]


def test_sharded_export_writes_index_and_loads(tmp_path) -> None:
    module = LMModule(tiny_llama())
    cb = saver(tmp_path, freq_epochs=1, max_shard_size=20_000)
    snaps = Snapshots(PROBE)
    make_trainer([cb, snaps], max_epochs=1).fit(module, token_loader(n_batches=2))
    folder = cb.model_dir / "epoch0epochstep1globalstep1"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for key, value in snaps.weights[2].items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert not (folder / "tokenizer.json").exists()  # no tokenizer anywhere: none written


def test_max_keep_removes_oldest_and_only_its_own_folders(tmp_path) -> None:
    cb = saver(tmp_path, freq_steps=2, max_keep=2)
    cb.model_dir.mkdir(parents=True)
    (cb.model_dir / "my_notes").mkdir()
    (cb.model_dir / "epoch9epochstep9globalstep9.bak").mkdir()
    (cb.model_dir / "README.txt").write_text("mine")
    make_trainer([cb], max_epochs=1).fit(LMModule(tiny_llama()), token_loader(n_batches=8))
    assert export_names(cb) == [
        "epoch0epochstep5globalstep5", "epoch0epochstep7globalstep7",
        "README.txt", "epoch9epochstep9globalstep9.bak", "my_notes",
    ]


def test_tokenizer_argument_wins_and_callable_model_attr(tmp_path, tokenizer) -> None:
    class TwoModels(LMModule):
        def __init__(self) -> None:
            super().__init__(tiny_llama())
            self.critic = tiny_gpt2()

    cb = saver(tmp_path, name="critic", model_attr=lambda m: m.critic, tokenizer=tokenizer, freq_epochs=1)
    actor = saver(tmp_path, freq_epochs=1)  # module has no tokenizer attribute value: none saved
    module = TwoModels()
    make_trainer([cb, actor], max_epochs=1).fit(module, token_loader(n_batches=2))
    critic_dir = cb.model_dir / "epoch0epochstep1globalstep1"
    assert json.loads((critic_dir / "config.json").read_text())["model_type"] == "gpt2"
    assert (critic_dir / "tokenizer.json").exists()
    actor_dir = actor.model_dir / "epoch0epochstep1globalstep1"
    assert json.loads((actor_dir / "config.json").read_text())["model_type"] == "llama"
    assert not (actor_dir / "tokenizer.json").exists()
    assert cb.state_key != actor.state_key


def test_wrong_model_attr_fails_before_training(tmp_path) -> None:
    module = LMModule(tiny_llama())
    for attr, error, words in (("backbone", TypeError, "model_attr: .*has no attribute 'backbone'"),
                               ("lr", UnsupportedModelError, "not a transformers.PreTrainedModel")):
        cb = saver(tmp_path, model_attr=attr, freq_steps=1)
        with pytest.raises(error, match=words):
            make_trainer([cb], max_epochs=1).fit(module, token_loader(n_batches=2))
        assert module.losses == []  # not a single step ran
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("point", ["hf.after_weights", "hf.before_publish", "commit.before_rename"])
def test_failure_mid_export_leaves_no_final_folder_and_surfaces(tmp_path, monkeypatch, point) -> None:
    cb = saver(tmp_path, freq_steps=2)
    module = LMModule(tiny_llama())
    monkeypatch.setenv(ENV_VAR, point)
    with pytest.raises(InjectedFault, match=point):
        make_trainer([cb], max_epochs=1).fit(module, token_loader(n_batches=4))
    assert len(module.losses) == 2  # failed at the first save, after step 2
    assert [p.name for p in cb.model_dir.iterdir()] == []  # no final folder, no temp left


def test_stale_temp_folders_are_cleaned_by_the_next_successful_save(tmp_path) -> None:
    cb = saver(tmp_path, freq_steps=2)
    stale = cb.model_dir / ".tmp-epoch0epochstep1globalstep1-deadbeef0000"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    trash = cb.model_dir / ".trash-epoch0epochstep0globalstep0-deadbeef0001"
    trash.mkdir()
    cb2 = saver(tmp_path, freq_steps=2, max_keep=5)
    make_trainer([cb2], max_epochs=1).fit(LMModule(tiny_llama()), token_loader(n_batches=2))
    assert export_names(cb2) == ["epoch0epochstep1globalstep1"]


def test_trigger_state_resumes_through_a_lightning_checkpoint(tmp_path) -> None:
    """Stop after 5 steps, save a Lightning checkpoint, resume: no double save, no skipped save."""
    ckpt = tmp_path / "mid.ckpt"

    class Crash(Exception):
        pass

    class StopAt5(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 5:
                trainer.save_checkpoint(ckpt)
                raise Crash

    cb = saver(tmp_path, freq_steps=4, freq_epochs=1)
    with pytest.raises(Crash):
        make_trainer([cb, StopAt5()], max_epochs=2).fit(LMModule(tiny_llama()), token_loader(n_batches=6))
    assert export_names(cb) == ["epoch0epochstep3globalstep3"]
    state = torch.load(ckpt, weights_only=True)["callbacks"][cb.state_key]
    assert state["freq"]["last_fired_step"] == 4 and state["epoch_start_step"] == 0

    cb2 = saver(tmp_path, freq_steps=4, freq_epochs=1)
    make_trainer([cb2], max_epochs=2).fit(LMModule(tiny_llama()), token_loader(n_batches=6), ckpt_path=ckpt)
    assert export_names(cb2) == [
        "epoch0epochstep3globalstep3", "epoch0epochstep5globalstep5", "epoch1epochstep1globalstep7",
        "epoch1epochstep5globalstep11",
    ]


def test_seconds_trigger_in_a_real_run(tmp_path) -> None:
    cb = saver(tmp_path, freq_secs=1)
    clock = [0.0]
    cb.freq._clock = lambda: clock[0]

    class Tick(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            clock[0] += 0.4  # each step "takes" 0.4 s

    make_trainer([Tick(), cb], max_epochs=1).fit(LMModule(tiny_llama()), token_loader(n_batches=7))
    # fires once 1 s has passed since the last save: after steps 3 (1.2 s) and 6 (2.4 s)
    assert export_names(cb) == ["epoch0epochstep2globalstep2", "epoch0epochstep5globalstep5"]


def test_an_export_lost_with_the_crash_is_written_again_by_the_resumed_run(tmp_path, tokenizer) -> None:
    """The run is stopped after the recover save of step 4 recorded the export of step 4, but
    before that export was in place (an async export still being written when the process was
    killed: here its folder is deleted): the resumed run writes it again at its start, from the
    same weights, byte for byte the uninterrupted run's; nothing else is exported twice."""
    import shutil

    from conftest import Crash, CrashAt, LMModule, make_trainer, tiny_llama, token_loader

    from areal_lightning import HFSaverCallback, RecoverCallback

    def fit(root: Path, crash: int | None = None) -> Path:
        where = dict(fileroot=root, experiment_name="e", trial_name="t", user="u")
        callbacks = [HFSaverCallback(**where, freq_steps=4, mode="sync"), RecoverCallback(**where, freq_steps=4)]
        if crash is not None:
            callbacks.insert(0, CrashAt(crash))
        make_trainer(callbacks, max_steps=8).fit(LMModule(tiny_llama(), tokenizer), token_loader())
        return root / "checkpoints/u/e/t/default"

    reference = fit(tmp_path / "reference")
    with pytest.raises(Crash):
        fit(tmp_path / "run", crash=6)
    models = tmp_path / "run/checkpoints/u/e/t/default"
    lost = models / "epoch0epochstep3globalstep3"
    assert lost.is_dir()
    shutil.rmtree(lost)  # as a SIGKILL leaves an async export that was not yet renamed into place
    fit(tmp_path / "run")
    names = sorted(p.name for p in models.glob("epoch*"))
    assert names == sorted(p.name for p in reference.glob("epoch*")) == ["epoch0epochstep3globalstep3",
                                                                         "epoch0epochstep7globalstep7"]
    for name in names:
        for file in sorted((reference / name).iterdir()):
            assert (models / name / file.name).read_bytes() == file.read_bytes(), (name, file.name)
