"""Every shipped config in ``configs/`` loads, validates and builds real callbacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from areal_lightning import (
    HFSaverCallback,
    RecoverCallback,
    callbacks_from_config,
    load_config,
)
from areal_lightning.config import ExperimentConfig
from areal_lightning.tools.demo import DemoConfig
from areal_lightning.tools.inspect import inspect_trial
from tests.conftest import LMModule, make_trainer, tiny_llama, token_loader

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ALL = sorted(CONFIGS.glob("*.yaml"))
HYDRA = [p for p in ALL if "_target_" in p.read_text()]
PLAIN = [p for p in ALL if p not in HYDRA and p.name != "demo.yaml"]

# The source design's recommendations (best practices table) that each example mirrors.
RECOMMENDED: dict[str, dict[str, Any]] = {
    "long_training.yaml": {"saver.freq_epochs": 1, "recover.freq_steps": 1000, "recover.mode": "on"},
    "unpredictable_time.yaml": {"saver.freq_secs": 7200, "recover.freq_secs": 7200},
    "unstable_cluster.yaml": {"recover.freq_steps": 100, "recover.mode": "on"},
    "limited_disk.yaml": {"saver.max_keep": 1, "saver.freq_steps": None, "recover.freq_steps": None},
    "debug.yaml": {"saver.freq_steps": 1, "recover.freq_steps": 1},
}


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _settings(cb: Any) -> tuple:
    return (type(cb).__name__, cb.layout, cb.config)


def test_configs_are_all_covered() -> None:
    assert {p.name for p in PLAIN} == set(RECOMMENDED), "add the new config to RECOMMENDED"
    assert [p.name for p in HYDRA] == ["hydra_callbacks.yaml"]
    assert (CONFIGS / "demo.yaml") in ALL


def test_demo_config_validates() -> None:
    cfg = load_config(CONFIGS / "demo.yaml", schema=DemoConfig)
    assert isinstance(cfg, DemoConfig) and cfg.train.max_epochs > 0
    cbs = callbacks_from_config(CONFIGS / "demo.yaml", strict=False)
    assert [type(c) for c in cbs] == [HFSaverCallback, RecoverCallback]
    assert cbs[0].config == cfg.saver and cbs[1].config == cfg.recover


@pytest.mark.parametrize("path", PLAIN, ids=lambda p: p.name)
def test_example_config_validates_and_builds_callbacks(path: Path) -> None:
    cfg = load_config(path)  # strict: unknown keys would fail
    assert isinstance(cfg, ExperimentConfig)
    for key, want in RECOMMENDED[path.name].items():
        assert _get(cfg, key) == want, (path.name, key)
    # the structured schema accepts it too (Hydra ConfigStore route)
    OmegaConf.merge(OmegaConf.structured(ExperimentConfig), OmegaConf.load(path))
    cbs = callbacks_from_config(path)
    assert [type(c) for c in cbs] == [HFSaverCallback, RecoverCallback]
    saver, recover = cbs
    assert saver.config == cfg.saver and recover.config == cfg.recover
    assert recover.layout.trial_dir == saver.layout.trial_dir
    assert saver.layout.experiment_name == cfg.experiment_name
    # every comment-documented key is a real field: overrides work on each
    overridden = load_config(path, overrides=["saver.max_keep=2", "recover.retries=5", "trial_name=x"])
    assert (overridden.saver.max_keep, overridden.recover.retries, overridden.trial_name) == (2, 5, "x")


def test_hydra_config_instantiates_real_callbacks() -> None:
    from hydra.utils import instantiate

    path = HYDRA[0]
    cfg = OmegaConf.load(path)
    built = instantiate(cfg.callbacks)
    assert isinstance(built["saver"], HFSaverCallback) and isinstance(built["recover"], RecoverCallback)
    assert built["recover"].config.mode == "on" and built["recover"].enabled
    # callbacks_from_config reads the same file to identical callbacks
    via_config = callbacks_from_config(path, strict=False)
    assert [_settings(c) for c in via_config] == [_settings(built["saver"]), _settings(built["recover"])]


def test_hydra_compose_overrides_reach_both_callbacks(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(config_name="hydra_callbacks",
                      overrides=[f"fileroot={tmp_path}", "trial_name=run2", "saver.freq_steps=2", "recover.mode=off"])
    built = instantiate(cfg.callbacks)
    saver, recover = built["saver"], built["recover"]
    assert saver.layout.trial_dir == recover.layout.trial_dir
    assert saver.layout.trial_dir.parent.parent.parent.parent == tmp_path and saver.layout.trial_name == "run2"
    assert saver.config.freq_steps == 2 and recover.config.mode == "off" and not recover.enabled


def test_debug_config_trains_and_inspects_valid(tmp_path: Path, tokenizer: Any) -> None:
    """The debug config on a real run: an export and a recover checkpoint after every step."""
    cfg = load_config(CONFIGS / "debug.yaml", overrides=[f"fileroot={tmp_path}", "user=u"])
    saver, recover = callbacks_from_config(cfg)
    make_trainer([saver, recover], max_epochs=1).fit(LMModule(tiny_llama(), tokenizer), token_loader(n_batches=4))
    report = inspect_trial(saver.layout.trial_dir, verify=True)
    assert report["valid"], report["errors"]
    # max_keep: 3 of the 4 per-step exports remain
    assert [e["global_step"] for e in report["exports"]] == [1, 2, 3]
    assert report["recover"]["checkpoints"][0]["global_step"] == 3
    assert report["recover"]["checkpoints"][0]["checksum"] == "ok"
