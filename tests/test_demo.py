"""The demo job end to end (shortened), through the Python API and the console script.

The demo trains in worker processes: an uninterrupted reference and, side by side, a run
that gets a real SIGKILL, is started again with the same command and resumes. These tests
check the facts it reports against the raw per-step losses, and that its verdict fails
when the restarted run really trains differently.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from areal_lightning.config import ConfigError, load_config
from areal_lightning.tools.demo import (
    DemoConfig,
    DemoMismatchError,
    compare_runs,
    run_demo,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo.yaml"
# 2 epochs of 32 steps (64 steps); recover checkpoints after steps 10, 20, ..., 60; the automatic
# kill step is 35, halfway between the checkpoints after steps 30 (mid-epoch 0) and 40 (in epoch 1).
SHORT = ["train.max_epochs=2", "train.num_samples=512", "train.batch_size=16", "train.hidden_size=32",
         "train.num_generations=2", "train.progress_bar=false", "saver.freq_steps=20", "saver.freq_epochs=1",
         "saver.max_keep=2", "recover.freq_steps=10", "user=ci"]
TOTAL = 64
# exports after steps 20, 32 (epoch end), 40, 60, 64 (epoch end) -> newest 2 kept
EXPORTS = ["epoch1epochstep27globalstep59", "epoch1epochstep31globalstep63"]


def _fmt(hexloss: str) -> str:
    return f"{float.fromhex(hexloss):.9g}"


@pytest.mark.slow  # worker processes, one SIGKILLed (the fast tier resumes in-process: test_recover, test_matrix)
def test_demo_kills_resumes_and_matches_the_uninterrupted_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    overrides = [f"fileroot={tmp_path}", *SHORT, "kill.at_step=25"]
    cfg = load_config(CONFIG, overrides, schema=DemoConfig)
    ckpts = cfg.recover_steps()
    assert (ckpts, cfg.kill_step(), cfg.train.total_steps) == ([10, 20, 30, 40, 50, 60], 25, TOTAL)

    summary = run_demo(CONFIG, overrides)
    out = capsys.readouterr().out
    killed, resumed = summary["killed_at_step"], summary["resumed_from_step"]

    # The kill happened exactly where asked: the first worker stopped itself right after step 25 (a
    # step boundary, whatever the machine's load) and was ended there by SIGKILL, mid-epoch.
    assert summary["killed_signal"] == signal.SIGKILL
    assert killed == 25 and summary["killed_batch"] + 1 < cfg.train.steps_per_epoch
    assert summary["killed_between_checkpoints"] is True
    # The restart resumed from the recover checkpoint before the kill step, durable at the kill.
    assert resumed == 20
    assert resumed == summary["durable_checkpoint_step"]
    assert summary["resumed_step_info"]["global_step"] == resumed - 1  # recover_info counts from 0
    assert summary["global_step"] == TOTAL

    # The losses match: checked here again from the raw records of the three starts.
    before, after, ref = (summary["losses"][k] for k in ("before_kill", "after_resume", "reference"))
    assert sorted(ref) == list(range(1, TOTAL + 1))
    assert sorted(before) == list(range(1, killed + 1))  # the first start, up to the kill
    assert sorted(after) == list(range(resumed + 1, TOTAL + 1))  # the restart: from the checkpoint on
    assert all(before[s] == ref[s] for s in before) and all(after[s] == ref[s] for s in after)
    assert summary["losses_match"] is True and summary["exports_match"] is True and not summary["problems"]
    # ... and they are real training losses, not constants: all different, and going down.
    assert len(set(ref.values())) == TOTAL and float.fromhex(ref[TOTAL]) < float.fromhex(ref[1]) - 0.1

    # The verdict is computed from these values: a single bit changed anywhere makes it fail.
    assert compare_runs(ref, before, after, resumed, killed, TOTAL)["match"]
    for label, which, step in (("after the kill", "after", TOTAL), ("a replayed step", "after", killed),
                               ("a replayed step, first start", "before", killed),
                               ("before the checkpoint", "before", 1), ("reference", "ref", resumed + 1)):
        data = {"before": dict(before), "after": dict(after), "ref": dict(ref)}
        data[which][step] = math.nextafter(float.fromhex(data[which][step]), math.inf).hex()
        assert not compare_runs(data["ref"], data["before"], data["after"], resumed, killed, TOTAL)["match"], label
    missing = dict(after)
    del missing[TOTAL - 1]
    assert not compare_runs(ref, before, missing, resumed, killed, TOTAL)["match"]

    # What it printed is that data: the SIGKILL row shows the three losses of the kill step.
    assert summary["verdict"] in out and summary["verdict"].startswith("VERDICT: PASS")
    row = next(line for line in out.splitlines() if line.rstrip().endswith("<- SIGKILL here")).split()
    assert row[:5] == [str(killed), _fmt(before[killed]), _fmt(after[killed]), _fmt(ref[killed]), "same"]
    row = next(line for line in out.splitlines() if "resumed from here" in line).split()
    assert row[:5] == [str(resumed), _fmt(before[resumed]), "-", _fmt(ref[resumed]), "same"]
    assert f"{killed - resumed}/{killed - resumed} bit-identical" in out

    trial = tmp_path / "checkpoints" / "ci" / "demo" / "trial0"
    assert summary["trial_dir"] == str(trial)
    assert summary["reference_trial_dir"] == str(trial.parent / "trial0-reference")
    assert [Path(p).name for p in summary["exports"]] == EXPORTS
    assert sorted(p.name for p in (trial / "default").iterdir()) == [*EXPORTS, "recover_checkpoint"]
    assert not Path(summary["work_dir"]).exists()  # removed after a pass
    assert len(summary["generations"]) == 2
    for prompt, text in summary["generations"]:
        assert text.startswith(prompt)


def test_demo_verdict_fails_when_the_restart_trains_differently(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    def other_data(work: Path) -> None:  # the restarted worker reads this config: another data set
        conf = json.loads((work / "run.json").read_text())
        conf["train"]["seed"] = 1
        (work / "run.json").write_text(json.dumps(conf))

    with pytest.raises(DemoMismatchError, match="VERDICT: FAIL") as err:
        run_demo(CONFIG, [f"fileroot={tmp_path}", *SHORT, "train.num_generations=0"], before_resume=other_data)
    out = capsys.readouterr().out
    assert "per-step losses differ from the uninterrupted run's" in str(err.value)
    assert "VERDICT: FAIL" in out and "VERDICT: PASS" not in out
    assert "DIFFERENT" in out and f"final HF export {EXPORTS[-1]}: DIFFERENT" in out
    # the steps before the checkpoint were trained by the first start: still identical
    assert re.search(r"steps +1-(\d+) +first start, before the kill, vs reference: (\d+)/\1 bit-identical", out)
    work = Path(re.search(r"logs and losses: (\S+)\)", str(err.value)).group(1))
    assert (work / "run-losses.jsonl").is_file()  # kept for a look
    shutil.rmtree(work)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Train in this process with one intra-op thread, like the demo's workers (a shared
    2-core machine makes two spinning threads crawl)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_demo_without_kill_trains_in_process_and_a_rerun_resumes(tmp_path: Path, one_thread: None) -> None:
    overrides = [f"fileroot={tmp_path}", *SHORT, "kill.enabled=false"]
    summary = run_demo(CONFIG, overrides)
    assert summary["global_step"] == TOTAL
    assert (summary["killed_at_step"], summary["resumed_from_step"], summary["losses_match"]) == (None, None, None)
    trial = tmp_path / "checkpoints" / "ci" / "demo" / "trial0"
    assert [Path(p).name for p in summary["exports"]] == EXPORTS
    assert sorted(p.name for p in (trial / "default").iterdir()) == [*EXPORTS, "recover_checkpoint"]
    assert not (trial.parent / "trial0-reference").exists()
    for prompt, text in summary["generations"]:
        assert text.startswith(prompt)
    # the same command again: RecoverCallback resumes the finished trial, nothing is retrained
    again = run_demo(CONFIG, [*overrides, "train.num_generations=0"])
    assert again["global_step"] == TOTAL and again["exports"] == summary["exports"]


def test_demo_defaults_validate_and_bad_overrides_fail_before_training(tmp_path: Path) -> None:
    cfg = DemoConfig().validate()
    assert cfg.saver.enabled and cfg.recover.enabled and cfg.kill.enabled and cfg.train.max_epochs > 0
    assert (cfg.kill_step(), cfg.recover_steps()[:2], cfg.train.total_steps) == (275, [50, 100], 512)
    assert load_config(CONFIG, schema=DemoConfig) == cfg  # the file spells out the built-in defaults
    assert load_config(DemoConfig(), ["kill.at_step=60"], schema=DemoConfig).kill_step() == 60
    bad = {
        "train.batch_size=0": r"train\.batch_size",
        "train.bogus=1": r"train\.bogus",
        "kill.at_step=250": r"kill\.at_step: step 250 is a recover checkpoint step",
        "kill.at_step=10": r"kill\.at_step: expected a step after the first recover checkpoint \(step 50\)",
        "kill.at_step=512": r"kill\.at_step: .* before the last step \(512\), got 512",
        "kill.at_step=0": r"kill\.at_step: expected a positive integer or null",
        "kill.enabled=maybe": r"kill\.enabled: expected true or false",
        "recover.mode=off": r"kill\.enabled: .* needs recover\.mode: on",
        "recover.freq_steps=1": r"kill\.at_step: no step lies between two recover checkpoints",
        "recover.freq_steps=600": r"recover\.freq_steps: no recover checkpoint falls within the run's 512 steps",
        "kill.bogus=1": r"kill\.bogus",
    }
    for override, match in bad.items():
        with pytest.raises(ConfigError, match=match):
            run_demo(None, [f"fileroot={tmp_path}", override])
    assert not (tmp_path / "checkpoints").exists()
    load_config(DemoConfig(), ["recover.mode=off", "kill.enabled=false"], schema=DemoConfig)  # fine without the kill


@pytest.mark.slow  # the whole demo in a subprocess
def test_console_script_runs_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cmd = [sys.executable, "-m", "areal_lightning", "demo", "--config", str(CONFIG), f"fileroot={tmp_path}", *SHORT]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    killed = int(re.search(r"SIGKILL -> pid \d+ \(exit code -9\) after step (\d+), mid-epoch", out).group(1))
    resumed = int(re.search(r"resumed from the recover checkpoint after step (\d+)", out).group(1))
    assert (resumed, killed) == (30, 35)  # the automatic kill step, halfway between the checkpoints after 30 and 40
    verdict = [line for line in out.splitlines() if line.startswith("VERDICT:")]
    assert verdict == [f"VERDICT: PASS - killed after step {killed}, resumed from the checkpoint after step {resumed}: "
                       f"all {TOTAL} per-step losses are bit-for-bit those of the uninterrupted run, and so is the "
                       "final HF export"]
    rows = [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +\S+ +\S+ +\S+ +(same bits|DIFFERENT)", line)]
    assert [int(r[0]) for r in rows] == [resumed, resumed + 1, resumed + 2, *range(max(resumed + 3, killed - 1),
                                                                                   killed + 3), TOTAL]
    assert all(r[4:6] == ["same", "bits"] for r in rows)
    assert "HF exports" in out and EXPORTS[-1] in out and "generate('" in out
    assert out.index("VERDICT:") < out.index("HF exports")

    from areal_lightning.tools.cli import main

    assert main(["demo", "--config", str(CONFIG), f"fileroot={tmp_path / 'bad'}", "saver.mode=fast"]) == 2
    assert "saver.mode: unknown mode 'fast'; allowed: auto, sync, async" in capsys.readouterr().err
