"""Portable recover checkpoints (issue 25): checkpoints of earlier releases, ``convert`` to an HF
folder and to one Lightning file. (Resuming under another strategy family and world size:
``tests/test_distributed.py::test_a_recover_checkpoint_resumes_under_another_strategy_and_world_size``.)

``tests/fixtures/recover_trial_v0_1_0`` is a whole trial written by release 0.1.0 (commit 111c3fb):
``tests/scripts/train_recover.py --freq-steps 4 --epochs 2 --logger none --kill-at-step 5`` on one
process, killed after step 5 (its checkpoint: step 4; its optimizer state keyed by position), with
the losses the killed run logged (``losses.jsonl``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import LMModule, make_trainer, tiny_gpt2, tiny_llama, token_loader
from test_recover_e2e import REPO, train

FIXTURE = Path(__file__).parent / "fixtures" / "recover_trial_v0_1_0"
TRIAL = Path("checkpoints/u/exp/t")
ARGS = ("--freq-steps", "4", "--epochs", "2", "--logger", "none")


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_recover_trial_of_release_0_1_0_resumes_exactly(tmp_path: Path) -> None:
    """The fixture's state was computed on another machine, whose CPU may round the same
    arithmetic differently (its Adam moments after 4 steps differ in the last bits from this
    machine's): what must hold everywhere is that the resume starts from exactly the saved
    state, at exactly the saved data position, and finishes the run."""
    from areal_lightning.write.dcp import DCPEngine

    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    killed = [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
    resumed = train(run, run / "losses.jsonl", *ARGS, "--dump-state", str(tmp_path / "state"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "RecoverCallback: resumed from" in resumed.stderr
    rows = [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, *range(5, 25)]  # resumed after step 4, the checkpoint's
    # the data position: the lost step 5 trains the same samples again, each sample once an epoch
    assert rows[5]["samples"] == killed[4]["samples"]
    samples = [s for row in rows[:4] + rows[5:] for s in row["samples"]]
    assert sorted(samples) == sorted(list(range(48)) * 2)
    # the state right after the resume is the saved one, bit for bit (positions mapped to names)
    saved = DCPEngine().load(FIXTURE / TRIAL / "default" / "recover_checkpoint", weights_only=False)  # step 4
    start = torch.load(tmp_path / "state.start4.pt")
    assert set(start["model"]) == set(saved["state_dict"])
    for key, tensor in saved["state_dict"].items():
        assert torch.equal(start["model"][key], tensor), key
    names = [name for group in start["optim"]["param_groups"] for name in group["params"]]
    positional = saved["optimizer_states"][0]["state"]
    assert sorted(positional) == list(range(len(names)))
    for index, name in enumerate(names):
        for key, value in positional[index].items():
            assert torch.equal(start["optim"]["state"][name][key], value), (name, key)


@pytest.mark.slow
def test_a_checkpoint_keyed_by_position_is_refused_by_a_sharded_strategy_naming_both(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    before = _files(tmp_path / TRIAL)
    proc = train(tmp_path, tmp_path / "losses.jsonl", *ARGS, "--strategy", "fsdp2", "--devices", "1")
    assert proc.returncode != 0
    assert ("strategy='SingleDeviceStrategy', whose optimizer states are keyed by position (written before "
            "areal_lightning 0.2.0") in proc.stderr
    assert "this run has strategy='ModelParallelStrategy'" in proc.stderr and "Resume with a replicated" in proc.stderr
    after = _files(tmp_path / TRIAL)
    after.pop(".lock", None)
    assert after == before  # nothing on disk changed


# -- convert: HF folder and one Lightning file, from every writer ---------------------------

LM_SCRIPT = Path(__file__).parent / "scripts" / "train_fsdp1.py"
WRITERS = {"1-process": "single", "ddp-2": "ddp", "fsdp1-2": "fsdp1", "fsdp2-2": "fsdp2"}


def _lm_script() -> Any:
    spec = importlib.util.spec_from_file_location("train_fsdp1_for_convert", LM_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("writer", list(WRITERS))
def test_convert_gives_the_hf_export_of_the_step_a_lightning_file_and_a_stock_dcp_whatever_wrote_it(tmp_path, writer) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_lightning import convert
    from areal_lightning.layout import parse_export_name
    from areal_lightning.write.dcp import DCPEngine

    root = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(LM_SCRIPT), "--root", str(root), "--losses", str(tmp_path / "l.jsonl"),
                           "--strategy", WRITERS[writer], "--epochs", "1", "--freq-steps", "4", "--hf-freq-steps", "4"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trial = root / TRIAL
    step = json.loads((trial / "recover_info" / "checkpoint_info.json").read_text())["global_step"]
    exports = sorted((parse_export_name(p.name).global_step, p) for p in (trial / "default").iterdir()
                     if parse_export_name(p.name))
    assert exports[-1][0] == step - 1  # the last export is of the checkpoint's step
    export = exports[-1][1]

    hf = convert(root, "hf", tmp_path / "hf")  # the Python API, from the fileroot
    assert sorted(p.name for p in hf.iterdir()) == sorted(p.name for p in export.iterdir())
    for p in export.iterdir():
        assert (hf / p.name).read_bytes() == p.read_bytes(), p.name  # bit for bit
    AutoModelForCausalLM.from_pretrained(hf)
    AutoTokenizer.from_pretrained(hf)
    cli = subprocess.run([sys.executable, "-m", "areal_lightning", "convert", str(trial), "--to", "lightning",
                          "--out", str(tmp_path / "one.ckpt")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.strip() == str(tmp_path / "one.ckpt")

    script = _lm_script()
    weights = load_file(export / "model.safetensors")
    module = script.LM.load_from_checkpoint(tmp_path / "one.ckpt", losses=str(tmp_path / "again.jsonl"))
    live = module.model.state_dict()
    for key, tensor in weights.items():
        assert torch.equal(live[key], tensor), key

    # trainer.fit(ckpt_path=...) on one process takes it: optimizer states by parameter name as saved
    saved = DCPEngine().load(trial / "default" / "recover_checkpoint")["optimizer_states"][0]["state"]

    class Check(script.pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            opt = trainer.optimizers[0]
            for name, p in pl_module.named_parameters():
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    assert torch.equal(opt.state[p][k], saved[name][k]), (name, k)
            self.checked = trainer.global_step

    check = Check()
    trainer = script.pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[check])
    trainer.fit(script.LM(str(tmp_path / "again.jsonl")), script.loader(1, 32, True), ckpt_path=tmp_path / "one.ckpt")
    assert check.checked == step and trainer.global_step == step + 16  # the second epoch, on one process

    # --to dcp: torch's own layout, which a stock dcp.load reads (every rank's shards, one process)
    import torch.distributed.checkpoint as dcp

    from areal_lightning.write.offline import read_tensors, tensor_entries

    stock = convert(trial, "dcp", tmp_path / "stock")
    entries = tensor_entries(trial / "default" / "recover_checkpoint")
    assert tensor_entries(stock) == entries
    theirs = {fqn: torch.empty(size, dtype=dtype) for fqn, (size, dtype) in entries.items()}
    ours = {fqn: torch.empty(size, dtype=dtype) for fqn, (size, dtype) in entries.items()}
    dcp.load(theirs, checkpoint_id=stock, no_dist=True)
    read_tensors(trial / "default" / "recover_checkpoint", ours)
    for fqn, tensor in ours.items():
        assert torch.equal(theirs[fqn], tensor), fqn


def test_convert_refuses_bad_input_naming_what_to_pass_and_writes_nothing(tmp_path) -> None:
    from areal_lightning import ConfigError, convert
    from areal_lightning.tools.convert import ConvertError

    shutil.copytree(FIXTURE, tmp_path / "run")
    with pytest.raises(ConfigError, match="to: unknown target 'onnx'; allowed: hf, lightning"):
        convert(tmp_path / "run", "onnx", tmp_path / "out")
    with pytest.raises(ConvertError, match="records no HF model named 'default' .* Pass hf_config"):
        convert(tmp_path / "run", "hf", tmp_path / "out")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    with pytest.raises(ConvertError, match="already exists"):
        convert(tmp_path / "run", "lightning", tmp_path / "taken")
    assert (tmp_path / "taken" / "mine.txt").read_text() == "keep"
    with pytest.raises(ValueError, match="taken is neither a fileroot .* nor a trial folder"):
        convert(tmp_path / "taken", "lightning", tmp_path / "x.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "taken"]  # nothing else written
    # an old trial converts to one Lightning file (its optimizer keyed by position already)
    out = convert(tmp_path / "run", "lightning", tmp_path / "old.ckpt")
    checkpoint = torch.load(out, weights_only=True)
    assert checkpoint["global_step"] == 4 and set(checkpoint["optimizer_states"][0]["state"]) == {0, 1, 2, 3}


class _ActorCritic(pl.LightningModule):
    """An RL-style module: a Llama policy (``model``) and a GPT-2 critic with tied embeddings."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.model, self.critic, self.tokenizer = tiny_llama(), tiny_gpt2(), tokenizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss + self.critic(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _newest_export(folder: Path) -> Path:
    from areal_lightning.layout import parse_export_name

    return max((p for p in folder.iterdir() if parse_export_name(p.name)),
               key=lambda p: parse_export_name(p.name).global_step)


def _same_files(a: Path, b: Path) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in b.iterdir():
        assert (a / p.name).read_bytes() == p.read_bytes(), p.name


def test_a_recover_save_before_the_first_export_records_the_config_the_export_writes(tmp_path, tokenizer) -> None:
    """``save_pretrained`` stamps the live config with its dtype and architectures. A recover
    save before the first export (step 1) and the saves after it record one folder per model,
    whose ``config.json`` is the export's: the folders do not depend on whether (or, with a
    background export, how far) an export ran before (it made a second folder for the exported
    model, an order the actor-critic test met now and then in CI)."""
    from areal_lightning import HFSaverCallback, RecoverCallback

    common = dict(fileroot=str(tmp_path), experiment_name="exp", trial_name="t", user="u")
    callbacks = [HFSaverCallback(**common, freq_steps=2), RecoverCallback(**common, freq_steps=1)]
    make_trainer(callbacks, max_steps=4).fit(_ActorCritic(tokenizer), token_loader())
    trial = tmp_path / TRIAL
    recorded = json.loads((trial / "recover_info" / "checkpoint_info.json").read_text())["hf_models"]
    assert sorted(p.name for p in (trial / "recover_hf").iterdir()) == \
        sorted(Path(entry["files"]).name for entry in recorded.values())  # one per model, the ones recorded
    export = _newest_export(trial / "default")
    assert (trial / recorded["default"]["files"] / "config.json").read_bytes() == (export / "config.json").read_bytes()


def test_convert_of_an_actor_and_its_critic_each_equals_its_export(tmp_path, tokenizer) -> None:
    from areal_lightning import HFSaverCallback, RecoverCallback, convert

    common = dict(fileroot=str(tmp_path), experiment_name="exp", trial_name="t", user="u", freq_steps=4)
    callbacks = [HFSaverCallback(**common), HFSaverCallback(**common, name="critic", model_attr="critic"),
                 RecoverCallback(**common)]
    make_trainer(callbacks, max_epochs=1).fit(_ActorCritic(tokenizer), token_loader())
    trial = tmp_path / TRIAL
    for name in ("default", "critic"):
        _same_files(convert(trial, "hf", tmp_path / "out" / name, name=name), _newest_export(trial / name))
    recorded = json.loads((trial / "recover_info" / "checkpoint_info.json").read_text())["hf_models"]
    assert {name: entry["prefix"] for name, entry in recorded.items()} == {"default": "model.", "critic": "critic."}
    assert len(list((trial / "recover_hf").iterdir())) == 2  # written once each, not at every save
    # a model the checkpoint records under no name: its config folder and attribute given
    critic_export = _newest_export(trial / "critic")
    out = convert(trial / "default" / "recover_checkpoint", "hf", tmp_path / "given", model_attr="critic",
                  hf_config=critic_export)
    _same_files(out, critic_export)


def test_convert_without_an_hf_callback_finds_the_modules_pretrained_model(tmp_path, tokenizer) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_lightning import RecoverCallback, convert

    module = LMModule(tiny_llama(), tokenizer)
    recover = RecoverCallback(fileroot=str(tmp_path), experiment_name="exp", trial_name="t", user="u", freq_steps=4)
    make_trainer([recover], max_epochs=1).fit(module, token_loader())
    out = convert(tmp_path, "hf", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for key, tensor in module.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    assert AutoTokenizer.from_pretrained(out)("1 + 2").input_ids == tokenizer("1 + 2").input_ids


def test_a_recover_save_tells_hf_models_by_their_bases_without_loading_transformers_modeling_code() -> None:
    """``is_pretrained`` (which models a recover save records for ``convert --to hf``): an HF
    model and a subclass of one are, a plain module and an unrelated class of the same name are
    not; and a run without an HF model does not load transformers' modeling code for it (half a
    second at its first save), checked in a fresh process."""
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    from areal_lightning.capture.hf_meta import is_pretrained

    class PreTrainedModel(torch.nn.Module):  # same name, not transformers'
        pass

    class Mine(LlamaForCausalLM):
        pass

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=10)
    assert is_pretrained(LlamaForCausalLM(config)) and is_pretrained(Mine(config))
    assert not is_pretrained(torch.nn.Linear(2, 2)) and not is_pretrained(PreTrainedModel())
    code = ("import sys, torch; from areal_lightning.capture.hf_meta import is_pretrained; "
            "assert not is_pretrained(torch.nn.Linear(2, 2)); print('transformers.modeling_utils' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]
