"""HFSaverCallback in multi-process runs: FSDP2 (Lightning ``ModelParallelStrategy``), FSDP1
(Lightning ``FSDPStrategy``, on CPU through ``tests/fsdp1_cpu.py``) and DDP.

One launch of ``tests/scripts/hf_distributed_train.py`` on 2 CPU ranks (gloo), one process
per rank started here as ``torchrun`` would, runs every case below as its own
``trainer.fit`` (see the script's docstring). Rank 0 of the script also saves the full
weights after every step, gathered in the same run; each export must load with
``AutoModelForCausalLM.from_pretrained`` bitwise equal to them, and equal a single-process
export of those same weights written here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from areal_lightning import ConfigError, HFSaverCallback
from tests.harness.launch import launch_ranks
from tests.harness.refcache import environment_key, shared

SCRIPT = Path(__file__).parent / "scripts" / "hf_distributed_train.py"
REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 420

CASES: dict[str, dict[str, Any]] = {
    "fsdp_gather_sync_llama_max_keep": {"strategy": "fsdp", "arch": "llama", "mode": "sync", "method": "gather",
                                        "max_keep": 1},
    "fsdp_gather_async_gpt2_sharded": {"strategy": "fsdp", "arch": "gpt2", "mode": "async", "method": "gather",
                                       "max_shard_size": 30_000},
    "fsdp_dcp_sync_gpt2_sharded": {"strategy": "fsdp", "arch": "gpt2", "mode": "sync", "method": "dcp",
                                   "max_shard_size": 30_000},
    "fsdp_dcp_async_llama_int_buffers": {"strategy": "fsdp", "arch": "llama", "mode": "async", "method": "dcp",
                                         "extra_buffers": True},
    "fsdp1_gather_async_gpt2_sharded": {"strategy": "fsdp1", "arch": "gpt2", "mode": "async", "method": "gather",
                                        "max_shard_size": 30_000},
    "fsdp1_dcp_sync_llama_int_buffers": {"strategy": "fsdp1", "arch": "llama", "mode": "sync", "method": "dcp",
                                         "extra_buffers": True},
    # torch.compile after sharding: the export is of the plain model (FSDP1's state-dict keys
    # leave out _orig_mod; the two FSDP1 methods read different state dicts)
    "fsdp_gather_sync_llama_compiled": {"strategy": "fsdp", "arch": "llama", "mode": "sync", "method": "gather",
                                        "compiled": True},
    "fsdp1_gather_sync_llama_compiled": {"strategy": "fsdp1", "arch": "llama", "mode": "sync", "method": "gather",
                                         "compiled": True},
    "fsdp1_dcp_async_llama_compiled": {"strategy": "fsdp1", "arch": "llama", "mode": "async", "method": "dcp",
                                       "compiled": True},
    "ddp_sync_llama": {"strategy": "ddp", "arch": "llama", "mode": "sync"},
    "ddp_async_gpt2": {"strategy": "ddp", "arch": "gpt2", "mode": "async"},
    # last: a failure in rank 0's background write must be raised on both ranks
    "fsdp_dcp_async_failure": {"strategy": "fsdp", "arch": "gpt2", "mode": "async", "method": "dcp",
                               "fault": "hf.before_publish@1"},
}
EXPORTS = ["epoch0epochstep1globalstep1", "epoch0epochstep3globalstep3"]  # 4 steps, freq_steps=2

# One group: every test reads the one shared 2-rank launch (no xdist worker waits on the other).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hf_distributed")]


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("hf_distributed_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Run every case once, in one 2-rank launch (once per suite run, shared by the workers:
    tests/harness/refcache.py); return the output folder."""
    return shared(tmp_path_factory, {"hf_distributed": list(CASES.values()), "env": environment_key()}, _launch)[0]


def _launch(out: Path) -> None:
    ranks = launch_ranks(SCRIPT, ["--out", str(out), "--cases", json.dumps(list(CASES.values()))], 2, out, cwd=REPO,
                         timeout=LAUNCH_TIMEOUT_S, unset=("AREAL_LIGHTNING_FAULT",))
    codes = [r.returncode for r in ranks]
    if codes != [0, 0]:
        tails = "\n".join((out / f"rank{r}.log").read_text()[-4000:] for r in (0, 1))
        pytest.fail(f"training processes exited with {codes} (timeout {LAUNCH_TIMEOUT_S}s):\n{tails}")


def case_dir(runs: Path, name: str) -> Path:
    return runs / f"case{list(CASES).index(name)}"


def rank_result(runs: Path, name: str, rank: int) -> dict[str, Any]:
    return json.loads((case_dir(runs, name) / f"rank{rank}.json").read_text())


def weights_in_files(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor stored in the export's safetensors files (each name must appear once)."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                assert key not in out, f"{key} stored twice"
                out[key] = f.get_tensor(key)
    return out


def single_process_export(script: Any, case: dict[str, Any], ref: dict[str, torch.Tensor], folder: Path) -> Path:
    """The same weights exported by the single-process path (``export_hf`` = ``save_pretrained``)."""
    from areal_lightning.tools.demo import build_tokenizer
    from areal_lightning.hf_export import export_hf

    model = script.build_model(case["arch"])
    if case.get("extra_buffers"):
        script.add_extra_buffers(model)
    model.load_state_dict(ref)
    return export_hf(model, folder, build_tokenizer(), max_shard_size=case.get("max_shard_size") or "5GB")


@pytest.mark.parametrize("name", [n for n in CASES if "failure" not in n])
def test_export_loads_bitwise_equal_to_the_gathered_weights_and_to_a_single_process_export(
    runs: Path, name: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    case, script = CASES[name], _load_script()
    results = [rank_result(runs, name, r) for r in (0, 1)]
    for rank, result in enumerate(results):
        assert result["error"] is None, (rank, result["error"])
        assert result["resolved_mode"] == case["mode"]
    model_dir = Path(results[0]["model_dir"])
    assert results[0]["returned"] == [str(model_dir / e) for e in EXPORTS]  # only rank 0 returns the folder
    assert results[1]["returned"] == [None, None]
    expected_thread = "areal-hf-default" if case["mode"] == "async" else "MainThread"
    assert [t.rsplit("_", 1)[0] for t in results[0]["published_in"]] == [expected_thread] * 2
    assert results[1]["published_in"] == []  # rank 1 publishes (and prunes) nothing
    kept = EXPORTS[-case["max_keep"]:] if case.get("max_keep") else EXPORTS  # pruned by rank 0 alone
    # Everything any rank wrote under the trial is inside the export folders.
    root = case_dir(runs, name) / "root"
    stray = [p for p in root.rglob("*") if p.is_file() and not any(model_dir / e in p.parents for e in kept)]
    assert stray == []
    assert sorted(p.name for p in model_dir.iterdir()) == kept

    refs = {e: load_file(case_dir(runs, name) / "ref" / f"step{int(e.rsplit('globalstep', 1)[1])}.safetensors")
            for e in EXPORTS}
    assert not all(torch.equal(refs[EXPORTS[0]][k], refs[EXPORTS[1]][k]) for k in refs[EXPORTS[0]])  # it trained
    for export in kept:
        folder, ref = model_dir / export, refs[export]
        files = sorted(p.name for p in folder.iterdir())
        weight_files = [f for f in files if f.endswith(".safetensors")]
        assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
        assert all(p.is_file() for p in folder.iterdir())  # no leftover sharded/ or metadata folder
        if case.get("max_shard_size") or case.get("extra_buffers"):
            index = json.loads((folder / "model.safetensors.index.json").read_text())
            n = len(weight_files)
            assert n > 1 and weight_files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
            assert sorted(set(index["weight_map"].values())) == weight_files
        else:
            assert weight_files == ["model.safetensors"] and "model.safetensors.index.json" not in files

        stored = weights_in_files(folder)
        if case["arch"] == "gpt2":  # tied: stored once, tied again on load
            assert "lm_head.weight" not in stored and "transformer.wte.weight" in stored
        for key, value in stored.items():
            assert value.dtype == ref[key].dtype and torch.equal(value, ref[key]), (export, key)
        loaded = AutoModelForCausalLM.from_pretrained(folder)
        got = loaded.state_dict()
        assert set(got) <= set(ref)
        for key, value in got.items():
            assert torch.equal(value, ref[key]), (export, key)
        if case["arch"] == "gpt2":
            assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
        assert AutoTokenizer.from_pretrained(folder)("12+3=")["input_ids"]

        single = single_process_export(script, case, ref, tmp_path / name / export)
        assert weights_in_files(single).keys() == stored.keys()
        if case.get("method") != "dcp":  # save_pretrained on rank 0: the very same files
            for f in files:
                assert (folder / f).read_bytes() == (single / f).read_bytes(), (export, f)
        else:  # DCP's consolidated files have their own headers; same split, same tensors
            assert (folder / "config.json").read_bytes() == (single / "config.json").read_bytes()
            if not case.get("extra_buffers") and len(weight_files) > 1:
                index = json.loads((folder / "model.safetensors.index.json").read_text())
                assert index == json.loads((single / "model.safetensors.index.json").read_text())


def test_a_failed_background_export_on_rank_0_is_raised_on_every_rank(runs: Path) -> None:
    name = "fsdp_dcp_async_failure"
    rank0, rank1 = (rank_result(runs, name, r) for r in (0, 1))
    first = EXPORTS[0]
    assert rank0["error_type"] == "CheckpointWriteError"
    assert "InjectedFault" in rank0["error"] and first in rank0["error"]
    assert rank1["error_type"] == "RankFailure"  # a CheckpointWriteError naming the rank that failed
    assert f"{first} failed on rank 0" in rank1["error"]
    # Both ranks stopped at the next export: it was never started, and nothing was published.
    assert rank0["returned"] == [str(Path(rank0["model_dir"]) / first)] and rank1["returned"] == [None]
    assert list(Path(rank0["model_dir"]).iterdir()) == []


def test_sharded_method_is_validated_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sharded_method: unknown method 'fast'; allowed: gather, dcp"):
        HFSaverCallback(fileroot=tmp_path, experiment_name="e", trial_name="t", sharded_method="fast")


def test_export_state_dict_drops_tied_aliases_like_save_pretrained() -> None:
    from areal_lightning.capture.hf_weights import export_state_dict
    from tests.conftest import tiny_gpt2, tiny_llama

    gpt2 = tiny_gpt2()
    assert set(export_state_dict(gpt2)) == set(gpt2.state_dict()) - {"lm_head.weight"}
    llama = tiny_llama()
    assert set(export_state_dict(llama)) == set(llama.state_dict())


def test_file_plan_puts_tensors_dcp_cannot_consolidate_in_one_extra_last_file() -> None:
    from areal_lightning.capture.hf_weights import split_for_dcp
    from areal_lightning.write.hf import HFFilePlan

    state = {"a": torch.zeros(10, 10), "ids": torch.arange(3), "b": torch.zeros(10, 10), "scale": torch.tensor(1.0)}
    shards, extras = split_for_dcp(state)
    assert list(shards) == ["a", "b"] and list(extras) == ["ids", "scale"]
    plan = HFFilePlan(state, shards, max_shard_size=500)  # a and b do not fit together
    assert plan.dcp_index == {"a": 1, "b": 2} and plan.files == 3 and plan.total_size == 2 * 400 + 3 * 8 + 4
    assert [plan.name(i) for i in (1, 2, 3)] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    single = HFFilePlan({"a": state["a"]}, {"a"}, max_shard_size="5GB")
    assert single.files == 1 and single.name(1) == "model.safetensors"
