"""Config fuzzing: every input either validates or raises ConfigError naming a field."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_lightning import (
    ConfigError,
    ExperimentConfig,
    HFSaverCallback,
    RecoverCallback,
    load_config,
)

FIELDS = {"fileroot", "experiment_name", "trial_name", "user", "saver", "recover",
          "saver.mode", "saver.freq_epochs", "saver.freq_steps", "saver.freq_secs", "saver.max_keep",
          "recover.mode", "recover.freq_epochs", "recover.freq_steps", "recover.freq_secs", "recover.retries"}

leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
                 st.text(max_size=12), st.sampled_from(["on", "off", "auto", "sync", "async", "disabled", "a/b",
                                                         "..", "", "x\\y", "run1"]))
section_keys = st.sampled_from(["mode", "freq_epochs", "freq_steps", "freq_secs", "max_keep", "retries", "typo"])
section = st.one_of(leaf, st.dictionaries(section_keys, leaf, max_size=6))
top = st.dictionaries(
    st.sampled_from(["fileroot", "experiment_name", "trial_name", "user", "saver", "recover", "extra"]),
    st.one_of(leaf, section), max_size=7)


def check(data: dict) -> None:
    try:
        cfg = load_config(data)
    except ConfigError as exc:
        # The named field is a known one, or the unknown key the input actually has.
        parts = exc.field.split(".")
        present = parts[0] in data and (len(parts) == 1 or (isinstance(data[parts[0]], dict)
                                                            and parts[1] in data[parts[0]]))
        assert exc.field in FIELDS or present, exc.field
        assert str(exc).startswith(exc.field + ":")
        return
    assert isinstance(cfg, ExperimentConfig)
    # A config that validates builds both callbacks without any other error.
    HFSaverCallback.from_config(cfg)
    RecoverCallback.from_config(cfg)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(top)
def test_fuzzed_dicts_validate_or_name_a_field(data) -> None:
    check(data)


@settings(max_examples=200, deadline=None)
@given(top)
def test_fuzzed_yaml_round_trip(tmp_path_factory, data) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    try:
        path.write_text(yaml.safe_dump(data))
    except (ValueError, yaml.YAMLError):
        return  # not representable as YAML (e.g. NaN keys): nothing to load
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        assert str(exc).startswith(exc.field + ":")
        return
    HFSaverCallback.from_config(cfg)
