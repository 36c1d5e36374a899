"""Configuration: validation naming the field, YAML on/off, dotlist overrides, from_config."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from areal_lightning import (
    ConfigError,
    ExperimentConfig,
    HFSaverCallback,
    RecoverConfig,
    SaverConfig,
    callbacks_from_config,
    load_config,
)

BASE = {"fileroot": "/tmp/x", "experiment_name": "exp", "trial_name": "t0"}


def with_(**sections):
    return {**BASE, **sections}


BAD = [
    # (config, field named in the error, words the message must contain)
    (with_(saverr={}), "saverr", "allowed keys"),
    (with_(saver={"freq": 1}), "saver.freq", "freq_steps"),
    (with_(recover={"freq_step": 1}), "recover.freq_step", "freq_steps"),
    (with_(saver={"mode": "fast"}), "saver.mode", "auto, sync, async"),
    (with_(recover={"mode": "sometimes"}), "recover.mode", "on, auto, off, disabled"),
    (with_(saver={"freq_steps": 0}), "saver.freq_steps", "positive"),
    (with_(saver={"freq_epochs": -1}), "saver.freq_epochs", "positive"),
    (with_(saver={"freq_secs": 0}), "saver.freq_secs", "positive"),
    (with_(recover={"freq_steps": -5}), "recover.freq_steps", "positive"),
    (with_(saver={"freq_steps": 2.5}), "saver.freq_steps", "integer"),
    (with_(saver={"freq_steps": "10"}), "saver.freq_steps", "integer"),
    (with_(saver={"freq_steps": True}), "saver.freq_steps", "integer"),
    (with_(saver={"max_keep": 0}), "saver.max_keep", "positive"),
    (with_(recover={"retries": -1}), "recover.retries", ">= 0"),
    (with_(recover={"retries": "3"}), "recover.retries", "integer"),
    (with_(recover={"lock_lease_s": 0}), "recover.lock_lease_s", "seconds from 0.5 to 600"),
    (with_(recover={"lock_lease_s": "60"}), "recover.lock_lease_s", "expected a number"),
    (with_(saver=5), "saver", "mapping"),
    (with_(saver={"mode": 3}), "saver.mode", "string"),
    ({**BASE, "experiment_name": ""}, "experiment_name", "non-empty"),
    ({**BASE, "trial_name": "a/b"}, "trial_name", "'/'"),
    ({**BASE, "trial_name": "a\\b"}, "trial_name", "'\\'"),
    ({**BASE, "experiment_name": ".."}, "experiment_name", "'..'"),
    ({**BASE, "user": "../root"}, "user", "'..'"),
    ({**BASE, "experiment_name": 7}, "experiment_name", "string"),
    ({**BASE, "fileroot": ""}, "fileroot", "non-empty"),
]


@pytest.mark.parametrize("cfg,field,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_field(cfg, field, words) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(cfg)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")
    assert words in str(info.value)


@pytest.mark.parametrize("cfg,field,words", BAD[:18], ids=[f"cb-{b[1]}-{i}" for i, b in enumerate(BAD[:18])])
def test_bad_input_also_fails_in_from_config_and_callbacks_from_config(cfg, field, words) -> None:
    for build in (HFSaverCallback.from_config, callbacks_from_config):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            build(cfg)


def test_callback_constructor_validates_every_argument() -> None:
    ok = dict(fileroot="/tmp/x", experiment_name="e", trial_name="t")
    cases = [
        (dict(mode="fastest"), "saver.mode"),
        (dict(freq_steps=0), "saver.freq_steps"),
        (dict(max_keep=-2), "saver.max_keep"),
        (dict(name="a/b"), "name"),
        (dict(name=""), "name"),
        (dict(trial_name=".."), "trial_name"),
        (dict(model_attr=""), "model_attr"),
        (dict(model_attr=3), "model_attr"),
        (dict(max_shard_size=1.5), "max_shard_size"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ConfigError) as info:
            HFSaverCallback(**{**ok, **kwargs})
        assert info.value.field == field, kwargs


def test_yaml_on_off_mean_on_and_off(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("fileroot: /tmp/x\nexperiment_name: e\ntrial_name: t\nrecover:\n  mode: on\n")
    assert load_config(path).recover.mode == "on"
    path.write_text("fileroot: /tmp/x\nexperiment_name: e\ntrial_name: t\nrecover:\n  mode: off\n")
    cfg = load_config(path)
    assert cfg.recover.mode == "off" and not cfg.recover.enabled
    # YAML `on` for a saver mode is not one of its modes: a clear error, not "True".
    path.write_text("fileroot: /tmp/x\nexperiment_name: e\ntrial_name: t\nsaver:\n  mode: on\n")
    with pytest.raises(ConfigError, match=r"saver\.mode: unknown mode 'on'; allowed: auto, sync, async"):
        load_config(path)


def test_dotlist_overrides_on_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("fileroot: /tmp/x\nexperiment_name: e\ntrial_name: t\nsaver:\n  freq_epochs: 1\n")
    cfg = load_config(path, overrides=["saver.freq_steps=10", "recover.mode=on", "saver.freq_epochs=null",
                                       "trial_name=t1"])
    assert cfg.saver.freq_steps == 10 and cfg.saver.freq_epochs is None
    assert cfg.recover.mode == "on" and cfg.trial_name == "t1"
    with pytest.raises(ConfigError, match=r"saver\.freq_steps"):
        load_config(path, overrides=["saver.freq_steps=0"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(path, overrides=["saver.freq_steps"])


def test_defaults_follow_the_spec() -> None:
    assert dataclasses.asdict(SaverConfig()) == {
        "mode": "auto", "freq_epochs": None, "freq_steps": None, "freq_secs": None, "max_keep": None}
    assert dataclasses.asdict(RecoverConfig()) == {
        "mode": "disabled", "freq_epochs": None, "freq_steps": None, "freq_secs": None, "retries": 3,
        "preempt_signals": ["SIGTERM"], "fast_forward": "sampler",
        "memory": {"enabled": False, "root": None, "freq_steps": 1, "slots": 2, "replicas": 0},
        "lock_lease_s": 60.0}
    cfg = load_config(BASE)
    assert cfg.user is None and cfg.resolved_user  # the OS user
    assert load_config({**BASE, "user": "alice"}).resolved_user == "alice"


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("kind", ["dict", "dataclass", "dictconfig", "structured", "yaml"])
def test_from_config_accepts_every_source(kind: str, tmp_path: Path) -> None:
    data = {**BASE, "saver": {"freq_steps": 7, "max_keep": 2, "mode": "sync"}}
    if kind == "dict":
        src = data
    elif kind == "dataclass":
        src = ExperimentConfig(**{**BASE, "saver": SaverConfig(freq_steps=7, max_keep=2, mode="sync")})
    elif kind == "dictconfig":
        src = OmegaConf.create(data)
    elif kind == "structured":
        src = OmegaConf.merge(OmegaConf.structured(ExperimentConfig), data)
    else:
        src = tmp_path / "c.yaml"
        src.write_text(OmegaConf.to_yaml(OmegaConf.create(data)))
    cb = HFSaverCallback.from_config(src, name="critic", model_attr="critic")
    assert (cb.config.freq_steps, cb.config.max_keep, cb.config.mode) == (7, 2, "sync")
    assert cb.name == "critic" and cb.model_attr == "critic"
    assert cb.model_dir == Path("/tmp/x/checkpoints") / cb.layout.user / "exp" / "t0" / "critic"
    (saver,) = callbacks_from_config(src)
    assert isinstance(saver, HFSaverCallback) and saver.config.freq_steps == 7


def test_structured_config_rejects_wrong_types_too() -> None:
    base = OmegaConf.structured(ExperimentConfig)
    with pytest.raises(Exception):
        OmegaConf.merge(base, {"saver": {"freq_steps": "often"}})


def test_strict_false_ignores_unknown_top_level_keys_only() -> None:
    big = {**BASE, "model": {"hidden": 8}, "saver": {"freq_steps": 1}}
    with pytest.raises(ConfigError, match="model"):
        HFSaverCallback.from_config(big)
    assert HFSaverCallback.from_config(big, strict=False).config.freq_steps == 1
    with pytest.raises(ConfigError, match=r"saver\.typo"):
        HFSaverCallback.from_config({**big, "saver": {"typo": 1}}, strict=False)


def test_callbacks_from_config_lists_enabled_callbacks() -> None:
    assert callbacks_from_config(BASE) == []
    assert len(callbacks_from_config({**BASE, "saver": {"freq_epochs": 1}})) == 1


def test_recover_preemption_and_fast_forward_keys_are_validated() -> None:
    cfg = load_config({**BASE, "recover": {"mode": "on", "preempt_signals": ["term", "SIGUSR1"],
                                           "fast_forward": "replay"}})
    assert cfg.recover.preempt_signals == ["SIGTERM", "SIGUSR1"] and cfg.recover.fast_forward == "replay"
    with pytest.raises(ConfigError, match=r"recover\.preempt_signals: unknown signal 'SIGBOGUS'"):
        load_config({**BASE, "recover": {"preempt_signals": ["SIGBOGUS"]}})
    with pytest.raises(ConfigError, match=r"recover\.fast_forward: unknown mode 'skip'; allowed: sampler, replay"):
        load_config({**BASE, "recover": {"fast_forward": "skip"}})


@pytest.mark.parametrize("uri", ["hdfs://namenode/ckpt", "file:///tmp/ckpt", "https://host/ckpt", "s3://"])
def test_an_unsupported_uri_root_is_refused_naming_the_field_and_writes_no_local_scheme_folder(
        tmp_path, monkeypatch, uri) -> None:
    """A URI root was written to a local folder named after its scheme (``s3:``), silently.
    Object stores are supported now (tests/test_objectstore.py); any other scheme, or an
    object-store URI without a bucket, is refused before anything runs, by both callbacks,
    the YAML loader, ``DCPCheckpointIO`` and ``inspect``, naming the field and what is allowed."""
    import torch

    from areal_lightning import DCPCheckpointIO, HFSaverCallback, RecoverCallback
    from areal_lightning.tools.cli import main

    monkeypatch.chdir(tmp_path)
    scheme = uri.split(":")[0]
    why = (r"names no bucket: expected s3://BUCKET\[/PREFIX\]" if uri == "s3://" else
           rf"the scheme {scheme}:// is not supported; use a POSIX path .* or an object store: s3://, gs://")
    for make in (lambda: RecoverCallback(fileroot=uri, experiment_name="e", trial_name="t"),
                 lambda: HFSaverCallback(fileroot=uri, experiment_name="e", trial_name="t", freq_steps=1),
                 lambda: load_config({"fileroot": uri, "experiment_name": "e", "trial_name": "t"})):
        with pytest.raises(ConfigError, match=rf"^fileroot: '{re.escape(uri)}'.*{why}"):
            make()
    io = DCPCheckpointIO()
    path = rf"^path: '{re.escape(uri)}/step1'.*{why}"
    with pytest.raises(ConfigError, match=path):
        io.save_checkpoint({"w": torch.zeros(2)}, f"{uri}/step1")
    with pytest.raises(ConfigError, match=path):
        io.load_checkpoint(f"{uri}/step1")
    with pytest.raises(ConfigError, match=path):
        io.remove_checkpoint(f"{uri}/step1")
    io.teardown()
    assert main(["inspect", uri]) == 2
    assert list(tmp_path.iterdir()) == []  # no folder named "hdfs:" (or "file:") anywhere
