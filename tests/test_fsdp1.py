"""``strategy="fsdp"`` (Lightning's ``FSDPStrategy``, torch FSDP1) on 2 CPU ranks (gloo).

Each case is a real fine-tuning job (tests/scripts/train_fsdp1.py: a tiny Llama with
``auto_wrap_policy={LlamaDecoderLayer}``, a tokenizer, a shuffled loader, validation every 5
steps, ``HFSaverCallback`` + ``RecoverCallback``) launched by Lightning itself, killed with
SIGKILL and started again with the same command. The strategy is
``tests/fsdp1_cpu.CPUFSDPStrategy`` (``FSDPStrategy`` given ``device_id=cpu``): real flat
parameters, ``ShardedTensor`` state dicts and FSDP1 optimizer state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from tests.harness.launch import free_port
from tests.harness.losses import step_losses
from tests.harness.refcache import reference_run

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "train_fsdp1.py"
REPO = Path(__file__).resolve().parents[1]
TRIAL = Path("checkpoints/u/exp/t")
CKPT = TRIAL / "default" / "recover_checkpoint"


def train(root: Path, *args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--losses", str(root / "losses"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def ok(proc: subprocess.CompletedProcess, root: Path) -> None:
    errors = "".join(p.read_text()[:3000] for p in root.glob("error.rank*.txt"))
    assert proc.returncode == 0, errors or proc.stderr[-4000:]


def losses(root: Path, rank: int) -> dict[int, set[str]]:
    return step_losses(root / f"losses.rank{rank}")


def exports(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every HF export folder of the trial: its tensors (all safetensors files)."""
    out = {}
    for folder in sorted((root / TRIAL / "default").glob("epoch*")):
        tensors: dict[str, torch.Tensor] = {}
        for f in folder.glob("*.safetensors"):
            tensors.update(load_file(f))
        out[folder.name] = tensors
    return out


def assert_resumed_run_is_the_uninterrupted_one(ref: Path, run: Path, world: int = 2) -> None:
    for rank in range(world):
        want, got = losses(ref, rank), losses(run, rank)
        assert sorted(got) == sorted(want), f"rank {rank}: the resumed run did not train the same steps"
        for step in want:
            assert got[step] == want[step], f"rank {rank} step {step}: {got[step]} != uninterrupted {want[step]}"
        pids = {json.loads(line)["pid"] for line in (run / f"losses.rank{rank}").read_text().splitlines()}
        assert len(pids) == 2, "the run was not killed and restarted"
    want, got = exports(ref), exports(run)
    assert list(got) == list(want) and want
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for key in want[name]:
            assert torch.equal(got[name][key], want[name][key]), (name, key)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    last = run / TRIAL / "default" / list(got)[-1]
    model = AutoModelForCausalLM.from_pretrained(last)
    for key, tensor in got[last.name].items():
        assert torch.equal(model.state_dict()[key], tensor), key
    assert AutoTokenizer.from_pretrained(last)("1+2=3")["input_ids"]


def assert_both_ranks_wrote_their_shards(root: Path) -> None:
    ckpt = root / CKPT
    metadata = FileSystemReader(ckpt).read_metadata()
    writers = {item.relative_path.split("_")[2] for item in metadata.storage_data.values()}
    assert writers == {"0", "1"}, writers
    chunks = metadata.state_dict_metadata["state_dict.model.model.layers.0.mlp.gate_proj.weight"].chunks
    # FSDP1's sharded state dict: each rank wrote its own half of the (64, 32) weight
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (32, 0)]


def reference(tmp_path_factory, *args: str) -> Path:
    """The uninterrupted run of ``args`` (once per suite run, shared by the workers:
    tests/harness/refcache.py). Tests must not change it."""
    root, proc = reference_run(tmp_path_factory, [sys.executable, str(SCRIPT), "--root", "{root}", "--losses",
                                                  "{root}/losses", *args])
    ok(proc, root)
    return root


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_default_modes_sigkill_both_ranks_resume_bit_for_bit_and_two_to_one(tmp_path, tmp_path_factory,
                                                                            namespace) -> None:
    """Default modes (recover ``auto`` = async DCP, HF ``auto`` = async gather export);
    then the checkpoint of the killed 2-rank run resumes on 1 rank (FSDP1 on one rank is
    ``NO_SHARD``) from exactly the saved model and optimizer state. Under either Lightning
    namespace (both compared with the ``lightning.pytorch`` uninterrupted run)."""
    ref = reference(tmp_path_factory)
    ns = ("--namespace", namespace)
    run = tmp_path / "run"
    killed = train(run, *ns, "--kill-at-step", "7", "--dump-state", str(tmp_path / "dump2"))
    assert killed.returncode != 0
    assert_both_ranks_wrote_their_shards(run)
    shutil.copytree(run / "checkpoints", tmp_path / "one" / "checkpoints")  # for the 2 -> 1 resume below
    ok(train(run, *ns, "--dump-state", str(tmp_path / "dump2")), run)
    assert_resumed_run_is_the_uninterrupted_one(ref, run)
    assert_both_ranks_wrote_their_shards(run)

    one = tmp_path / "one"
    proc = train(one, *ns, "--devices", "1", "--epochs", "1", "--dump-state", str(tmp_path / "dump1"))
    ok(proc, one)
    # The step it resumed from: the last durable checkpoint, or the newer one an async save had
    # written completely when the kill came (the resume finishes its swap), whichever the kill left.
    (start_dump,) = tmp_path.glob("dump1.start*.pt")
    g = int(start_dump.name[len("dump1.start"):-len(".pt")])
    saved = torch.load(tmp_path / f"dump2.step{g}.pt", weights_only=True)  # the checkpoint the kill left
    start = torch.load(tmp_path / f"dump1.start{g}.pt", weights_only=True)
    assert saved["model"].keys() == start["model"].keys()
    for key in saved["model"]:
        assert torch.equal(start["model"][key], saved["model"][key]), key
    for fqn, state in saved["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(start["optim"]["state"][fqn][name], value), (fqn, name)
    info = json.loads((one / TRIAL / "recover_info" / "checkpoint_info.json").read_text())
    assert info["world_size"] == 1 and info["family"] == "sharded"
    # every sample of epoch 0 trained exactly once across both runs: g steps x 2 ranks x 2
    # samples before the kill, the remaining 32 - 4g samples as 16 - 2g steps on one rank
    assert sorted(losses(one, 0)) == list(range(g + 1, 17 - g))


def test_sync_dcp_export_mixed_precision_activation_checkpointing_sigkill_resume(tmp_path, tmp_path_factory) -> None:
    """Sync recover saves, the ``dcp`` HF export method (each rank writes its shards, rank 0
    consolidates), sync HF exports, bf16 mixed precision and activation checkpointing."""
    args = ("--io-mode", "sync", "--hf-mode", "sync", "--method", "dcp", "--mixed", "--act-ckpt")
    ref = reference(tmp_path_factory, *args)
    run = tmp_path / "run"
    assert train(run, *args, "--kill-at-step", "10").returncode != 0
    ok(train(run, *args), run)
    assert_resumed_run_is_the_uninterrupted_one(ref, run)
    assert_both_ranks_wrote_their_shards(run)


def test_no_shard_on_one_rank_saves_and_resumes_bit_for_bit(tmp_path, tmp_path_factory) -> None:
    args = ("--devices", "1", "--sharding", "NO_SHARD", "--epochs", "1")
    ref = reference(tmp_path_factory, *args)
    run = tmp_path / "run"
    assert train(run, *args, "--kill-at-step", "11").returncode != 0
    ok(train(run, *args), run)
    assert_resumed_run_is_the_uninterrupted_one(ref, run, world=1)


def _errors(root: Path) -> dict[int, str]:
    return {rank: (root / f"error.rank{rank}.txt").read_text() for rank in range(2)}


def test_a_failure_on_rank_1_only_is_an_error_on_both_ranks_at_save_and_at_load(tmp_path) -> None:
    """Rank 1 fails at the start of its 2nd recover save; rank 0 does not wait in DCP's
    collectives (or the process group's 30-minute timeout) but raises naming rank 1. Then
    the checkpoint the run left is damaged in rank 1's shards (see the helper below)."""
    proc = train(tmp_path, "--fault-rank", "1", "--timeout", "30", env={"TEST_FAULT": "engine.before_staging@2"},
                 timeout=150)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = _errors(tmp_path)
    assert errors[1].startswith("InjectedFault: fault injected at 'engine.before_staging'")
    assert errors[0].startswith("RankFailure: checkpoint save to "), errors[0][:500]
    assert "failed on rank 1: InjectedFault" in errors[0].splitlines()[0]
    # the checkpoint of the first save is intact, no half-written one was published
    info = json.loads((tmp_path / TRIAL / "recover_info" / "checkpoint_info.json").read_text())
    assert info["global_step"] == 3
    _damaged_shard_of_rank_1_stops_both_ranks_naming_file_and_key(tmp_path)


def _damaged_shard_of_rank_1_stops_both_ranks_naming_file_and_key(tmp_path: Path) -> None:
    """Integrity that scales: no rank checks another's files before loading; each rank
    verifies the CRC32C of every item as it reads it. A flipped byte in one of rank 1's FSDP
    shards is read (and caught) by rank 1 alone, and the load's agreement stops rank 0 too,
    before FSDP's own load collectives; a shard of rank 1 truncated is found by its size
    before anything is loaded, on both."""
    for p in tmp_path.glob("error.rank*.txt"):
        p.unlink()
    trained = (tmp_path / "losses.rank0").read_text()
    ckpt = tmp_path / CKPT
    pristine = tmp_path / "pristine"
    shutil.copytree(ckpt, pristine)
    key, offset, length = _largest_item(ckpt, "__1_0.distcp", "state_dict.")
    shard = ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[offset + length // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    proc = train(tmp_path, "--timeout", "30", timeout=150)
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = _errors(tmp_path)
    first = {rank: text.splitlines()[0] for rank, text in errors.items()}
    assert first[1].startswith(f"CheckpointCorruptError: {shard} fails its CRC32C check in {key!r}"), first[1]
    assert "delete" in first[1] and "recover_info to start fresh" in first[1]
    assert first[0].startswith("RankFailure: checkpoint load of ") and "failed on rank 1: CheckpointCorruptError: " \
        f"{shard} fails its CRC32C check in {key!r}" in first[0], first[0]
    assert "fails its CRC32C" not in errors[0].split("RankFailure", 1)[0]  # rank 0 did not read that item itself
    for p in tmp_path.glob("error.rank*.txt"):
        p.unlink()

    shutil.rmtree(ckpt)
    shutil.copytree(pristine, ckpt)
    truncated = ckpt / "__1_1.distcp"
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size - 10)
    proc = train(tmp_path, "--timeout", "30", timeout=150)
    assert proc.returncode == 3, proc.stderr[-3000:]
    for rank, text in _errors(tmp_path).items():
        assert f"{truncated} has " in text.splitlines()[0] and "(truncated?)" in text.splitlines()[0], (rank, text[:500])
    assert (tmp_path / "losses.rank0").read_text() == trained  # neither failed start trained a step


def test_a_failure_of_rank_0s_background_publish_of_the_last_save_is_an_error_on_both_ranks(tmp_path) -> None:
    """Async: only rank 0 publishes (recover_info + swap), in the background, after DCP's save
    returned. When the last save's publish fails, rank 1 must not end the fit as a success:
    the fit's end waits for the save on every rank and agrees (rank 1 raises naming rank 0)."""
    proc = train(tmp_path, "--fault-rank", "0", "--io-mode", "async", "--timeout", "30", "--epochs", "1",
                 env={"TEST_FAULT": "recover.swap.begin@3"}, timeout=150)  # saves after steps 3, 6 and 8
    assert proc.returncode == 3, proc.stderr[-3000:]
    errors = _errors(tmp_path)
    assert errors[0].startswith("CheckpointWriteError: ") and "recover.swap.begin" in errors[0].splitlines()[0]
    first = errors[1].splitlines()[0]
    assert first.startswith("RankFailure: recover checkpoint in flight at the end of training failed on rank 0"), first
    # the previous checkpoint stays the committed one
    info = json.loads((tmp_path / TRIAL / "recover_info" / "checkpoint_info.json").read_text())
    assert info["global_step"] == 6


def _largest_item(ckpt: Path, file: str, prefix: str) -> tuple[str, int, int]:
    """(key, offset, length) of the largest item under ``prefix`` stored in ``ckpt/file``."""
    md = FileSystemReader(ckpt).read_metadata()
    items = [(info.length, index.fqn, info.offset) for index, info in md.storage_data.items()
             if info.relative_path == file and index.fqn.startswith(prefix)]
    length, key, offset = max(items)
    return key, offset, length


def test_a_rank_killed_mid_save_is_an_error_on_the_other(tmp_path) -> None:
    """Rank 1 dies (SIGKILL) at its 2nd recover save: gloo sees the connection drop and rank 0
    raises at the agreement (no wait for the timeout)."""
    proc = train(tmp_path, "--fault-rank", "1", "--timeout", "300",
                 env={"TEST_FAULT": "engine.before_staging:kill@2"}, timeout=150)
    assert proc.returncode == 3, proc.stderr[-3000:]
    first = (tmp_path / "error.rank0.txt").read_text().splitlines()[0]
    assert first.startswith("RankFailure: checkpoint save to ") and "not every rank reached" in first, first


def test_a_stuck_rank_ends_the_other_after_the_collective_timeout(tmp_path) -> None:
    """Rank 1 hangs at its 2nd recover save (alive, connected, never arriving): rank 0 raises
    once collective_timeout (10 s) has passed, and Lightning's launcher then ends rank 1."""
    proc = train(tmp_path, "--fault-rank", "1", "--timeout", "10",
                 env={"TEST_FAULT": "engine.before_staging:hang@2"}, timeout=150)
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = (tmp_path / "error.rank0.txt").read_text().splitlines()
    assert lines[0].startswith("RankFailure: checkpoint save to ") and "collective_timeout=10s" in lines[0], lines[0]
    assert not (tmp_path / "error.rank1.txt").exists()  # it never got past the hang


def two_nodes(roots: tuple[Path, Path], *args: str) -> list[subprocess.CompletedProcess]:
    """Two ``torchrun`` agents, one process each, meeting by c10d rendezvous on 127.0.0.1:
    a two-node job on one machine. Node n trains into ``roots[n]``."""
    port, rdzv = free_port(), f"t{os.getpid()}{free_port()}"
    procs = []
    for root in roots:
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv,
               "--max-restarts", "0", str(SCRIPT), "--root", str(root), "--losses", str(root / "losses"),
               "--devices", "1", "--num-nodes", "2", *args]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.fresh_interpreter  # torchrun and its workers as new interpreters
def test_two_nodes_by_torchrun_sigkill_resume_bit_for_bit(tmp_path, tmp_path_factory) -> None:
    """Global ranks 0 and 1 on two "nodes" train exactly what the Lightning-launched 2-rank
    run trains, killed and resumed the same way."""
    ref = reference(tmp_path_factory)
    run = tmp_path / "run"
    assert all(p.returncode != 0 for p in two_nodes((run, run), "--kill-at-step", "7"))
    for proc in two_nodes((run, run)):
        ok(proc, run)
    assert_resumed_run_is_the_uninterrupted_one(ref, run)
    assert_both_ranks_wrote_their_shards(run)


def test_a_fileroot_not_shared_between_nodes_is_refused_at_setup(tmp_path) -> None:
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    procs = two_nodes((node0, node1))
    assert all(p.returncode != 0 for p in procs)
    # the rendezvous numbers the nodes in the order the agents join: either folder may be rank 0's
    errors = {p.name: p.read_text().splitlines()[0] for root in (node0, node1) for p in root.glob("error.rank*.txt")}
    assert sorted(errors) == ["error.rank0.txt", "error.rank1.txt"], errors
    first0, first1 = errors["error.rank0.txt"], errors["error.rank1.txt"]
    assert first1.startswith("RuntimeError: rank 1 cannot see .shared-check-") and "same fileroot" in first1, first1
    assert first0.startswith("RankFailure: shared storage check") and "failed on rank 1" in first0, first0
    for root in (node0, node1):
        assert not list(root.glob("losses.rank*"))  # refused before the first training step
        assert not list(root.rglob(".shared-check-*")) and not list(root.rglob("*.distcp"))
