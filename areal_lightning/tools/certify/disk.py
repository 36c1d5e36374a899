"""What a run left on disk: the trials, the step a rerun must resume from, leftovers of
interrupted saves, the HF exports and whether they load and equal the reference's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_lightning.errors import CheckpointCorruptError
from areal_lightning.layout import (
    CHECKPOINT_INFO,
    HF_INDEX,
    LEFTOVER_PREFIXES,
    LOCK_FILE,
    MEMORY_SEAL,
    OLD_PREFIX,
    RECOVER_CHECKPOINT,
    RECOVER_INFO,
    STEP_INFO,
    TMP_PREFIX,
    parse_export_name,
)


def find_trials(root: Path) -> list[Path]:
    """Trial folders below ``root``: those holding a ``.lock``, ``recover_info/`` or a temporary recover_info."""
    found = set()
    if root.is_dir():
        for path in root.rglob("*"):
            if path.name in (LOCK_FILE, RECOVER_INFO) or path.name.startswith(
                    (f"{TMP_PREFIX}{RECOVER_INFO}-", f"{OLD_PREFIX}{RECOVER_INFO}-")):
                found.add(path.parent)
    return sorted(found)


def _step_of(info_dir: Path) -> int:
    return int(json.loads((info_dir / STEP_INFO).read_text())["global_step"])


def expected_resume(trial: Path) -> int | None:
    """The global step (0-based, as in ``step_info.json``) a start of ``trial`` must resume after.

    Read-only, from the documented commit protocol (deliberately not through
    :class:`~areal_lightning.commit.recover_store.RecoverStore`, the code being certified:
    an oracle that shares the code it checks cannot catch its bugs; it shares only the
    names of :mod:`areal_lightning.layout`): the new pair of an interrupted swap (its complete
    ``.tmp-recover_info-{gen}`` exists and the swap had begun: the old checkpoint or info was
    moved aside, or the new checkpoint is no longer at its temporary name), else the
    committed ``recover_info/`` (with its ``checkpoint_info.json``), else ``None`` (a fresh start).
    """
    tmp_info, old_info = f"{TMP_PREFIX}{RECOVER_INFO}-", f"{OLD_PREFIX}{RECOVER_INFO}-"
    tmp_ckpt, old_ckpt = f"{TMP_PREFIX}{RECOVER_CHECKPOINT}-", f"{OLD_PREFIX}{RECOVER_CHECKPOINT}-"
    pending: list[tuple[int, int]] = []
    for tmp in trial.glob(tmp_info + "*"):
        gen = tmp.name[len(tmp_info):]
        if not (tmp / CHECKPOINT_INFO).is_file():
            continue
        moved_aside = (trial / f"{old_info}{gen}").exists() or any(trial.glob(f"*/{old_ckpt}{gen}"))
        in_place = not any(trial.glob(f"*/{tmp_ckpt}{gen}"))
        if moved_aside or in_place:
            pending.append((_step_of(tmp), int(gen.partition("-")[0])))
    if pending:
        return max(pending, key=lambda p: p[1])[0]
    info = trial / RECOVER_INFO
    if (info / CHECKPOINT_INFO).is_file():
        return _step_of(info)
    return None


def expected_memory_resume(root: Path) -> int | None:
    """The global step (0-based) the memory tiers below ``root`` hold for a rerun: the newest
    step whose ``SEALED.json`` exists in a slot of every rank (``rank{r}/slot{k}/``, the world
    size as the seals say), read from the documented layout only; ``None``: no such step."""
    held: dict[Path, dict[int, set[int]]] = {}
    worlds: dict[Path, int] = {}
    for seal in root.rglob(MEMORY_SEAL) if root.is_dir() else ():
        try:
            doc = json.loads(seal.read_text())
            rank, step = int(seal.parent.parent.name[len("rank"):]), int(doc["info"][STEP_INFO]["global_step"])
        except (OSError, ValueError, KeyError):
            continue
        tier = seal.parent.parent.parent
        held.setdefault(tier, {}).setdefault(rank, set()).add(step)
        worlds[tier] = int(doc["world_size"])
    steps = [max(set.intersection(*ranks.values())) for tier, ranks in held.items()
             if len(ranks) == worlds[tier] and set.intersection(*ranks.values())]
    return max(steps) if steps else None


def leftovers(trial: Path) -> list[str]:
    """Temporary / trash / old files and folders left in ``trial`` (relative paths)."""
    return sorted(str(p.relative_to(trial)) for p in trial.rglob("*") if p.name.startswith(LEFTOVER_PREFIXES))


def _exports(trial: Path) -> dict[str, Path]:
    out = {}
    for model in trial.iterdir() if trial.is_dir() else ():
        if model.is_dir() and not model.name.startswith(".") and model.name != RECOVER_INFO:
            for child in model.iterdir():
                if child.is_dir() and parse_export_name(child.name) is not None:
                    out[f"{model.name}/{child.name}"] = child
    return out


def _load_export(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    json.loads((path / "config.json").read_text())
    index = path / HF_INDEX
    if index.is_file():
        for name in set(json.loads(index.read_text())["weight_map"].values()):
            if not (path / name).is_file():
                raise CheckpointCorruptError(f"{path / name} (named by {index.name}) is missing")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointCorruptError(f"{path} holds no *.safetensors")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def check_exports(trial: Path, reference: Path | None) -> tuple[int, list[str]]:
    """Load every final-named HF export of ``trial``; compare with the same trial of the reference.

    Returns (number of exports, problems).
    """
    import torch

    problems: list[str] = []
    mine = _exports(trial)
    theirs = _exports(reference) if reference is not None else None
    if theirs is not None and set(mine) != set(theirs):
        problems.append(f"exports {sorted(mine)} != reference {sorted(theirs)}")
    for rel, path in sorted(mine.items()):
        try:
            tensors = _load_export(path)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            problems.append(f"{rel} does not load: {exc}")
            continue
        if theirs is not None and rel in theirs:
            try:
                ref = _load_export(theirs[rel])
            except Exception as exc:  # noqa: BLE001
                problems.append(f"reference {rel} does not load: {exc}")
                continue
            if set(ref) != set(tensors):
                problems.append(f"{rel}: tensors {sorted(set(tensors) ^ set(ref))} differ from the reference's")
            elif not all(tensors[k].dtype == ref[k].dtype and torch.equal(tensors[k], ref[k]) for k in ref):
                bad = [k for k in ref if not torch.equal(tensors[k], ref[k])]
                problems.append(f"{rel}: weights differ from the reference's export ({', '.join(bad[:3])})")
    return len(mine), problems
