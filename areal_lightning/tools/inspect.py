"""``areal-lightning inspect``: a read-only health report of trial folders.

For each trial (``{fileroot}/checkpoints/{user}/{experiment}/{trial}``) it reports:

- every HF export of every model folder: epoch / step in epoch / global step parsed from
  the folder name, size, age, and whether it is complete (``config.json`` is valid JSON, the
  weights named by ``model.safetensors`` or by ``model.safetensors.index.json`` are all
  present, and each safetensors file is as long as its header says);
- the recover checkpoint: step, world size, strategy, size, age and, with ``verify=True``,
  the size of every file against ``recover_info/checkpoint_info.json`` and the CRC32C of every
  item of every file (each recorded in ``.metadata`` when it was written)
  (without it, file presence and sizes only);
- the consistency of ``recover_info/`` (every file present and valid JSON, ``step_info``
  matching ``checkpoint_info``), through :meth:`RecoverStore.read_info`;
- leftovers of interrupted saves (``.tmp-*``, ``.trash-*``, ``.old-*``) as warnings.

Nothing is modified: no repair, no cleanup, no lock taken. A trial is *valid* when it has
no errors; warnings (leftovers, an interrupted swap the next start rolls forward, a
recover checkpoint without ``recover_info/``) do not make it invalid.

Example:
    >>> from areal_lightning.tools.inspect import inspect_path
    >>> reports = inspect_path("/data/ckpt", verify=True)        # doctest: +SKIP
    >>> [(r["trial_name"], r["valid"]) for r in reports]         # doctest: +SKIP
    [('run1', True)]
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import struct
import time
from pathlib import Path
from typing import Any, Iterable

from areal_lightning.errors import InspectUsageError, start_fresh
from areal_lightning.layout import (
    CHECKPOINT_INFO,
    COMMIT_MARKER,
    HF_INDEX,
    HF_WEIGHTS,
    LEFTOVER_PREFIXES,
    LOCK_FILE,
    RECOVER_CHECKPOINT,
    RECOVER_INFO,
    RESERVED_NAMES,
    STEP_INFO,
    TMP_PREFIX,
    TrialLayout,
    parse_export_name,
)
from areal_lightning.objectstore import check_path, is_remote
from areal_lightning.telemetry import folder_bytes

__all__ = ["InspectUsageError", "inspect_trial", "inspect_path", "render_reports", "run_inspect"]

SAFETENSORS = HF_WEIGHTS
SAFETENSORS_INDEX = HF_INDEX
_MAX_HEADER = 100 << 20  # the safetensors library refuses headers above 100 MB too


# ---------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).isoformat(timespec="seconds")


def _age(ts: float | None, now: float) -> float | None:
    return None if ts is None else max(0.0, now - ts)


def _load_json(path: Path) -> tuple[Any, str | None]:
    """``(data, None)`` or ``(None, reason)``."""
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, f"{path} is missing"
    except (OSError, ValueError) as exc:
        return None, f"{path} is not valid JSON ({exc})"


def check_safetensors(path: Path) -> tuple[set[str], str | None]:
    """Tensor names of a safetensors file and ``None``, or ``(set(), reason)`` when broken.

    Reads only the header: the file must be exactly ``8 + header length + end of the last
    tensor`` bytes long, so a truncated or padded file is caught without reading the weights.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return set(), f"{path} has {size} bytes, too short for a safetensors header (truncated?)"
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                return set(), f"{path}: header length {n} does not fit in its {size} bytes (truncated or not safetensors)"
            header = json.loads(f.read(n))
    except FileNotFoundError:
        return set(), f"{path} is missing"
    except (OSError, ValueError) as exc:
        return set(), f"{path}: unreadable safetensors header ({exc})"
    if not isinstance(header, dict):
        return set(), f"{path}: safetensors header is not a JSON object"
    end = 0
    names = set()
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return set(), f"{path}: bad safetensors header entry for {key!r}"
        names.add(key)
        end = max(end, offsets[1])
    if size != 8 + n + end:
        return set(), (f"{path} has {size} bytes but its header describes {8 + n + end} "
                       f"({'truncated' if size < 8 + n + end else 'trailing bytes'})")
    return names, None


# ---------------------------------------------------------------------------------------
# exports
# ---------------------------------------------------------------------------------------


def inspect_export(path: Path, now: float | None = None) -> dict[str, Any]:
    """Report of one HF export folder (``epoch{E}epochstep{S}globalstep{G}``).

    ``complete`` is true when ``config.json`` is valid JSON and every weight file is present
    and intact (header-length check); ``problems`` says what is wrong otherwise.
    """
    now = time.time() if now is None else now
    parsed = parse_export_name(path.name)
    problems: list[str] = []
    config, err = _load_json(path / "config.json")
    if err:
        problems.append(err)
    elif not isinstance(config, dict):
        problems.append(f"{path / 'config.json'} holds {type(config).__name__}, expected a JSON object")
    weight_files: list[str] = []
    index_path = path / SAFETENSORS_INDEX
    if index_path.exists():
        index, err = _load_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if err:
            problems.append(err)
        elif not isinstance(weight_map, dict) or not weight_map:
            problems.append(f"{index_path} has no 'weight_map'")
        else:
            by_shard: dict[str, set[str]] = {}
            for tensor, shard in weight_map.items():
                by_shard.setdefault(str(shard), set()).add(tensor)
            for shard, wanted in sorted(by_shard.items()):
                weight_files.append(shard)
                names, err = check_safetensors(path / shard)
                if err:
                    problems.append(err if (path / shard).exists() else
                                    f"{path / shard} is missing (listed in {SAFETENSORS_INDEX})")
                elif not wanted <= names:
                    missing = sorted(wanted - names)
                    problems.append(f"{path / shard} lacks {len(missing)} tensor(s) listed in {SAFETENSORS_INDEX}, "
                                    f"e.g. {missing[0]!r}")
    elif (path / SAFETENSORS).exists():
        weight_files.append(SAFETENSORS)
        _names, err = check_safetensors(path / SAFETENSORS)
        if err:
            problems.append(err)
    else:
        problems.append(f"{path} has no {SAFETENSORS} and no {SAFETENSORS_INDEX}: the weights are missing")
    mtime = _mtime(path)
    return {
        "name": path.name,
        "path": str(path),
        "epoch": parsed.epoch if parsed else None,
        "epoch_step": parsed.epoch_step if parsed else None,
        "global_step": parsed.global_step if parsed else None,
        "size_bytes": folder_bytes(path),
        "mtime": _iso(mtime),
        "age_s": _age(mtime, now),
        "weight_files": weight_files,
        "has_tokenizer": (path / "tokenizer_config.json").is_file(),
        "complete": not problems,
        "problems": problems,
    }


# ---------------------------------------------------------------------------------------
# recover checkpoint + recover_info
# ---------------------------------------------------------------------------------------


def pending_swap(layout: TrialLayout, name: str) -> tuple[str, Path, Path] | None:
    """The swap a crash interrupted that the next start finishes (read-only):
    ``(generation, info dir, checkpoint dir)`` of the pair it will use, or ``None``."""
    from areal_lightning.commit.recover_store import RecoverStore

    store = RecoverStore(layout, name)
    gen = store.pending_swap()
    if gen is None:
        return None
    tmp_ckpt = store.tmp_ckpt_dir(gen)
    return gen, store.tmp_info_dir(gen), tmp_ckpt if tmp_ckpt.exists() else store.ckpt_dir


def _inspect_recover(layout: TrialLayout, model_names: list[str], verify: bool, now: float,
                     errors: list[str], warnings: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    from areal_lightning.commit.recover_store import INFO_FILES, RecoverStore
    from areal_lightning.errors import CheckpointCorruptError

    ckpt_names = [n for n in model_names if layout.recover_checkpoint_dir(n).is_dir()]
    stores = {n: RecoverStore(layout, n) for n in ckpt_names}
    # A crash inside the four-rename swap: report the pair the next start will roll forward to.
    pending = None
    for name in ckpt_names or [n for n in model_names if n == "default"] or model_names[:1]:
        pending = pending_swap(layout, name)
        if pending is not None:
            gen, pending_info, pending_ckpt = pending
            store = RecoverStore(layout, name)
            store.info_dir, store.ckpt_dir = pending_info, pending_ckpt  # our own instance, read-only use
            stores = {**stores, name: store}
            ckpt_names = sorted(stores)
            warnings.append(
                f"a recover checkpoint swap (save {gen}) was interrupted by a crash; the next start finishes it "
                f"(roll forward). Reported below: {pending_ckpt} with {pending_info}, what the next start uses.")
            break
    info_dir = next(iter(stores.values())).info_dir if stores else layout.recover_info_dir
    info_report: dict[str, Any] = {"path": str(info_dir), "present": info_dir.is_dir(), "files": {},
                                   "consistent": None, "problems": [],
                                   "pending_swap": pending[0] if pending else None}
    recover: dict[str, Any] = {"present": bool(ckpt_names) or info_dir.is_dir(), "checkpoints": []}

    info: dict[str, dict[str, Any]] | None = None
    if info_dir.is_dir():
        for name in INFO_FILES:
            data, err = _load_json(info_dir / name)
            if err is None and not isinstance(data, dict):
                err = f"{info_dir / name} holds {type(data).__name__}, expected a JSON object"
            info_report["files"][name] = "ok" if err is None else ("missing" if not (info_dir / name).exists()
                                                                   else "invalid")
        reader = next(iter(stores.values())) if stores else RecoverStore(layout, "default")
        try:
            info = reader.read_info()
            info_report["consistent"] = True
        except CheckpointCorruptError as exc:
            info_report["consistent"] = False
            info_report["problems"].append(str(exc))
            errors.append(f"recover_info: {exc}")
        if not ckpt_names:
            msg = (f"{info_dir} describes a recover checkpoint but no model folder of {layout.trial_dir} has a "
                   f"{RECOVER_CHECKPOINT}/; resuming will fail. Restore it, or {start_fresh(info_dir)}.")
            info_report["problems"].append(msg)
            errors.append(msg)
    elif ckpt_names:
        warnings.append(f"{stores[ckpt_names[0]].ckpt_dir} exists but {info_dir} does not: "
                        "it will be ignored and the next run starts fresh (recover_info/ was deleted?)")

    ckpt_info = info[CHECKPOINT_INFO] if info else None
    step_info = info[STEP_INFO] if info else None
    if info is None and info_dir.is_dir():
        # recover_info/ is unusable as a whole; still check the checkpoint against whatever of
        # checkpoint_info.json / step_info.json can be read, to report every problem at once.
        ckpt_info, _ = _load_json(info_dir / CHECKPOINT_INFO)
        step_info, _ = _load_json(info_dir / STEP_INFO)
        if not (isinstance(ckpt_info, dict) and isinstance(ckpt_info.get("files"), dict)):
            ckpt_info = None
        if not isinstance(step_info, dict):
            step_info = {}
    if ckpt_info is not None:
        for key, want in (("experiment_name", layout.experiment_name), ("trial_name", layout.trial_name)):
            if ckpt_info.get(key) != want:
                msg = (f"{info_dir / CHECKPOINT_INFO} was written by {key}={ckpt_info.get(key)!r} but the "
                       f"folder is {key}={want!r} (copied or renamed?): resuming will refuse it. Use the original "
                       f"names, or {start_fresh(info_dir)}.")
                info_report["problems"].append(msg)
                errors.append(msg)
    for name in ckpt_names:
        store = stores[name]
        ckpt_dir = store.ckpt_dir
        entry: dict[str, Any] = {
            "model": name, "path": str(ckpt_dir), "size_bytes": folder_bytes(ckpt_dir),
            "num_files": sum(1 for p in ckpt_dir.rglob("*") if p.is_file()),
            "global_step": None, "steps_done": None, "epoch": None, "epoch_step": None,
            "world_size": None, "strategy": None, "io_mode": None, "commit_time": None,
            "age_s": None, "checksum": "unknown", "valid": False, "problems": [],
        }
        mtime = _mtime(ckpt_dir / COMMIT_MARKER) or _mtime(ckpt_dir)
        if ckpt_info is not None and step_info is not None:
            steps_done = ckpt_info.get("global_step")
            entry.update(
                global_step=step_info.get("global_step", steps_done - 1 if isinstance(steps_done, int) else None),
                epoch=step_info.get("epoch"),
                epoch_step=step_info.get("epoch_step"), steps_done=steps_done,
                world_size=ckpt_info.get("world_size"), strategy=ckpt_info.get("strategy"),
                io_mode=ckpt_info.get("io_mode"), commit_time=ckpt_info.get("commit_time"),
            )
            try:
                mtime = _dt.datetime.fromisoformat(str(ckpt_info.get("commit_time"))).timestamp()
            except ValueError:
                pass
            try:
                if verify:
                    store.verify(ckpt_info)
                    entry["checksum"] = "ok"
                else:
                    store.verify(ckpt_info, data=False)
                    entry["checksum"] = "not verified"
                entry["valid"] = True
            except CheckpointCorruptError as exc:
                entry["checksum"] = "corrupt" if verify else "broken"
                entry["problems"].append(str(exc))
                errors.append(f"recover checkpoint: {exc}")
        elif info_dir.is_dir():
            entry["checksum"] = "unknown (recover_info invalid)"
        else:
            entry["checksum"] = "unknown (no recover_info)"
        entry["age_s"] = _age(mtime, now)
        entry["mtime"] = _iso(mtime)
        recover["checkpoints"].append(entry)
    return recover, info_report


# ---------------------------------------------------------------------------------------
# trials
# ---------------------------------------------------------------------------------------


def _leftovers(trial_dir: Path, model_dirs: Iterable[Path], now: float) -> list[dict[str, Any]]:
    found = []
    for parent in [trial_dir, *model_dirs]:
        for child in sorted(parent.iterdir()):
            if child.name.startswith(LEFTOVER_PREFIXES):
                kind = next(p for p in LEFTOVER_PREFIXES if child.name.startswith(p)).strip(".-")
                mtime = _mtime(child)
                found.append({"path": str(child), "kind": kind, "size_bytes": folder_bytes(child),
                              "age_s": _age(mtime, now)})
    return found


def _lock_holder(trial_dir: Path) -> dict[str, Any] | None:
    """Who holds ``{trial}/.lock``, found passively (no lock is taken, nothing is written).

    ``pid`` is the pid the last holder wrote into the file; ``held`` is whether a process on this
    host holds the ``flock`` now (read from ``/proc/locks``; ``None`` where that is not
    available, e.g. not Linux), ``holder_pid`` its pid. ``None`` when there is no ``.lock``.
    """
    lock = trial_dir / LOCK_FILE
    try:
        text = lock.read_text(errors="replace").strip()
        st = lock.stat()
    except OSError:
        return None
    held: bool | None = None
    holder: int | None = None
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            held = False
            for line in f:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 31340 fe:00:2146574 0 EOF"
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
                    held, holder = True, int(fields[4]) if fields[4].isdigit() else None
                    break
    except OSError:
        pass
    return {"pid": int(text) if text.isdigit() else None, "held": held, "holder_pid": holder}


def _is_model_dir(path: Path) -> bool:
    if not path.is_dir() or path.name.startswith(".") or path.name in RESERVED_NAMES:
        return False
    for child in path.iterdir():
        name = child.name
        if name == RECOVER_CHECKPOINT or parse_export_name(name) is not None or name.startswith(LEFTOVER_PREFIXES):
            return True
    return False


def layout_of(trial_dir: Path) -> TrialLayout:
    trial_dir = Path(os.path.abspath(trial_dir))
    layout = TrialLayout(trial_dir.parents[3] if len(trial_dir.parents) > 3 else Path("/"),
                         trial_dir.parent.parent.name, trial_dir.parent.name, trial_dir.name)
    if layout.trial_dir != trial_dir or not all((layout.user, layout.experiment_name, layout.trial_name)):
        raise InspectUsageError(f"{trial_dir} is not a trial folder "
                                "({fileroot}/checkpoints/{user}/{experiment}/{trial})")
    return layout


def inspect_memory(layout: TrialLayout, model_names: list[str], root: str | None, verify: bool) -> list[dict[str, Any]]:
    """The memory tier of each model of the trial under ``root`` (``None``: its default root on
    this node's ``/dev/shm``): per rank the steps its slots hold sealed, and the newest step every
    rank sealed (a rerun's candidate); ``verify``: that step's slots checked item by item."""
    from areal_lightning.commit.memory_tier import is_tier_folder, newest_complete_step, tier_folder, verify_slot

    out = []
    for name in model_names or ["default"]:
        folder = tier_folder(root, layout.user, layout.experiment_name, layout.trial_name, name)
        if not is_tier_folder(folder):
            continue
        ranks: dict[str, list[int]] = {}
        for seal in sorted(folder.glob("rank*/slot*/SEALED.json")):
            doc, _ = _load_json(seal)
            if isinstance(doc, dict) and "global_step" in doc:
                ranks.setdefault(seal.parent.parent.name, []).append(int(doc["global_step"]))
        newest = newest_complete_step(folder)
        report: dict[str, Any] = {"model": name, "folder": str(folder), "size_bytes": folder_bytes(folder),
                                  "ranks": {r: sorted(steps) for r, steps in sorted(ranks.items())},
                                  "newest_complete_step": newest[0] if newest else None, "checksum": "not verified"}
        if verify and newest is not None:
            problems = []
            for rank, seal in enumerate(newest[1]):
                why, _ = verify_slot(seal)
                if why:
                    problems.append(f"rank {rank}: {why}")
            report["checksum"] = "ok" if not problems else "; ".join(problems)
        out.append(report)
    return out


def inspect_trial(trial_dir: str | os.PathLike[str], verify: bool = False,
                  memory_root: str | None = None) -> dict[str, Any]:
    """Inspect one trial folder ``{fileroot}/checkpoints/{user}/{experiment}/{trial}`` (read-only).

    Args:
        trial_dir: the trial folder.
        verify: also check the CRC32C of every item of every recover checkpoint file (reads it all).
        memory_root: the memory tier's root on this node (``None``: ``/dev/shm/areal-lightning``).

    Returns:
        A JSON-serialisable dict: ``trial_dir``, ``user``, ``experiment_name``, ``trial_name``,
        ``exports`` (one dict per HF export, see :func:`inspect_export`), ``recover``
        (``checkpoints``: step, world size, size, ``checksum``, age), ``recover_info``
        (per-file status, ``consistent``), ``leftovers``, ``lock``, ``warnings``, ``errors``
        and ``valid`` (no errors).

    Raises:
        InspectUsageError: ``trial_dir`` does not exist or is not a folder.

    Example:
        >>> report = inspect_trial("/data/ckpt/checkpoints/alice/ppo-7b/run1", verify=True)  # doctest: +SKIP
        >>> report["valid"], [e["name"] for e in report["exports"]]                           # doctest: +SKIP
        (True, ['epoch0epochstep99globalstep99'])
    """
    path = Path(trial_dir)
    if not path.is_dir():
        raise InspectUsageError(f"{path} does not exist or is not a folder")
    layout = layout_of(path)
    now = time.time()
    errors: list[str] = []
    warnings: list[str] = []
    model_dirs = sorted(c for c in layout.trial_dir.iterdir() if _is_model_dir(c))
    model_names = [d.name for d in model_dirs]
    exports = []
    for d in model_dirs:
        for _parsed, export in layout.list_exports(d.name):
            report = inspect_export(export, now)
            report["model"] = d.name
            exports.append(report)
            for problem in report["problems"]:
                errors.append(f"export {d.name}/{export.name} is incomplete: {problem}")
    recover, info_report = _inspect_recover(layout, model_names, verify, now, errors, warnings)
    leftovers = _leftovers(layout.trial_dir, model_dirs, now)
    lock = _lock_holder(layout.trial_dir)
    running = bool(lock and lock["held"])
    gen = info_report["pending_swap"]
    for item in leftovers:
        name = Path(item["path"]).name
        if gen is not None and name.endswith(f"-{gen}"):
            what = f"part of the interrupted swap of save {gen}; the next start finishes it"
        else:
            what = "left by an interrupted save; the next successful save removes it"
        if running:
            what += f" (pid {lock['holder_pid']} is training this trial: it may be a save in progress)"  # type: ignore[index]
        warnings.append(f"leftover {item['kind']} folder {item['path']}: {what}")
    if not exports and not recover["present"] and not leftovers:
        warnings.append(f"{layout.trial_dir} holds no HF export and no recover checkpoint")
    return {
        "trial_dir": str(layout.trial_dir),
        "fileroot": str(layout.fileroot),
        "user": layout.user,
        "experiment_name": layout.experiment_name,
        "trial_name": layout.trial_name,
        "models": model_names,
        "exports": exports,
        "recover": recover,
        "recover_info": info_report,
        "leftovers": leftovers,
        "memory": inspect_memory(layout, model_names, memory_root, verify),
        "lock": lock,
        "verified": verify,
        "warnings": warnings,
        "errors": errors,
        "valid": not errors,
    }


def _looks_like_trial(path: Path) -> bool:
    if (path / RECOVER_INFO).is_dir() or (path / LOCK_FILE).is_file():
        return True
    try:
        children = list(path.iterdir())
    except OSError:
        return False
    return any(c.name.startswith(f"{TMP_PREFIX}{RECOVER_INFO}-") or _is_model_dir(c) for c in children)


def find_trials(path: str | os.PathLike[str], user: str | None = None, experiment: str | None = None,
                trial: str | None = None) -> list[Path]:
    """Trial folders at or below ``path``.

    ``path`` may be a fileroot (holding ``checkpoints/``), the ``checkpoints`` folder, a user
    or experiment folder below it, or a trial folder itself; ``user``, ``experiment`` and
    ``trial`` filter the trials found.

    Raises:
        InspectUsageError: ``path`` is missing, or neither holds nor is a trial folder.
    """
    root = Path(os.path.abspath(path))
    if not root.exists():
        raise InspectUsageError(f"{root} does not exist")
    if not root.is_dir():
        raise InspectUsageError(f"{root} is not a folder; give a fileroot or a trial folder")
    # depth of the trial folders below `root`
    if (root / "checkpoints").is_dir():
        base, depth = root / "checkpoints", 3
    elif root.name == "checkpoints":
        base, depth = root, 3
    elif root.parent.name == "checkpoints" and not _looks_like_trial(root):
        base, depth = root, 2
    elif root.parent.parent.name == "checkpoints" and not _looks_like_trial(root):
        base, depth = root, 1
    elif _looks_like_trial(root) or root.parent.parent.parent.name == "checkpoints":
        base, depth = root, 0
    else:
        raise InspectUsageError(
            f"{root} is neither a fileroot (no checkpoints/ folder in it) nor a trial folder "
            "({fileroot}/checkpoints/{user}/{experiment}/{trial}); give one of those")
    found = [base]
    for _ in range(depth):
        found = [c for d in found for c in sorted(d.iterdir()) if c.is_dir() and not c.name.startswith(".")]
    trials = []
    for t in found:
        if (user and t.parent.parent.name != user) or (experiment and t.parent.name != experiment) or \
                (trial and t.name != trial):
            continue
        trials.append(t)
    if not trials:
        filters = ", ".join(f"{k}={v}" for k, v in (("user", user), ("experiment", experiment), ("trial", trial)) if v)
        raise InspectUsageError(f"no trial folder found under {root}" + (f" matching {filters}" if filters else ""))
    return trials


def inspect_path(path: str | os.PathLike[str], verify: bool = False, user: str | None = None,
                 experiment: str | None = None, trial: str | None = None,
                 memory_root: str | None = None) -> list[dict[str, Any]]:
    """Inspect every trial at or below ``path`` (a fileroot or a trial folder); see :func:`inspect_trial`.

    Example:
        >>> [r["valid"] for r in inspect_path("/data/ckpt", experiment="ppo-7b")]  # doctest: +SKIP
        [True, True]
    """
    check_path(os.fspath(path), "path")
    if is_remote(os.fspath(path)):
        from areal_lightning.tools.inspect_remote import inspect_remote

        return inspect_remote(os.fspath(path), verify=verify, user=user, experiment=experiment, trial=trial)
    return [inspect_trial(t, verify=verify, memory_root=memory_root) for t in find_trials(path, user, experiment, trial)]


# ---------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------


def _fmt_size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _fmt_age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, div in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= div:
            return f"{s / div:.1f}{unit}"
    return f"{s:.0f}s"


def _fmt(v: Any) -> str:
    return "-" if v is None else str(v)


def render_reports(reports: list[dict[str, Any]], console: Any = None) -> None:
    """Print ``reports`` (from :func:`inspect_path`) as rich tables."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if console is None:
        console = Console(width=None if os.isatty(1) else 160, highlight=False)
    for r in reports:
        status = Text("VALID", style="bold green") if r["valid"] else Text("INVALID", style="bold red")
        console.rule(Text.assemble(f"trial {r['user']}/{r['experiment_name']}/{r['trial_name']}  ", status))
        console.print(Text(f"{r['trial_dir']}"), soft_wrap=True)
        lock = r.get("lock")
        if lock and lock.get("held"):
            console.print(Text(f"being trained now by pid {lock['holder_pid']} (holds {r['trial_dir']}/.lock)",
                               style="yellow"), soft_wrap=True)

        exports = Table(title="HF exports", title_justify="left", expand=False)
        for col, just in (("model", "left"), ("export", "left"), ("epoch", "right"), ("step", "right"),
                          ("global step", "right"), ("size", "right"), ("age", "right"), ("complete", "center")):
            exports.add_column(col, justify=just)  # type: ignore[arg-type]
        for e in r["exports"]:
            exports.add_row(e["model"], e["name"], _fmt(e["epoch"]), _fmt(e["epoch_step"]), _fmt(e["global_step"]),
                            _fmt_size(e["size_bytes"]), _fmt_age(e["age_s"]),
                            Text("yes", style="green") if e["complete"] else Text("NO", style="bold red"))
        if not r["exports"]:
            exports.add_row("-", "(no exports)", "", "", "", "", "", "")
        console.print(exports)

        rec = Table(title="Recover checkpoint", title_justify="left", expand=False)
        for col, just in (("model", "left"), ("global step", "right"), ("epoch", "right"), ("step", "right"),
                          ("world size", "right"), ("strategy", "left"), ("files", "right"), ("size", "right"),
                          ("checksum", "left"), ("age", "right")):
            rec.add_column(col, justify=just)  # type: ignore[arg-type]
        for c in r["recover"]["checkpoints"]:
            style = "green" if c["checksum"] == "ok" else ("yellow" if c["valid"] else "bold red")
            rec.add_row(c["model"], _fmt(c["global_step"]), _fmt(c["epoch"]), _fmt(c["epoch_step"]),
                        _fmt(c["world_size"]), _fmt(c["strategy"]), _fmt(c["num_files"]), _fmt_size(c["size_bytes"]),
                        Text(c["checksum"], style=style), _fmt_age(c["age_s"]))
        if not r["recover"]["checkpoints"]:
            rec.add_row("-", "(none)", *[""] * 8)
        console.print(rec)

        for m in r.get("memory", []):
            tier = Table(title=f"Memory tier ({m['model']}, this node: {m['folder']})", title_justify="left",
                         expand=False)
            for col in ("rank", "steps sealed"):
                tier.add_column(col)
            for rank, steps in m["ranks"].items():
                tier.add_row(rank, ", ".join(map(str, steps)))
            console.print(tier)
            console.print(Text(f"newest step every rank sealed: {_fmt(m['newest_complete_step'])}, "
                               f"{_fmt_size(m['size_bytes'])}, checksum {m['checksum']}"), soft_wrap=True)

        info = r["recover_info"]
        if info["present"]:
            tab = Table(title="recover_info/", title_justify="left", expand=False)
            for name in info["files"]:
                tab.add_column(name.removesuffix(".json"), justify="center")
            tab.add_column("consistent", justify="center")
            tab.add_row(*[Text(st, style="green" if st == "ok" else "bold red") for st in info["files"].values()],
                        Text("yes", style="green") if info["consistent"] else Text("NO", style="bold red"))
            console.print(tab)
        else:
            console.print(Text("recover_info/: none (a new run of this trial starts fresh)"))
        for w in r["warnings"]:
            console.print(Text(f"warning: {w}", style="yellow"), soft_wrap=True)
        for e in r["errors"]:
            console.print(Text(f"error: {e}", style="bold red"), soft_wrap=True)
    bad = sum(1 for r in reports if not r["valid"])
    summary = f"{len(reports)} trial(s), {bad} invalid" + ("" if reports and all(r["verified"] for r in reports)
                                                            else " (checksums not verified; add --verify)")
    console.print(Text(summary, style="bold red" if bad else "bold green"))


def run_inspect(path: str, verify: bool = False, as_json: bool = False, user: str | None = None,
                experiment: str | None = None, trial: str | None = None, memory_root: str | None = None) -> int:
    """The ``inspect`` subcommand: print the report; return 0 (all valid), 1 (something invalid) or 2 (usage)."""
    import sys

    try:
        reports = inspect_path(path, verify=verify, user=user, experiment=experiment, trial=trial,
                               memory_root=memory_root)
    except InspectUsageError as exc:
        print(f"areal-lightning inspect: {exc}", file=sys.stderr)
        return 2
    valid = all(r["valid"] for r in reports)
    if as_json:
        shown = path if is_remote(path) else str(Path(os.path.abspath(path)))
        doc = {"path": shown, "verified": verify, "valid": valid, "trials": reports}
        print(json.dumps(doc, indent=2, sort_keys=False))
    else:
        render_reports(reports)
    return 0 if valid else 1
