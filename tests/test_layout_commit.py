"""Layout names and the atomic publish / delete primitives, on the real filesystem."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_lightning._fault import ENV_VAR, InjectedFault
from areal_lightning.commit.atomic import (
    atomic_write_json,
    clean_stale_tmp,
    publish_dir,
    remove_dir,
)
from areal_lightning.layout import (
    ExportName,
    TrialLayout,
    export_name,
    parse_export_name,
    tmp_sibling,
)


def test_export_names_round_trip_and_reject_others() -> None:
    assert export_name(0, 99, 99) == "epoch0epochstep99globalstep99"
    assert parse_export_name("epoch3epochstep7globalstep199") == ExportName(global_step=199, epoch=3, epoch_step=7)
    for other in ("epoch0epochstep1globalstep1.bak", ".tmp-epoch0epochstep1globalstep1-abc", "recover_checkpoint",
                  "epoch-1epochstep1globalstep1", "Epoch0epochstep1globalstep1"):
        assert parse_export_name(other) is None, other
    with pytest.raises(ValueError, match="global_step"):
        export_name(0, 0, -1)


def test_trial_layout_paths() -> None:
    lay = TrialLayout(Path("/r"), "u", "exp", "t")
    assert lay.trial_dir == Path("/r/checkpoints/u/exp/t")
    assert lay.export_dir("critic", 1, 2, 3) == Path("/r/checkpoints/u/exp/t/critic/epoch1epochstep2globalstep3")
    assert lay.recover_checkpoint_dir() == Path("/r/checkpoints/u/exp/t/default/recover_checkpoint")
    assert lay.recover_info_dir == Path("/r/checkpoints/u/exp/t/recover_info")


def test_list_exports_orders_by_global_step(tmp_path: Path) -> None:
    lay = TrialLayout(tmp_path, "u", "e", "t")
    for name in ("epoch1epochstep0globalstep10", "epoch0epochstep9globalstep9", "epoch0epochstep1globalstep1"):
        (lay.model_dir() / name).mkdir(parents=True)
    (lay.model_dir() / "epoch0epochstep0globalstep0").write_text("a file, not an export")
    assert [p.name for _, p in lay.list_exports()] == [
        "epoch0epochstep1globalstep1", "epoch0epochstep9globalstep9", "epoch1epochstep0globalstep10"]


def make_folder(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "weights.bin").write_text(content)
    return path


def test_publish_replaces_existing_folder_completely(tmp_path: Path) -> None:
    final = tmp_path / "epoch0epochstep0globalstep0"
    make_folder(final, "old")
    (final / "only_in_old.txt").write_text("x")
    publish_dir(make_folder(tmp_sibling(final), "new"), final)
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]
    assert sorted(p.name for p in final.iterdir()) == ["weights.bin"]
    assert (final / "weights.bin").read_text() == "new"


def test_crash_during_delete_leaves_only_trash_which_is_cleaned(tmp_path: Path, monkeypatch) -> None:
    final = make_folder(tmp_path / "epoch0epochstep0globalstep0", "old")
    monkeypatch.setenv(ENV_VAR, "commit.remove_renamed")
    with pytest.raises(InjectedFault):
        remove_dir(final)
    (leftover,) = list(tmp_path.iterdir())
    assert leftover.name.startswith(".trash-epoch0epochstep0globalstep0-")
    monkeypatch.delenv(ENV_VAR)
    keep = make_folder(tmp_sibling(tmp_path / "epoch0epochstep1globalstep1"), "in flight")
    assert clean_stale_tmp(tmp_path, keep=(keep,)) == [leftover]
    assert list(tmp_path.iterdir()) == [keep]


def test_atomic_write_json_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "info" / "step_info.json"
    atomic_write_json(path, {"global_step": 1})
    atomic_write_json(path, {"global_step": 2})
    assert path.read_text().strip().endswith("}") and '"global_step": 2' in path.read_text()
    assert [p.name for p in path.parent.iterdir()] == ["step_info.json"]
