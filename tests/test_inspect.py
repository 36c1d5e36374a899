"""``areal-lightning inspect`` on real trial folders written by short real training runs.

One module-scoped fileroot holds two trials trained with HFSaverCallback + RecoverCallback
(one with sharded exports); each test corrupts its own copy.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from areal_lightning import HFSaverCallback, RecoverCallback
from areal_lightning.layout import TrialLayout
from areal_lightning.tools.cli import main
from areal_lightning.tools.inspect import inspect_path, inspect_trial
from tests.conftest import LMModule, make_trainer, tiny_llama, token_loader
from tests.harness.refcache import environment_key, shared

REPO = Path(__file__).resolve().parents[1]
USER, EXP = "alice", "exp"


def _train(fileroot: Path, trial: str, tokenizer: Any, **saver_kwargs: Any) -> None:
    """8 steps in one epoch: exports after global steps 3 and 7, recover checkpoints after 3, 6, 8 steps."""
    saver = HFSaverCallback(fileroot=fileroot, experiment_name=EXP, trial_name=trial, user=USER,
                            freq_steps=4, mode="sync", **saver_kwargs)
    recover = RecoverCallback(fileroot=fileroot, experiment_name=EXP, trial_name=trial, user=USER,
                              freq_steps=3, io_mode="sync")
    make_trainer([saver, recover], max_epochs=1).fit(LMModule(tiny_llama(), tokenizer), token_loader())


def _build(root: Path) -> None:
    from areal_lightning.tools.demo import build_tokenizer

    tok = build_tokenizer()
    _train(root, "sharded", tok, max_shard_size=40_000)  # the tiny Llama is ~80 KB: 2+ shards
    _train(root, "plain", tok)


@pytest.fixture(scope="module")
def built_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two trained trials (once per suite run, shared by the workers: tests/harness/refcache.py)."""
    return shared(tmp_path_factory, {"inspect_built_root": 1, "env": environment_key()}, _build)[0]


@pytest.fixture
def root(built_root: Path, tmp_path: Path) -> Path:
    """A private copy of the built fileroot, free to corrupt."""
    dst = tmp_path / "root"
    shutil.copytree(built_root, dst, symlinks=True)
    return dst


def trial_dir(root: Path, trial: str) -> Path:
    return TrialLayout(root, USER, EXP, trial).trial_dir


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["inspect", *args])
    return rc, out.getvalue(), err.getvalue()


def cli_json(*args: str) -> tuple[int, dict[str, Any]]:
    rc, out, _ = cli(*args, "--json")
    return rc, json.loads(out)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path below ``root`` with its size and mtime (to prove inspect writes nothing)."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


# -- valid trials ------------------------------------------------------------------------------


def test_valid_fileroot_json_reports_every_trial(root: Path) -> None:
    rc, doc = cli_json(str(root), "--verify")
    assert rc == 0 and doc["valid"] and doc["verified"]
    by_name = {t["trial_name"]: t for t in doc["trials"]}
    assert sorted(by_name) == ["plain", "sharded"]
    for name, t in by_name.items():
        assert t["valid"] and not t["errors"] and not t["warnings"], t
        assert (t["user"], t["experiment_name"]) == (USER, EXP)
        exports = [(e["epoch"], e["epoch_step"], e["global_step"]) for e in t["exports"]]
        assert exports == [(0, 3, 3), (0, 7, 7)]
        for e in t["exports"]:
            assert e["complete"] and e["model"] == "default" and e["has_tokenizer"]
            assert e["size_bytes"] == sum(p.stat().st_size for p in Path(e["path"]).iterdir())
            assert 0 <= e["age_s"] < 3600
        (ckpt,) = t["recover"]["checkpoints"]
        assert ckpt["checksum"] == "ok" and ckpt["valid"]
        assert (ckpt["global_step"], ckpt["steps_done"], ckpt["epoch"], ckpt["epoch_step"]) == (7, 8, 0, 7)
        assert ckpt["world_size"] == 1 and ckpt["strategy"] == "SingleDeviceStrategy"
        assert ckpt["size_bytes"] == sum(p.stat().st_size for p in Path(ckpt["path"]).iterdir())
        assert t["recover_info"]["consistent"] is True
        assert set(t["recover_info"]["files"].values()) == {"ok"}
    assert len(by_name["sharded"]["exports"][0]["weight_files"]) >= 2
    assert by_name["plain"]["exports"][0]["weight_files"] == ["model.safetensors"]


def test_valid_table_without_verify(root: Path) -> None:
    rc, out, err = cli(str(trial_dir(root, "plain")))
    assert rc == 0, out + err
    for text in ("trial alice/exp/plain", "VALID", "epoch0epochstep3globalstep3", "epoch0epochstep7globalstep7",
                 "SingleDeviceStrategy", "not verified", "checkpoint_info", "1 trial(s), 0 invalid"):
        assert text in out, (text, out)
    assert "sharded" not in out


def test_filters_and_usage_errors(root: Path, tmp_path: Path) -> None:
    rc, doc = cli_json(str(root), "--trial", "sharded")
    assert rc == 0 and [t["trial_name"] for t in doc["trials"]] == ["sharded"]
    rc, doc = cli_json(str(root / "checkpoints" / USER / EXP))  # an experiment folder
    assert rc == 0 and len(doc["trials"]) == 2
    assert cli(str(root), "--user", "bob")[0] == 2
    rc, _, err = cli(str(tmp_path / "missing"))
    assert rc == 2 and "does not exist" in err
    (tmp_path / "plain_dir").mkdir()
    rc, _, err = cli(str(tmp_path / "plain_dir"))
    assert rc == 2 and "neither a fileroot" in err


def test_cli_subprocess(root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "areal_lightning", "inspect"]
    ok = subprocess.run([*cmd, str(trial_dir(root, "sharded")), "--verify", "--json"], capture_output=True,
                        text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    (t,) = json.loads(ok.stdout)["trials"]
    assert t["recover"]["checkpoints"][0]["checksum"] == "ok"
    (trial_dir(root, "sharded") / "default" / "recover_checkpoint" / ".metadata").unlink()
    bad = subprocess.run([*cmd, str(root)], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert ".metadata is missing" in bad.stdout and "INVALID" in bad.stdout


# -- corrupt / partial trials ------------------------------------------------------------------


def test_flipped_byte_in_shard_found_by_verify(root: Path) -> None:
    shard = trial_dir(root, "plain") / "default" / "recover_checkpoint" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = snapshot(root)
    # without --verify only presence and sizes are checked: the flip is invisible, and says so
    rc, doc = cli_json(str(root))
    assert rc == 0 and doc["trials"][0]["recover"]["checkpoints"][0]["checksum"] == "not verified"
    rc, out, _ = cli(str(root), "--verify")
    assert rc == 1
    assert "__0_0.distcp" in out and "fails its CRC32C check in" in out and "INVALID" in out
    rc, doc = cli_json(str(root), "--verify")
    plain = next(t for t in doc["trials"] if t["trial_name"] == "plain")
    sharded = next(t for t in doc["trials"] if t["trial_name"] == "sharded")
    ckpt = plain["recover"]["checkpoints"][0]
    assert rc == 1 and not plain["valid"] and sharded["valid"]
    assert ckpt["checksum"] == "corrupt" and str(shard) in ckpt["problems"][0]
    assert snapshot(root) == before  # read-only, even on a broken trial with --verify


def test_truncated_shard_found_without_verify(root: Path) -> None:
    shard = sorted((trial_dir(root, "plain") / "default" / "recover_checkpoint").glob("__0_*.distcp"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    rc, doc = cli_json(str(trial_dir(root, "plain")))
    (t,) = doc["trials"]
    assert rc == 1 and t["recover"]["checkpoints"][0]["checksum"] == "broken"
    assert shard.name in t["errors"][0] and "truncated" in t["errors"][0]


def test_missing_safetensors_and_shard_make_exports_incomplete(root: Path) -> None:
    export = trial_dir(root, "plain") / "default" / "epoch0epochstep7globalstep7"
    (export / "model.safetensors").unlink()
    sharded = trial_dir(root, "sharded") / "default" / "epoch0epochstep3globalstep3"
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    rc, out, _ = cli(str(root))
    assert rc == 1 and "NO" in out and "2 trial(s), 2 invalid" in out
    rc, doc = cli_json(str(root))
    by_name = {t["trial_name"]: t for t in doc["trials"]}
    plain = {e["name"]: e for e in by_name["plain"]["exports"]}
    assert plain["epoch0epochstep3globalstep3"]["complete"]
    assert not plain["epoch0epochstep7globalstep7"]["complete"]
    assert "no model.safetensors" in plain["epoch0epochstep7globalstep7"]["problems"][0]
    broken = next(e for e in by_name["sharded"]["exports"] if e["name"] == sharded.name)
    assert not broken["complete"] and str(shard) in broken["problems"][0]
    assert "model.safetensors.index.json" in broken["problems"][0]
    # the recover checkpoints are untouched and still valid
    assert all(t["recover"]["checkpoints"][0]["valid"] for t in by_name.values())


def test_truncated_safetensors_detected_from_header(root: Path) -> None:
    weights = trial_dir(root, "plain") / "default" / "epoch0epochstep3globalstep3" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 1)
    t = inspect_trial(trial_dir(root, "plain"))
    assert not t["valid"]
    assert any(str(weights) in e and "truncated" in e for e in t["errors"]), t["errors"]


def test_leftover_tmp_folders_are_warnings(root: Path) -> None:
    tdir = trial_dir(root, "plain")
    # what a SIGKILL mid-export leaves: a partial copy under a hidden temporary name
    leftover = tdir / "default" / ".tmp-epoch0epochstep9globalstep9-0123456789ab"
    shutil.copytree(tdir / "default" / "epoch0epochstep7globalstep7", leftover)
    (leftover / "model.safetensors").unlink()
    (tdir / ".old-recover_info-5-deadbeef").mkdir()
    rc, doc = cli_json(str(tdir))
    (t,) = doc["trials"]
    assert rc == 0 and t["valid"]
    assert sorted(item["kind"] for item in t["leftovers"]) == ["old", "tmp"]
    assert len(t["warnings"]) == 2 and all("leftover" in w for w in t["warnings"])
    assert [e["name"] for e in t["exports"]] == ["epoch0epochstep3globalstep3", "epoch0epochstep7globalstep7"]
    rc, out, _ = cli(str(tdir))
    assert rc == 0 and "warning: leftover tmp folder" in out and leftover.name in out


@pytest.mark.parametrize("name, content, expected", [
    ("saver_info.json", "{not json", "saver_info.json is not valid JSON"),
    ("checkpoint_info.json", "[1, 2]", "checkpoint_info.json holds list"),
])
def test_garbage_recover_info_json(root: Path, name: str, content: str, expected: str) -> None:
    (trial_dir(root, "plain") / "recover_info" / name).write_text(content)
    rc, out, _ = cli(str(root))
    assert rc == 1 and expected in out
    rc, doc = cli_json(str(root))
    plain = next(t for t in doc["trials"] if t["trial_name"] == "plain")
    info = plain["recover_info"]
    assert info["consistent"] is False and info["files"][name] == "invalid"
    assert expected in info["problems"][0]


def test_missing_and_inconsistent_recover_info(root: Path) -> None:
    info_dir = trial_dir(root, "plain") / "recover_info"
    (info_dir / "dataloader_info.json").unlink()
    t = inspect_trial(trial_dir(root, "plain"))
    assert not t["valid"] and t["recover_info"]["files"]["dataloader_info.json"] == "missing"
    assert "dataloader_info.json is missing" in t["errors"][0]

    info_dir = trial_dir(root, "sharded") / "recover_info"
    step = json.loads((info_dir / "step_info.json").read_text())
    step["global_step"] = 2  # describes another step than checkpoint_info.json
    (info_dir / "step_info.json").write_text(json.dumps(step))
    t = inspect_trial(trial_dir(root, "sharded"))
    assert not t["valid"] and "does not describe the checkpoint" in t["errors"][0]


def test_deleted_recover_info_means_fresh_start_warning(root: Path) -> None:
    shutil.rmtree(trial_dir(root, "plain") / "recover_info")
    (reports,) = [r for r in inspect_path(root, verify=True) if r["trial_name"] == "plain"]
    assert reports["valid"] and reports["recover_info"]["present"] is False
    assert "starts fresh" in reports["warnings"][0]
    assert reports["recover"]["checkpoints"][0]["checksum"] == "unknown (no recover_info)"


def test_recover_info_without_checkpoint_is_an_error(root: Path) -> None:
    shutil.rmtree(trial_dir(root, "plain") / "default" / "recover_checkpoint")
    t = inspect_trial(trial_dir(root, "plain"), verify=True)
    assert not t["valid"] and "no model folder" in t["errors"][0] and "recover_checkpoint" in t["errors"][0]


def test_renamed_trial_is_reported(root: Path) -> None:
    src = trial_dir(root, "plain")
    dst = src.parent / "copy"
    shutil.copytree(src, dst)
    t = inspect_trial(dst)
    assert not t["valid"] and "trial_name='plain'" in t["errors"][0] and "copied or renamed" in t["errors"][0]


def test_interrupted_swap_reports_what_the_next_start_uses(tmp_path: Path, tokenizer: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run stopped inside the four-rename swap of its 2nd recover save (fault injection)."""
    monkeypatch.setenv("AREAL_LIGHTNING_FAULT", "recover.swap.old_info_moved:raise")
    recover = RecoverCallback(fileroot=tmp_path, experiment_name=EXP, trial_name="swap", user=USER,
                              freq_steps=2, io_mode="sync")
    with pytest.raises(Exception, match="fault injected at 'recover.swap.old_info_moved'"):
        make_trainer([recover], max_epochs=1).fit(LMModule(tiny_llama(), tokenizer), token_loader(n_batches=4))
    monkeypatch.delenv("AREAL_LIGHTNING_FAULT")
    tdir = trial_dir(tmp_path, "swap")
    assert not (tdir / "recover_info").exists()  # moved away, the new one not yet in place
    before = snapshot(tmp_path)
    t = inspect_trial(tdir, verify=True)
    assert snapshot(tmp_path) == before  # no repair, no cleanup
    assert t["valid"], t["errors"]
    assert t["recover_info"]["pending_swap"].startswith("4-")
    (ckpt,) = t["recover"]["checkpoints"]
    assert (ckpt["global_step"], ckpt["checksum"]) == (3, "ok")
    assert "interrupted by a crash" in t["warnings"][0]
    assert sum("part of the interrupted swap" in w for w in t["warnings"]) >= 2
    # the next start indeed rolls forward to exactly that checkpoint
    from areal_lightning.commit.recover_store import RecoverStore

    store = RecoverStore(TrialLayout(tmp_path, USER, EXP, "swap"))
    assert store.repair() == t["recover_info"]["pending_swap"]
    assert inspect_trial(tdir, verify=True)["recover"]["checkpoints"][0]["global_step"] == 3


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux /proc/locks")
def test_trial_being_trained_is_recognised_without_taking_the_lock(root: Path) -> None:
    from areal_lightning.commit.recover_store import TrialLock

    tdir = trial_dir(root, "plain")
    (tdir / "default" / ".tmp-recover_checkpoint-9-0123abcd").mkdir()
    assert inspect_trial(tdir)["lock"]["held"] is False
    lock = TrialLock(tdir)
    lock.acquire()  # as a training process does
    try:
        t = inspect_trial(tdir)
        assert t["lock"] == {"pid": os.getpid(), "held": True, "holder_pid": os.getpid()}
        assert "may be a save in progress" in t["warnings"][0]
        rc, out, _ = cli(str(tdir))
        assert rc == 0 and f"being trained now by pid {os.getpid()}" in out
    finally:
        lock.release()
    lock.acquire()  # inspect never held it: it can be taken again at once
    lock.release()
