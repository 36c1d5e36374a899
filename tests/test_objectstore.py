"""Object-store roots (``s3://``) against a real S3 API server (moto's, a process on 127.0.0.1).

In-process: ``DCPCheckpointIO`` generations and their marker, a flipped byte, an upload failing
in the middle (also in a writer thread of DCP's, and in a ``RecoverCallback`` run that then
resumes), a stop at each commit point, HF exports with ``max_keep`` and an interrupted upload,
setup errors (missing bucket, wrong credentials); what every store shares (throttling, the
lease, a second run refused) is in ``tests/test_objectstores.py``, for all three. Real processes: both callbacks in their default modes on one process, DDP and
FSDP2 (``tests/scripts/train_fsdp1.py``), SIGKILLed mid-epoch and run again with the same
command, compared bit for bit with an uninterrupted local run; a SIGKILL in the middle of an
upload, a flipped byte in rank 1's object, a PUT denied on rank 1 only
(``tests/scripts/train_recover.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import s3_client, s3_objects, s3_uploads

from areal_lightning import DCPCheckpointIO
from areal_lightning.errors import CheckpointCorruptError, CheckpointWriteError
from areal_lightning.layout import CHECKPOINT_INFO, parse_export_name
from areal_lightning.objectstore import StorageError
from tests.harness.losses import rank_losses, step_losses

SCRIPT = Path(__file__).parent / "scripts" / "train_recover.py"
REPO = Path(__file__).resolve().parents[1]
SMALL_PARTS = {"default_block_size": 5 << 20}
"""s3fs's smallest multipart part (S3's minimum): files above 5 MiB upload in several parts."""


def _state(seed: int = 0, numel: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"state_dict": {"w": torch.randn(numel, generator=g), "b": torch.randn(3, generator=g)},
            "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(numel, generator=g)}},
                                  "param_groups": [{"lr": 0.1, "params": [0]}]}],
            "global_step": seed}


def _assert_equal(got: dict, want: dict) -> None:
    for key in ("w", "b"):
        assert torch.equal(got["state_dict"][key], want["state_dict"][key])
    assert torch.equal(got["optimizer_states"][0]["state"][0]["exp_avg"],
                       want["optimizer_states"][0]["state"][0]["exp_avg"])
    assert got["global_step"] == want["global_step"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dcp_checkpoint_io_saves_generations_committed_by_a_marker(s3_server, s3_root, tmp_path, monkeypatch,
                                                                   mode) -> None:
    monkeypatch.chdir(tmp_path)
    io = DCPCheckpointIO(mode)
    path = f"{s3_root}/ckpt/last"
    try:
        io.save_checkpoint(_state(1), path)
        io.wait()
        first = s3_objects(s3_server, path)
        io.save_checkpoint(_state(2), path)  # the same path again: a new generation replaces the first
        io.wait()
        _assert_equal(io.load_checkpoint(path), _state(2))
        keys = s3_objects(s3_server, path)
        gens = {k.split("/")[-2] for k in keys}
        assert len(gens) == 1 and not set(first) & set(keys), "the replaced generation was not deleted"
        assert sorted(k.rsplit("/", 1)[1] for k in keys) == [".metadata", "COMMITTED.json", "__0_0.distcp",
                                                             "__0_1.distcp"]
        io.remove_checkpoint(path)
        assert s3_objects(s3_server, path) == []
        with pytest.raises(FileNotFoundError, match="holds no committed generation"):
            io.load_checkpoint(path)
    finally:
        io.teardown()
    assert list(tmp_path.iterdir()) == [], "a local folder named like the URI was written"


def test_a_generation_without_its_marker_does_not_exist(s3_server, s3_root) -> None:
    io = DCPCheckpointIO("sync")
    path = f"{s3_root}/ckpt"
    io.save_checkpoint(_state(1), path)
    io.save_checkpoint(_state(2), path)
    marker = [k for k in s3_objects(s3_server, path) if k.endswith("COMMITTED.json")][0]
    bucket = s3_root.split("/")[2]
    s3_client(s3_server).delete_object(Bucket=bucket, Key=marker)  # as if the commit never happened
    with pytest.raises(FileNotFoundError, match="no committed generation"):
        io.load_checkpoint(path)
    io.teardown()


def test_a_flipped_byte_in_an_object_is_caught_naming_the_object_and_the_key(s3_server, s3_root) -> None:
    io = DCPCheckpointIO("sync", thread_count=1)
    path = f"{s3_root}/ckpt"
    io.save_checkpoint(_state(3, numel=1024), path)
    bucket = s3_root.split("/")[2]
    client = s3_client(s3_server)
    key = [k for k in s3_objects(s3_server, path) if k.endswith("__0_0.distcp")][0]
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(CheckpointCorruptError, match=rf"s3://{bucket}/{key} fails its CRC32C check in '[^']+'"):
        io.load_checkpoint(path)
    io.teardown()


def test_an_exception_in_the_middle_of_an_upload_keeps_the_previous_checkpoint(s3_server, s3_root,
                                                                               monkeypatch) -> None:
    """A save that fails while a multipart upload is under way leaves no object and no
    incomplete upload (the upload is aborted, not completed with a truncated buffer), and the
    previous generation stays the checkpoint; the next commit removes the failed generation."""
    io = DCPCheckpointIO("sync", thread_count=1, storage_options=SMALL_PARTS)
    path = f"{s3_root}/ckpt"
    big = 3 << 20  # 12 MiB of fp32 weights: three parts
    io.save_checkpoint(_state(1, numel=big), path)
    before = s3_objects(s3_server, path)
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "objectstore.mid_upload:raise")
    with pytest.raises(CheckpointWriteError, match="InjectedFault"):
        io.save_checkpoint(_state(2, numel=big), path)
    monkeypatch.delenv("AREAL_LIGHTNING_FAULT")
    assert s3_uploads(s3_server, path) == []
    assert not [k for k in s3_objects(s3_server, path) if k not in before and k.endswith(".distcp")]
    _assert_equal(io.load_checkpoint(path), _state(1, numel=big))
    io.save_checkpoint(_state(4, numel=big), path)
    _assert_equal(io.load_checkpoint(path), _state(4, numel=big))
    assert len({k.split("/")[-2] for k in s3_objects(s3_server, path)}) == 1
    io.teardown()


def test_a_write_failing_in_a_writer_thread_fails_the_save(s3_server, s3_root, monkeypatch) -> None:
    """torch's DCP writer threads (``thread_count`` > 1) die on an exception without telling the
    save, which then returned the other files' items as if complete (a checkpoint missing a
    file's tensors). One big tensor puts the only multipart upload in the file DCP's spawned
    thread takes first; its upload fails there: every such save must fail, and none commits."""
    io = DCPCheckpointIO("sync", thread_count=2, storage_options=SMALL_PARTS)
    state = {"big": torch.randn(3 << 20), **{f"small{i}": torch.randn(8) for i in range(6)}}
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "objectstore.mid_upload:raise")
    for i in range(3):
        with pytest.raises(CheckpointWriteError, match="InjectedFault"):
            io.save_checkpoint(state, f"{s3_root}/ckpt{i}")
        assert not [k for k in s3_objects(s3_server, f"{s3_root}/ckpt{i}") if k.endswith("COMMITTED.json")]
    io.teardown()


class _Wide(__import__("lightning.pytorch", fromlist=["LightningModule"]).LightningModule):
    """12 MB of weights (36 MB per recover save: two files of four 5 MiB parts each)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1024, 3072)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).square().mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _fit_wide(root: str, steps: int, **recover_kwargs) -> _Wide:
    from conftest import make_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from areal_lightning import RecoverCallback

    recover = RecoverCallback(fileroot=root, experiment_name="e", trial_name="t", user="u", freq_steps=2,
                              io_mode="sync", storage_options=SMALL_PARTS, **recover_kwargs)
    module = _Wide()
    data = DataLoader(TensorDataset(torch.randn(32, 1024, generator=torch.Generator().manual_seed(1))), batch_size=4)
    make_trainer([recover], max_steps=steps).fit(module, data)
    return module


def test_an_upload_failing_mid_save_leaves_the_previous_generation_and_the_rerun_resumes_exactly(
        s3_server, s3_root, monkeypatch) -> None:
    """The step-4 save's upload fails after its first part (in whichever writer thread): the fit
    raises, no incomplete upload is left, step 2's generation stays the checkpoint, and the
    same run started again resumes from it with the uninterrupted run's losses."""
    from areal_lightning._fault import reset_fault_counts

    want = _fit_wide(f"{s3_root}/reference", 6).losses
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "objectstore.mid_upload:raise@3")  # step 2: hits 1, 2
    reset_fault_counts()
    with pytest.raises(CheckpointWriteError, match="InjectedFault"):
        _fit_wide(s3_root, 6)
    monkeypatch.delenv("AREAL_LIGHTNING_FAULT")
    trial = f"{s3_root}/checkpoints/u/e/t"
    assert s3_uploads(s3_server, trial) == []
    markers = [k for k in s3_objects(s3_server, trial) if k.endswith("COMMITTED.json")]
    assert len(markers) == 1 and "/recover_info/2-" in markers[0]
    resumed = _fit_wide(s3_root, 6)
    assert resumed.losses == want[2:]
    assert len({k.split("/")[-2] for k in s3_objects(s3_server, trial)}) == 1


# -- setup errors ---------------------------------------------------------------------------


def _fit_on(fileroot: str, tmp_path: Path, **kwargs) -> None:
    import lightning.pytorch as pl
    from conftest import LMModule, tiny_llama, token_loader

    from areal_lightning import RecoverCallback

    recover = RecoverCallback(fileroot=fileroot, experiment_name="e", trial_name="t", user="u", freq_steps=2,
                              **kwargs)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[recover],
                         default_root_dir=str(tmp_path))
    trainer.fit(LMModule(tiny_llama()), token_loader())


def test_a_missing_bucket_is_a_clear_error_before_training(s3_server, tmp_path) -> None:
    with pytest.raises(StorageError, match=r"rank 0: the setup check's write \(PUT\) of s3://no-such-bucket-x/.* "
                                           r"failed: the bucket 'no-such-bucket-x' does not exist \(areal-lightning "
                                           r"never creates buckets"):
        _fit_on("s3://no-such-bucket-x/root", tmp_path)
    assert "CreateBucket" not in str(s3_client(s3_server).list_buckets())  # nothing was created
    assert "no-such-bucket-x" not in [b["Name"] for b in s3_client(s3_server).list_buckets()["Buckets"]]


def test_wrong_credentials_are_a_clear_error_naming_the_bucket_and_no_secret(s3_auth_server, tmp_path) -> None:
    secret = "wrong-secret-value-1234"
    options = {"key": "AKIAWRONGKEY", "secret": secret, "endpoint_url": s3_auth_server["endpoint"]}
    with pytest.raises(StorageError) as raised:
        _fit_on(f"s3://{s3_auth_server['bucket']}/root", tmp_path, storage_options=options)
    text = str(raised.value)
    assert f"access to the bucket '{s3_auth_server['bucket']}' was denied" in text
    assert "write (PUT)" in text and secret not in text


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_hf_exports_on_s3_keep_the_newest_and_an_interrupted_one_never_counts(s3_server, s3_root, tmp_path,
                                                                               monkeypatch, capsys, tokenizer,
                                                                               mode) -> None:
    """Exports every 2 steps with ``max_keep=2``: the two newest are committed (marker last) and
    load after download; an export whose upload fails before its marker is invisible to
    ``download_export``, ``inspect`` and ``max_keep``, and is removed by the next export."""
    from conftest import LMModule, make_trainer, tiny_llama, token_loader
    from transformers import AutoModelForCausalLM

    from areal_lightning import HFSaverCallback, download_export
    from areal_lightning._fault import reset_fault_counts
    from areal_lightning.tools.inspect import inspect_path

    def saver() -> HFSaverCallback:
        return HFSaverCallback(fileroot=s3_root, experiment_name="e", trial_name="t", user="u", mode=mode,
                               freq_steps=2, max_keep=2, staging_dir=tmp_path / "staging")

    module = LMModule(tiny_llama(), tokenizer)
    make_trainer([saver()], max_steps=6).fit(module, token_loader())
    model_dir = f"{s3_root}/checkpoints/u/e/t/default"
    names = sorted({k.split("/")[-2] for k in s3_objects(s3_server, model_dir)})
    assert names == ["epoch0epochstep3globalstep3", "epoch0epochstep5globalstep5"]
    live = {k: v.clone() for k, v in module.model.state_dict().items()}
    loaded = AutoModelForCausalLM.from_pretrained(download_export(model_dir, tmp_path / "newest"))
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in live.items())
    assert not any((tmp_path / "staging").iterdir())  # staged folders are removed once uploaded

    # a new run exports steps 2, 4, 6, 8: the fourth (global step 7, a new folder) fails after its
    # files were uploaded, before its marker
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "objectstore.before_marker:raise@4")
    reset_fault_counts()
    with pytest.raises(Exception, match="InjectedFault|objectstore.before_marker"):
        make_trainer([saver()], max_steps=8).fit(LMModule(tiny_llama(), tokenizer), token_loader())
    monkeypatch.delenv("AREAL_LIGHTNING_FAULT")
    failed = f"{model_dir}/epoch0epochstep7globalstep7"
    assert any(k.endswith("config.json") for k in s3_objects(s3_server, failed)), "its files were uploaded"
    with pytest.raises(FileNotFoundError, match="not a committed HF export"):
        download_export(failed, tmp_path / "failed")
    report, = inspect_path(f"{s3_root}/checkpoints/u/e/t")
    assert failed in [item["path"] for item in report["leftovers"]]
    assert [e["name"] for e in report["exports"]] == ["epoch0epochstep3globalstep3", "epoch0epochstep5globalstep5"]
    assert report["valid"], report["errors"]
    make_trainer([saver()], max_steps=2).fit(LMModule(tiny_llama(), tokenizer), token_loader())  # one more export
    assert s3_objects(s3_server, failed) == [], "the uncommitted export was not removed after the next commit"
    names = sorted({k.split("/")[-2] for k in s3_objects(s3_server, model_dir)})
    assert names == ["epoch0epochstep3globalstep3", "epoch0epochstep5globalstep5"]  # max_keep=2 by global step
    assert s3_uploads(s3_server, model_dir) == []
    # the command line: inspect (a fileroot URI) and download
    from areal_lightning.tools.cli import main

    assert main(["inspect", s3_root, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == s3_root and [t["trial_name"] for t in doc["trials"]] == ["t"]
    assert main(["download", f"{model_dir}/epoch0epochstep5globalstep5", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "model.safetensors").is_file() and (tmp_path / "cli" / "config.json").is_file()
    assert main(["download", failed, str(tmp_path / "none")]) == 2


# -- real processes ---------------------------------------------------------------------------


def _train(root: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--losses", str(root / "losses.jsonl"),
                           *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


def _losses(root: Path) -> dict[int, set[str]]:
    return step_losses(root / "losses.jsonl")


LM_SCRIPT = Path(__file__).parent / "scripts" / "train_fsdp1.py"
LM_CASES = {
    # name: (ranks, args). A tiny Llama fine-tuned with validation every 5 steps, HFSaverCallback
    # (export every 4 steps) + RecoverCallback (every 3 steps) in their default modes (auto: async
    # on both), Lightning's launcher; one epoch (16 steps on one process, 8 on two ranks), killed at
    # the end of step 7 (step 6's async save waited for step 3's: at least that one is committed).
    # FSDP1 writes through the same object-store writer and reader as FSDP2's collective save;
    # its own state dicts are resumed from a local fileroot by tests/test_fsdp1.py.
    "1-process": (1, ("--strategy", "single", "--epochs", "1")),
    "ddp-2": (2, ("--strategy", "ddp", "--epochs", "1")),
    "fsdp2-2": (2, ("--strategy", "fsdp2", "--epochs", "1")),
}


def _train_lm(root: Path, *args: str) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(LM_SCRIPT), "--root", str(root), "--losses", str(root / "losses"),
                           *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ))


def _ok(proc: subprocess.CompletedProcess, root: Path) -> None:
    errors = "".join(p.read_text()[:3000] for p in root.glob("error.rank*.txt"))
    assert proc.returncode == 0, errors or proc.stderr[-4000:]


def _lm_losses(root: Path, ranks: int) -> dict[tuple[int, int], set[str]]:
    return rank_losses(root, ranks)


def sigkill_resume_on_store(root: str, objects: Any, reference: Path, tmp_path: Path, ranks: int,
                            args: tuple[str, ...]) -> str:
    """The train_fsdp1.py job with ``fileroot=root`` (an object store), SIGKILLed at the end of
    step 7 and run again: every rank's loss of every step equals the uninterrupted local run's
    in ``reference``; every committed HF export downloads, loads with ``from_pretrained`` /
    ``AutoTokenizer`` and equals the local run's export of that step byte for byte; ``inspect``
    reports the trial valid; one recover generation is left (``objects(uri)``: the keys under
    ``uri``); no local folder named like the URI. Returns the trial's URI."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_lightning import download_export
    from areal_lightning.tools.inspect import inspect_path

    run = tmp_path / "run"
    lease = ("--lock-lease-s", "2")  # the killed run's trial lease: the rerun takes it over 2 s after the kill
    assert _train_lm(run, "--fileroot", root, *lease, "--kill-at-step", "7", *args).returncode != 0
    resumed = _train_lm(run, "--fileroot", root, *lease, *args)
    _ok(resumed, run)
    trial = f"{root}/checkpoints/u/exp/t"
    assert f"RecoverCallback: resumed from {trial}/default/recover_checkpoint/" in resumed.stderr
    assert _lm_losses(run, ranks) == _lm_losses(reference, ranks)

    local = sorted((reference / "checkpoints/u/exp/t/default").glob("epoch*"), key=lambda p: parse_export_name(p.name))
    assert local
    report, = inspect_path(trial)
    assert report["valid"], report["errors"]
    assert [e["name"] for e in report["exports"]] == [p.name for p in local]
    assert report["recover"]["checkpoints"][0]["world_size"] == ranks
    for folder in local:
        got = download_export(f"{trial}/default/{folder.name}", tmp_path / "download" / folder.name)
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in folder.iterdir())
        for file in folder.iterdir():
            assert (got / file.name).read_bytes() == file.read_bytes(), (folder.name, file.name)
    newest = download_export(f"{trial}/default", tmp_path / "newest")  # a model folder: its newest export
    assert (newest / "model.safetensors").read_bytes() == (local[-1] / "model.safetensors").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(newest)
    assert AutoTokenizer.from_pretrained(newest)("1+2=3")["input_ids"]
    assert model.config.num_hidden_layers == 2
    keys = objects(f"{trial}/recover_info") + objects(f"{trial}/default/recover_checkpoint")
    assert len({k.split("/")[-2] for k in keys}) == 1, keys
    scheme = root.split("://")[0]
    assert not any(p.name.startswith(f"{scheme}:") for p in [*REPO.iterdir(), *run.iterdir()])
    return trial


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LM_CASES))
def test_both_callbacks_sigkill_then_the_same_command_resumes_bit_for_bit_from_the_bucket(
        s3_server, s3_root, tmp_path, case) -> None:
    """1 process, DDP, FSDP2 with fileroot=s3:// (:func:`sigkill_resume_on_store`); and no
    incomplete multipart upload is left."""
    ranks, args = LM_CASES[case]
    reference = tmp_path / "reference"
    _ok(_train_lm(reference, *args), reference)
    trial = sigkill_resume_on_store(s3_root, lambda uri: s3_objects(s3_server, uri), reference, tmp_path, ranks, args)
    assert s3_uploads(s3_server, trial) == []


@pytest.mark.slow
def test_a_sigkill_in_the_middle_of_an_upload_resumes_from_the_previous_generation(s3_server, s3_root,
                                                                                    tmp_path) -> None:
    """The run is SIGKILLed while a data file of the step-10 save is a multipart upload in
    progress: the rerun resumes from step 5's committed generation, bit for bit, and after its
    next commit neither the killed generation nor its incomplete upload is left."""
    args = ("--hidden", "200000", "--freq-steps", "5", "--epochs", "2", "--lock-lease-s", "2",
            "--storage-options", json.dumps(SMALL_PARTS))  # ~9 MB of weights, 24 MB per save: two files of three parts
    reference = tmp_path / "reference"
    reference.mkdir()
    assert _train(reference, *args).returncode == 0
    run = tmp_path / "run"
    run.mkdir()
    trial = f"{s3_root}/checkpoints/u/exp/t"
    killed = _train(run, "--fileroot", s3_root, *args, env={"AREAL_LIGHTNING_FAULT": "objectstore.mid_upload:kill@3"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert s3_uploads(s3_server, trial), "the kill did not leave an incomplete multipart upload"
    resumed = _train(run, "--fileroot", s3_root, *args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "after global step 4 (epoch 0, step 4 in epoch)" in resumed.stderr
    assert _losses(run) == _losses(reference)
    assert s3_uploads(s3_server, trial) == []
    assert len({k.split("/")[-2] for k in s3_objects(s3_server, trial)}) == 1


@pytest.mark.slow
def test_a_flipped_byte_in_rank_1s_object_is_caught_by_the_ranks_reading_it(s3_server, s3_root, tmp_path) -> None:
    """2-rank DDP: one byte of rank 1's data file flipped in the bucket; the rerun's resume
    fails on every rank, naming the object and the tensor key (no rank starts training)."""
    args = ("--devices", "2", "--io-mode", "sync", "--freq-steps", "5", "--fileroot", s3_root)
    first = _train(tmp_path, *args, "--epochs", "1")  # 6 steps on each rank: one recover checkpoint, step 5
    assert first.returncode == 0, first.stderr[-3000:]
    trial = f"{s3_root}/checkpoints/u/exp/t"
    (key,) = [k for k in s3_objects(s3_server, trial) if k.endswith("/__1_0.distcp")]
    bucket = s3_root.split("/")[2]
    client = s3_client(s3_server)
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    (tmp_path / "losses.jsonl.rank0").unlink()
    rerun = _train(tmp_path, *args, "--epochs", "2", timeout=240)
    assert rerun.returncode != 0
    assert re.search(rf"s3://{bucket}/{key} fails its CRC32C check in '[^']+'", rerun.stderr), rerun.stderr[-3000:]
    assert not (tmp_path / "losses.jsonl.rank0").exists(), "training started from a corrupt checkpoint"


@pytest.mark.slow
def test_a_put_denied_on_rank_1_only_is_an_error_on_every_rank(s3_auth_server, tmp_path) -> None:
    endpoint, bucket = s3_auth_server["endpoint"], s3_auth_server["bucket"]
    admin, no_put = s3_auth_server["admin"], s3_auth_server["no_put"]
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": admin["aws_access_key_id"],
           "AWS_SECRET_ACCESS_KEY": admin["aws_secret_access_key"],
           "RANK1_AWS_ACCESS_KEY_ID": no_put["aws_access_key_id"],
           "RANK1_AWS_SECRET_ACCESS_KEY": no_put["aws_secret_access_key"]}
    proc = _train(tmp_path, "--fileroot", f"s3://{bucket}/denied", "--devices", "2", env=env, timeout=240)
    assert proc.returncode != 0
    assert "RecoverCallback setup (object-store check) failed on rank 1" in proc.stderr
    assert f"access to the bucket '{bucket}' was denied" in proc.stderr
    assert not (tmp_path / "losses.jsonl.rank0").exists(), "training started"
    assert no_put["aws_secret_access_key"] not in proc.stderr and admin["aws_secret_access_key"] not in proc.stderr


def test_the_private_torch_fsspec_file_system_still_offers_what_the_object_store_writer_uses() -> None:
    """``write/objectstore_fs.py`` subclasses torch's private ``_fsspec_filesystem.FileSystem`` (what
    ``FsspecWriter``/``FsspecReader`` use) and sets a DCP writer's/reader's ``fs`` and ``path``
    as those classes do: a torch upgrade that changes either breaks this test first."""
    import inspect

    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter

    for method in ("create_stream", "concat_path", "init_path", "rename", "mkdir", "exists", "rm_file", "ls"):
        assert callable(getattr(FileSystem, method, None)), method
    assert issubclass(FsspecWriter, FileSystemWriter) and issubclass(FsspecReader, FileSystemReader)
    for cls in (FsspecWriter, FsspecReader):
        source = inspect.getsource(cls.__init__)
        assert "self.fs = FileSystem()" in source and "self.path = self.fs.init_path(path" in source


def test_trainer_save_checkpoint_takes_the_users_storage_options_with_recover_enabled(flaky_s3, s3_root,
                                                                                      tmp_path) -> None:
    """``trainer.save_checkpoint(uri, storage_options=...)`` through the Trainer's own
    ``DCPCheckpointIO`` while ``RecoverCallback`` saves beside it: the options of that one call
    are what the save uses (here the endpoint of a proxy in front of the server, which answers
    one of the save's PUTs with a throttling reply that the client retries), and the recover
    checkpoint is unaffected. The same call without options goes to the default endpoint."""
    import lightning.pytorch as pl
    from conftest import LMModule, tiny_llama, token_loader

    from areal_lightning import RecoverCallback

    recover = RecoverCallback(fileroot=tmp_path / "ckpt", experiment_name="e", trial_name="t", user="u",
                              freq_steps=1, io_mode="sync")
    io = DCPCheckpointIO("sync", thread_count=1)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[recover], plugins=[io],
                         default_root_dir=str(tmp_path))
    module = LMModule(tiny_llama())
    trainer.fit(module, token_loader())
    flaky_s3.when = lambda method, path: method == "PUT" and "user-saves" in path
    flaky_s3.fail = 1
    trainer.save_checkpoint(f"{s3_root}/user-saves/plain")
    assert flaky_s3.failed == 0  # not through the proxy
    uri = f"{s3_root}/user-saves/last"
    trainer.save_checkpoint(uri, storage_options={"endpoint_url": flaky_s3.url})
    assert flaky_s3.failed == 1  # through the proxy: the endpoint of this call's options
    for path in (uri, f"{s3_root}/user-saves/plain"):
        loaded = DCPCheckpointIO("sync").load_checkpoint(path)
        assert loaded["global_step"] == 2
        for key, value in module.state_dict().items():
            assert torch.equal(loaded["state_dict"][key], value), key
    assert recover.store.read_info()[CHECKPOINT_INFO]["global_step"] == 2


# -- the trial lock on a bucket (a lease) ------------------------------------------------------
