"""``gs://`` and ``az://`` roots against real servers, as ``tests/test_objectstore.py`` tests
``s3://`` against moto: fake-gcs-server and Azurite (processes on 127.0.0.1, started by the
session fixtures ``gs_server`` / ``az_server`` of ``conftest.py``; see ``tests/harness/stores.py``).

In-process: generations committed by the store's own conditional create (GCS
``ifGenerationMatch=0``, Azure ``If-None-Match: *``), an upload failing in the middle, a stop at
each commit point, the trial lock's lease (also s3), the store's own "busy" 503 retried and counted
in telemetry and a marker created before its reply was lost (also s3; a proxy in front of the
server), a missing bucket / container and a wrong Azure key
(clear errors before training, no secret), ``convert`` of a trial on each of the three stores
(equal to ``convert`` of the downloaded checkpoint). Real processes: both callbacks on their
defaults, SIGKILL mid-epoch, the same command, every rank's losses bit for bit and every HF
export downloaded byte-equal and loadable (1 process and 2-rank DDP on both stores, FSDP2 on
Azure); a SIGKILL in the middle of an upload; ``areal-lightning run --retries`` after a SIGKILL;
a second run of a live trial refused and a killed run's rerun taking over (also s3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from areal_lightning import DCPCheckpointIO
from areal_lightning.errors import CheckpointWriteError
from areal_lightning.objectstore import write_exclusive
from tests.harness.losses import step_losses
from tests.harness.refcache import shared
from tests.harness.stores import SMALL_PARTS
from test_objectstore import LM_SCRIPT, _ok, _train_lm, sigkill_resume_on_store

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "train_recover.py"


def _state(seed: int = 0, numel: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"state_dict": {"w": torch.randn(numel, generator=g)},
            "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(numel, generator=g)}},
                                  "param_groups": [{"lr": 0.1, "params": [0]}]}], "global_step": seed}


def _equal(got: dict, want: dict) -> bool:
    return (torch.equal(got["state_dict"]["w"], want["state_dict"]["w"]) and got["global_step"] == want["global_step"]
            and torch.equal(got["optimizer_states"][0]["state"][0]["exp_avg"],
                            want["optimizer_states"][0]["state"][0]["exp_avg"]))


def _generations(store, uri: str) -> set[str]:
    return {key.split("/")[-2] for key in store.objects(uri)}


def test_generations_are_committed_by_the_stores_own_conditional_create(store) -> None:
    root = store.new_root()
    marker = f"{root}/marker"
    write_exclusive(marker, b"first")
    with pytest.raises(FileExistsError):  # the store refused the second create: not overwritten
        write_exclusive(marker, b"second")
    assert store.read(marker.split("://", 1)[1]) == b"first"

    io = DCPCheckpointIO("sync")
    path = f"{root}/ckpt"
    try:
        io.save_checkpoint(_state(1), path)
        first = store.objects(path)
        io.save_checkpoint(_state(2), path)  # a new generation replaces the first
        assert _equal(io.load_checkpoint(path), _state(2))
        keys = store.objects(path)
        assert len(_generations(store, path)) == 1 and not set(first) & set(keys)
        assert sorted(k.rsplit("/", 1)[1] for k in keys) == [".metadata", "COMMITTED.json", "__0_0.distcp",
                                                             "__0_1.distcp"]
        store.delete(next(k for k in keys if k.endswith("COMMITTED.json")))  # as if never committed
        with pytest.raises(FileNotFoundError, match="no committed generation"):
            io.load_checkpoint(path)
    finally:
        io.teardown()


def test_an_exception_in_the_middle_of_an_upload_keeps_the_previous_checkpoint(store, monkeypatch) -> None:
    """The upload of a 12 MiB data file fails after its first 5 MiB part (a GCS resumable upload
    cancelled, Azure blocks never committed): no object of it appears, the previous generation
    stays the checkpoint, and the next save commits and removes the failed generation."""
    root = store.new_root()
    io = DCPCheckpointIO("sync", thread_count=1, storage_options=SMALL_PARTS[store.scheme])
    path = f"{root}/ckpt"
    big = 3 << 20
    io.save_checkpoint(_state(1, numel=big), path)
    before = store.objects(path)
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "objectstore.mid_upload:raise")
    with pytest.raises(CheckpointWriteError, match="InjectedFault"):
        io.save_checkpoint(_state(2, numel=big), path)
    monkeypatch.delenv("AREAL_LIGHTNING_FAULT")
    assert not [k for k in store.objects(path) if k not in before and k.endswith(".distcp")]
    assert _equal(io.load_checkpoint(path), _state(1, numel=big))
    io.save_checkpoint(_state(4, numel=big), path)
    assert _equal(io.load_checkpoint(path), _state(4, numel=big))
    assert len(_generations(store, path)) == 1
    io.teardown()


@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
@pytest.mark.parametrize("point", ["objectstore.before_marker", "objectstore.after_marker",
                                   "objectstore.marker_deleted"])
def test_a_crash_at_each_commit_point_leaves_one_committed_generation_to_resume(request, monkeypatch, tokenizer,
                                                                                point, scheme) -> None:
    """The commit of the second recover save stops at ``point`` (before its marker, right after
    it, after the older marker was deleted), on each of the three stores: the newest committed
    generation loads (the old one, or the new one), and the next run's commit leaves exactly one."""
    from conftest import LMModule, make_trainer, tiny_llama, token_loader

    from areal_lightning import RecoverCallback
    from areal_lightning._fault import reset_fault_counts
    from tests.harness.stores import Store

    request.getfixturevalue(f"{scheme}_server")
    store = Store(scheme)
    root = store.new_root()

    def fit(steps: int) -> RecoverCallback:
        recover = RecoverCallback(fileroot=root, experiment_name="e", trial_name="t", user="u", freq_steps=2,
                                  io_mode="sync")
        make_trainer([recover], max_steps=steps).fit(LMModule(tiny_llama(), tokenizer), token_loader())
        return recover

    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", f"{point}:raise@2")
    reset_fault_counts()
    with pytest.raises(Exception, match="InjectedFault"):
        fit(6)
    monkeypatch.delenv("AREAL_LIGHTNING_FAULT")
    newest = fit(8).resumed_from  # the newest committed generation, then steps 6 and 8 committed
    assert newest is not None and newest.global_step == (1 if point == "objectstore.before_marker" else 3)
    assert len(_generations(store, f"{root}/checkpoints/u/e/t")) == 1


@pytest.fixture
def flaky(every_store) -> Any:
    """``(store, proxy)`` for each of the three stores: its :class:`~tests.harness.stores.Store`
    and a :class:`~tests.harness.stores.FlakyProxy` in front of its server."""
    from tests.harness.stores import FlakyProxy, upstream_of

    proxy = FlakyProxy(upstream_of(every_store), every_store.scheme)
    try:
        yield every_store, proxy
    finally:
        proxy.close()


def test_a_conditional_create_the_store_did_before_its_reply_was_lost_is_not_refused_on_retry(flaky) -> None:
    """The store creates the marker but its reply is lost (a 503 in its place): the client's
    retry of the create is refused (the object exists), and :func:`write_exclusive` tells its
    own object (the same bytes) from another writer's, which stays refused."""
    store, proxy = flaky
    root = store.new_root()
    proxy.when = lambda method, path: method in ("PUT", "POST") and "marker" in path
    proxy.fail, proxy.applied = 1, True
    write_exclusive(f"{root}/marker", b"mine", proxy.options())
    assert proxy.failed == 1 and store.read(f"{root}/marker".split("://", 1)[1]) == b"mine"
    with pytest.raises(FileExistsError):  # someone else's bytes: still refused
        write_exclusive(f"{root}/marker", b"other", proxy.options())
    assert store.read(f"{root}/marker".split("://", 1)[1]) == b"mine"


def test_throttled_requests_are_retried_and_counted_in_telemetry(flaky, tmp_path, tokenizer) -> None:
    """The store answers its own "busy" 503 to the upload of a data file and to the commit
    marker's create (a proxy in front of the server): the saves retry with backoff and commit,
    the resume continues from them, and ``checkpoint/recover/retries`` counts the retried
    requests (each store's client: botocore, gcsfs, the Azure SDK)."""
    import csv

    import lightning.pytorch as pl
    from conftest import LMModule, make_trainer, tiny_llama, token_loader

    from areal_lightning import RecoverCallback
    from areal_lightning.objectstore import retries

    store, proxy = flaky
    root = store.new_root()
    failures = 1 if store.scheme == "az" else 3  # the Azure SDK backs off 15-21 s before its first retry
    proxy.when = lambda method, path: method in ("PUT", "POST") and ("COMMITTED.json" in path or "__0_0.distcp" in path)
    proxy.fail = failures
    before = retries()

    def run(steps: int) -> LMModule:
        recover = RecoverCallback(fileroot=root, experiment_name="e", trial_name="t", user="u", freq_steps=2,
                                  io_mode="sync", storage_options=proxy.options())
        logger = pl.loggers.CSVLogger(str(tmp_path / "logs"), name="run", version=0)
        module = LMModule(tiny_llama(), tokenizer)
        make_trainer([recover], max_steps=steps, logger=logger, log_every_n_steps=1).fit(module, token_loader())
        return module

    run(4)
    assert proxy.failed == failures and retries() - before >= failures
    rows = list(csv.DictReader(open(tmp_path / "logs" / "run" / "version_0" / "metrics.csv")))
    logged = [float(r["checkpoint/recover/retries"]) for r in rows if r.get("checkpoint/recover/retries")]
    assert logged and max(logged) - before >= failures
    resumed = run(6)  # continues after step 4 from the committed generation
    assert len(resumed.losses) == 2


def test_the_lease_refuses_a_live_holder_and_takes_over_a_silent_one(every_store) -> None:
    """The trial lock on each store: a second lease refused once it sees the first renewed,
    taken at once after a normal release, taken over once a silent holder's lease (its process
    killed or paused, nothing deleted) expired; that holder learns it lost the trial."""
    from areal_lightning.commit.lease import ObjectLease
    from areal_lightning.errors import TrialLockedError

    store = every_store
    trial = f"{store.new_root()}/trial"
    first = ObjectLease(trial, None, 1.5)
    first.acquire()
    with pytest.raises(TrialLockedError, match=r"being trained by another run \(.* pid \d+"):
        ObjectLease(trial, None, 1.5).acquire()
    first.release()
    second = ObjectLease(trial, None, 1.5)
    second.acquire()  # released: no wait
    second._stop.set()  # its process stops renewing
    second._thread.join()
    third = ObjectLease(trial, None, 1.5)
    third.acquire()  # waits until second's lease expired, then takes over
    assert third.number == second.number + 1
    assert len(store.objects(f"{trial}/.lease")) == 1  # the older leases are deleted
    second.check()  # nothing known yet
    assert second.renew() is False  # a paused holder comes back: it lost the trial
    with pytest.raises(TrialLockedError, match="taken over by .* pid"):
        second.check()
    third.release()
    assert store.objects(f"{trial}/.lease") == []


@pytest.mark.slow
def test_a_second_run_of_a_trial_is_refused_and_a_killed_runs_rerun_takes_over(every_store, tmp_path,
                                                                               tmp_path_factory) -> None:
    """Real processes on each store, a 3 s lease: a run training the trial (slow steps) and the
    same command started beside it: the second stops before training with the lock error naming
    the first; the first finishes. Then a run SIGKILLed at step 5 and its rerun at once: it
    waits for the dead run's lease to expire, takes over, and resumes bit for bit."""
    import time

    root = every_store.new_root()
    args = ("--fileroot", root, "--lock-lease-s", "3", "--freq-steps", "3", "--epochs", "1")
    reference = _reference(tmp_path_factory, SCRIPT, "--freq-steps", "3", "--epochs", "1")
    first_root, second_root = tmp_path / "first", tmp_path / "second"
    first_root.mkdir()
    second_root.mkdir()
    first = subprocess.Popen([sys.executable, str(SCRIPT), "--root", str(first_root), "--losses",
                              str(first_root / "losses.jsonl"), *args, "--step-sleep", "0.5"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + 120
    while not (first_root / "losses.jsonl").exists():  # it holds the trial and trains
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    second = _train(second_root, *args)
    assert second.returncode != 0 and "TrialLockedError" in second.stderr, second.stderr[-3000:]
    assert "being trained by another run" in second.stderr
    assert not (second_root / "losses.jsonl").exists()  # refused before training
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]

    run = tmp_path / "run"
    run.mkdir()
    again = ("--fileroot", f"{root}/again", *args[2:])
    assert _train(run, *again, "--kill-at-step", "5").returncode == -9
    rerun = _train(run, *again)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "waiting up to" in rerun.stderr and "took over the expired lease" in rerun.stderr, rerun.stderr[-3000:]
    assert step_losses(run / "losses.jsonl") == step_losses(reference / "losses.jsonl")


# -- real processes ---------------------------------------------------------------------------

LM_CASES = {  # as tests/test_objectstore.py's s3 cases: (ranks, args)
    "gs-1-process": (1, ("--strategy", "single", "--epochs", "1")),
    "gs-ddp-2": (2, ("--strategy", "ddp", "--epochs", "1")),
    "az-1-process": (1, ("--strategy", "single", "--epochs", "1")),
    "az-ddp-2": (2, ("--strategy", "ddp", "--epochs", "1")),
    "az-fsdp2-2": (2, ("--strategy", "fsdp2", "--epochs", "1")),
}


def _reference(tmp_path_factory, script: Path, *args: str) -> Path:
    """The uninterrupted local run of ``script args`` (shared by the tests and workers of this
    pytest run, whatever object-store server environment they have)."""
    def produce(root: Path) -> None:
        if script == LM_SCRIPT:
            _ok(_train_lm(root, *args), root)
        else:
            proc = _train(root, *args)
            assert proc.returncode == 0, proc.stderr[-3000:]

    folder, _ = shared(tmp_path_factory, {"reference": script.name, "args": args}, produce)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LM_CASES))
def test_both_callbacks_sigkill_then_the_same_command_resumes_bit_for_bit_from_the_store(
        request, tmp_path, tmp_path_factory, case) -> None:
    """Both callbacks in their default modes, ``fileroot`` on the store, SIGKILLed at step 7 and
    run again (``tests/test_objectstore.py``'s :func:`sigkill_resume_on_store`): bit for bit,
    every export byte-equal and loadable, the trial valid, one generation left."""
    store = request.getfixturevalue(f"{case.split('-')[0]}_server")
    ranks, args = LM_CASES[case]
    reference = _reference(tmp_path_factory, LM_SCRIPT, *args)
    sigkill_resume_on_store(store.new_root(), lambda uri: [f"{store.scheme}://{k}" for k in store.objects(uri)],
                            reference, tmp_path, ranks, args)


def _train(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    root.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), "--losses", str(root / "losses.jsonl"),
                           *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_a_sigkill_in_the_middle_of_an_upload_resumes_from_the_previous_generation(store, tmp_path,
                                                                                    tmp_path_factory) -> None:
    """SIGKILL while a data file of the step-10 save is being uploaded in parts (a GCS resumable
    upload, Azure blocks not committed): the rerun resumes from step 5's generation, bit for bit,
    and after its next commit only one generation is left."""
    args = ("--hidden", "200000", "--freq-steps", "5", "--epochs", "2")  # ~9 MB of weights: files of several parts
    reference = _reference(tmp_path_factory, SCRIPT, *args)
    root = store.new_root()
    options = ("--storage-options", json.dumps(SMALL_PARTS[store.scheme]), "--lock-lease-s", "2")
    run = tmp_path / "run"
    killed = _train(run, "--fileroot", root, *args, *options, env={"AREAL_LIGHTNING_FAULT": "objectstore.mid_upload:kill@3"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _train(run, "--fileroot", root, *args, *options)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "after global step 4 (epoch 0, step 4 in epoch)" in resumed.stderr
    assert step_losses(run / "losses.jsonl") == step_losses(reference / "losses.jsonl")
    assert len(_generations(store, f"{root}/checkpoints/u/exp/t/default/recover_checkpoint")) == 1


# -- the tools on a URI ------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["s3", "gs", "az"])
def test_convert_reads_a_trial_on_the_store_in_place_and_equals_convert_of_the_downloaded_checkpoint(
        request, tmp_path, tokenizer, scheme) -> None:
    """``convert URI`` (a trial on the store) writes, for each target, the same bytes as
    ``convert`` of its newest recover checkpoint downloaded first (``--to hf`` taking the config
    and tokenizer of the trial's newest export, which ``download_export`` fetches for the local
    one); ``inspect`` and ``download`` take the URI too."""
    from conftest import LMModule, make_trainer, tiny_llama, token_loader

    from areal_lightning import HFSaverCallback, RecoverCallback, download_export
    from areal_lightning.tools.convert import convert
    from areal_lightning.tools.inspect import inspect_path
    from tests.harness.stores import Store

    request.getfixturevalue(f"{scheme}_server")
    store = Store(scheme)
    root = store.new_root()
    where = dict(fileroot=root, experiment_name="e", trial_name="t", user="u")
    callbacks = [HFSaverCallback(**where, freq_steps=4, mode="sync"), RecoverCallback(**where, freq_steps=4,
                                                                                       io_mode="sync")]
    make_trainer(callbacks, max_steps=8).fit(LMModule(tiny_llama(), tokenizer), token_loader())
    trial = f"{root}/checkpoints/u/e/t"
    report, = inspect_path(trial)
    assert report["valid"], report["errors"]

    fs = store.fs()
    gens = sorted({k.split("/")[-2] for k in store.objects(f"{trial}/default/recover_checkpoint")})
    assert len(gens) == 1
    local = tmp_path / "download" / "recover_checkpoint"
    fs.get(f"{trial}/default/recover_checkpoint/{gens[0]}".split("://", 1)[1], str(local), recursive=True)
    export = download_export(f"{trial}/default", tmp_path / "download" / "export")

    for to, out in (("lightning", "model.ckpt"), ("dcp", "dcp"), ("hf", "hf")):
        remote = convert(trial, to, tmp_path / "from_uri" / out)
        downloaded = convert(local, to, tmp_path / "from_download" / out, hf_config=export if to == "hf" else None)
        files = sorted(p.relative_to(remote) for p in remote.rglob("*") if p.is_file()) if remote.is_dir() else [Path()]
        assert files == (sorted(p.relative_to(downloaded) for p in downloaded.rglob("*") if p.is_file())
                         if downloaded.is_dir() else [Path()])
        for rel in files:
            assert (remote / rel).read_bytes() == (downloaded / rel).read_bytes(), (to, rel)
    assert (tmp_path / "from_uri" / "hf" / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_run_with_retries_resumes_a_killed_run_from_the_store(store, tmp_path, tmp_path_factory) -> None:
    """``areal-lightning run --retries 1 -- <training command on the store>``: the first attempt
    is SIGKILLed at step 5; the second takes over its expired trial lease and resumes from the
    store, bit for bit."""
    args = ("--freq-steps", "3", "--epochs", "1")
    reference = _reference(tmp_path_factory, SCRIPT, *args)
    root = store.new_root()
    run = tmp_path / "run"
    run.mkdir()
    command = [sys.executable, str(SCRIPT), "--root", str(run), "--losses", str(run / "losses.jsonl"), *args,
               "--fileroot", root, "--lock-lease-s", "2"]
    job = tmp_path / "job.py"  # the first attempt is killed at step 5, the second runs the same command
    job.write_text("import os, subprocess, sys\n"
                   "kill = ['--kill-at-step', '5'] if os.environ['AREAL_LIGHTNING_ATTEMPT'] == '1' else []\n"
                   f"rc = subprocess.call([*{command!r}, *kill])\n"
                   "os.kill(os.getpid(), -rc) if rc < 0 else sys.exit(rc)\n")  # killed as its child was
    proc = subprocess.run([sys.executable, "-m", "areal_lightning", "run", "--retries", "1", "--", sys.executable,
                           str(job)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "attempt 1/2 failed (killed by SIGKILL)" in proc.stderr, proc.stderr[-3000:]
    assert "took over the expired lease" in proc.stderr and "RecoverCallback: resumed from" in proc.stderr
    assert step_losses(run / "losses.jsonl") == step_losses(reference / "losses.jsonl")


# -- setup errors -----------------------------------------------------------------------------


def _fit_on(fileroot: str, tmp_path: Path, **kwargs) -> None:
    from conftest import LMModule, make_trainer, tiny_llama, token_loader

    from areal_lightning import RecoverCallback

    recover = RecoverCallback(fileroot=fileroot, experiment_name="e", trial_name="t", user="u", freq_steps=2, **kwargs)
    make_trainer([recover], max_steps=2, default_root_dir=str(tmp_path)).fit(LMModule(tiny_llama()), token_loader())


def test_a_missing_bucket_or_container_is_a_clear_error_before_training(store, tmp_path) -> None:
    from areal_lightning.objectstore import StorageError

    kind = "container" if store.scheme == "az" else "bucket"
    with pytest.raises(StorageError, match=rf"rank 0: the setup check's write \(PUT\) of {store.scheme}://no-such-"
                                           rf"bucket-x/.* failed: the {kind} 'no-such-bucket-x' does not exist "
                                           rf"\(areal-lightning never creates {kind}s: create it first\)"):
        _fit_on(f"{store.scheme}://no-such-bucket-x/root", tmp_path)
    assert not list(tmp_path.rglob("*.distcp"))


def test_a_wrong_azure_key_is_a_clear_error_naming_the_container_and_no_secret(az_server, tmp_path) -> None:
    import base64

    from areal_lightning.objectstore import StorageError
    from tests.harness.stores import AZURITE_KEY

    root = az_server.new_root()
    wrong = base64.b64encode(b"not the account key of this storage account....").decode()
    connection = az_server.env["AZURE_STORAGE_CONNECTION_STRING"].replace(AZURITE_KEY, wrong)
    with pytest.raises(StorageError) as raised:
        _fit_on(root, tmp_path, storage_options={"connection_string": connection})
    text = str(raised.value)
    assert f"access to the container '{root.split('/')[2]}' was denied" in text, text
    assert wrong not in text and AZURITE_KEY not in text and "AccountKey" not in text
