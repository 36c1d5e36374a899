"""The demo job end to end (shortened), through the Python API and the console script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from areal_lightning.config import ConfigError
from areal_lightning.tools.demo import DemoConfig, run_demo

REPO = Path(__file__).resolve().parents[1]
SHORT = ["train.max_epochs=2", "train.num_samples=128", "train.batch_size=32", "train.hidden_size=32",
         "train.num_generations=2", "train.progress_bar=false", "saver.freq_steps=3", "saver.freq_epochs=1",
         "saver.max_keep=2", "user=ci"]


def test_demo_trains_exports_and_generates(tmp_path: Path) -> None:
    summary = run_demo(REPO / "configs" / "demo.yaml", [f"fileroot={tmp_path}", *SHORT])
    assert summary["global_step"] == 8
    trial = tmp_path / "checkpoints" / "ci" / "demo" / "trial0"
    assert summary["trial_dir"] == str(trial)
    # steps 3, 4 (epoch end), 6, 8 (epoch end) -> newest 2 kept
    assert [Path(p).name for p in summary["exports"]] == ["epoch1epochstep1globalstep5", "epoch1epochstep3globalstep7"]
    assert sorted(p.name for p in (trial / "default").iterdir()) == [Path(p).name for p in summary["exports"]]
    assert len(summary["generations"]) == 2
    for prompt, text in summary["generations"]:
        assert text.startswith(prompt)


def test_demo_defaults_validate_and_bad_overrides_fail_before_training(tmp_path: Path) -> None:
    cfg = DemoConfig().validate()
    assert cfg.saver.enabled and cfg.train.max_epochs > 0
    with pytest.raises(ConfigError, match=r"train\.batch_size"):
        run_demo(None, [f"fileroot={tmp_path}", "train.batch_size=0"])
    with pytest.raises(ConfigError, match=r"train\.bogus"):
        run_demo(None, [f"fileroot={tmp_path}", "train.bogus=1"])
    assert not (tmp_path / "checkpoints").exists()


def test_console_script_runs_the_demo(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "areal_lightning", "demo", "--config", str(REPO / "configs" / "demo.yaml"),
           f"fileroot={tmp_path}", *SHORT]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HF exports" in proc.stdout and "epoch1epochstep3globalstep7" in proc.stdout
    assert "generate('" in proc.stdout

    bad = subprocess.run([*cmd[:6], "saver.mode=fast"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2
    assert "saver.mode: unknown mode 'fast'; allowed: auto, sync, async" in bad.stderr
