"""``areal-lightning inspect s3://...``: the trial report of :mod:`areal_lightning.tools.inspect`
for object-store fileroots (read-only), from listings and the commit markers.

An export or recover generation counts only with its ``COMMITTED.json`` marker; folders
without one (interrupted uploads, removed after the next commit) are reported as leftovers,
as are the incomplete multipart uploads under the trial.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from typing import Any

from areal_lightning.commit.generations import MARKER, Generations
from areal_lightning.commit.manifest import check_files
from areal_lightning.commit.recover_store import check_info
from areal_lightning.commit.upload import exports_of
from areal_lightning.errors import InspectUsageError, CheckpointCorruptError, start_fresh
from areal_lightning.layout import (
    CHECKPOINT_INFO,
    HF_INDEX,
    HF_WEIGHTS,
    INFO_FILES,
    RECOVER_CHECKPOINT,
    RECOVER_INFO,
    STEP_INFO,
    TrialLayout,
)
from areal_lightning.objectstore import filesystem, join, list_uploads, name, strip

__all__ = ["inspect_remote", "find_remote_trials", "inspect_remote_trial"]


def _age(iso: Any, now: float) -> float | None:
    try:
        return max(0.0, now - _dt.datetime.fromisoformat(str(iso)).timestamp())
    except ValueError:
        return None


def _dirs(fs: Any, uri: str) -> list[str]:
    try:
        entries = fs.ls(strip(fs, uri), detail=True, refresh=True)
    except FileNotFoundError:
        return []
    return sorted(name(e["name"]) for e in entries if e.get("type") == "directory")


def find_remote_trials(path: str, user: str | None = None, experiment: str | None = None,
                       trial: str | None = None, storage_options: Any = None) -> list[str]:
    """Trial prefixes at or below ``path`` (a fileroot, its ``checkpoints/``, a user, experiment
    or trial prefix), filtered by ``user`` / ``experiment`` / ``trial``."""
    fs = filesystem(path, storage_options)
    fs.invalidate_cache()
    root = path.rstrip("/")
    parts = strip(fs, root).split("/")[1:]  # below the bucket
    below = parts[parts.index("checkpoints") + 1:] if "checkpoints" in parts else None
    children = _dirs(fs, root)
    if below is None and "checkpoints" in children:
        base, depth = join(root, "checkpoints"), 3
    elif below is not None and len(below) <= 3:
        base, depth = root, 3 - len(below)
    elif RECOVER_INFO in children:
        base, depth = root, 0
    else:
        raise InspectUsageError(f"{root} is neither a fileroot (no checkpoints/ in it) nor a trial "
                                "({fileroot}/checkpoints/{user}/{experiment}/{trial}); give one of those")
    found = [base]
    for _ in range(depth):
        found = [join(d, c) for d in found for c in _dirs(fs, d) if not c.startswith(".")]
    trials = []
    for t in found:
        u, e, n = t.split("/")[-3:]
        if (user and u != user) or (experiment and e != experiment) or (trial and n != trial):
            continue
        trials.append(t)
    if not trials:
        raise InspectUsageError(f"no trial found under {root}")
    return trials


def _export_report(uri: str, committed: bool, parsed: Any, fs: Any, now: float) -> dict[str, Any]:
    problems: list[str] = []
    marker: dict[str, Any] = {}
    if committed:
        try:
            marker = json.loads(fs.cat_file(strip(fs, join(uri, MARKER))))
        except (FileNotFoundError, ValueError) as exc:
            problems.append(f"{join(uri, MARKER)} is unreadable: {exc}")
    else:
        problems.append(f"{uri} has no {MARKER}: an interrupted upload (removed after the next export)")
    files: dict[str, int] = marker.get("files", {}) if isinstance(marker.get("files"), dict) else {}
    listing = {name(e["name"]): e.get("size") for e in fs.ls(strip(fs, uri), detail=True, refresh=True)
               if e.get("type") == "file"}
    for rel, size in sorted(files.items()):
        if "/" not in rel and listing.get(rel) != size:
            problems.append(f"{join(uri, rel)}: {listing.get(rel)} bytes, its marker records {size}")
    if committed and "config.json" not in files:
        problems.append(f"{uri} has no config.json")
    if committed and HF_WEIGHTS not in files and HF_INDEX not in files:
        problems.append(f"{uri} has no {HF_WEIGHTS} and no {HF_INDEX}: the weights are missing")
    return {
        "name": name(uri), "path": uri, "epoch": parsed.epoch, "epoch_step": parsed.epoch_step,
        "global_step": parsed.global_step, "size_bytes": sum(files.values()) if files else sum(
            v or 0 for v in listing.values()), "mtime": marker.get("commit_time"),
        "age_s": _age(marker.get("commit_time"), now),
        "weight_files": sorted(f for f in files if f.endswith(".safetensors")),
        "has_tokenizer": "tokenizer_config.json" in files, "complete": not problems, "problems": problems,
    }


def inspect_remote_trial(trial_dir: str, verify: bool = False, storage_options: Any = None) -> dict[str, Any]:
    """The report of :func:`areal_lightning.tools.inspect.inspect_trial` for a trial prefix on an object store."""
    trial_dir = trial_dir.rstrip("/")
    fileroot, user, experiment, trial = trial_dir.rsplit("/", 4)[0], *trial_dir.split("/")[-3:]
    layout = TrialLayout(fileroot, user, experiment, trial)
    fs = filesystem(trial_dir, storage_options)
    now = time.time()
    errors: list[str] = []
    warnings: list[str] = []
    models = [m for m in _dirs(fs, trial_dir) if m != RECOVER_INFO and not m.startswith(".")]
    exports, leftovers = [], []
    for model in models:
        for parsed, uri, committed in exports_of(layout.model_dir(model), storage_options):
            report = _export_report(uri, committed, parsed, fs, now)
            report["model"] = model
            if committed:
                exports.append(report)
                errors += [f"export {model}/{report['name']} is incomplete: {p}" for p in report["problems"]]
            else:
                leftovers.append({"path": uri, "kind": "uncommitted export", "size_bytes": report["size_bytes"],
                                  "age_s": None})
    infos = Generations(layout.recover_info_dir, storage_options)
    committed_infos = infos.committed()
    info_report: dict[str, Any] = {"path": layout.recover_info_dir, "present": bool(committed_infos), "files": {},
                                   "consistent": None, "problems": [], "pending_swap": None}
    recover: dict[str, Any] = {"present": bool(committed_infos), "checkpoints": []}
    newest = committed_infos[-1][1] if committed_infos else None
    for gen in infos.names():
        if gen != newest:
            leftovers.append({"path": infos.uri(gen), "kind": "uncommitted generation" if gen not in
                              {g for _, g, _ in committed_infos} else "older generation", "size_bytes": None,
                              "age_s": None})
    for model in models:
        data = Generations(layout.recover_checkpoint_dir(model), storage_options)
        for gen in data.names():
            if gen != newest:
                leftovers.append({"path": data.uri(gen), "kind": "uncommitted generation", "size_bytes": None,
                                  "age_s": None})
    if newest is not None:
        info: dict[str, Any] = {}
        for file in INFO_FILES:
            try:
                info[file] = json.loads(fs.cat_file(strip(fs, infos.uri(newest, file))))
                info_report["files"][file] = "ok" if isinstance(info[file], dict) else "invalid"
            except FileNotFoundError:
                info_report["files"][file] = "missing"
            except ValueError:
                info_report["files"][file] = "invalid"
        try:
            check_info(info, infos.uri(newest))
            info_report["consistent"] = True
        except (CheckpointCorruptError, KeyError) as exc:
            info_report["consistent"] = False
            info_report["problems"].append(str(exc))
            errors.append(f"recover_info: {exc}")
        ckpt, step = info.get(CHECKPOINT_INFO, {}), info.get(STEP_INFO, {})
        for model in models:
            data = Generations(layout.recover_checkpoint_dir(model), storage_options)
            if newest not in data.names():
                continue
            prefix = data.uri(newest)
            files = ckpt.get("files") if isinstance(ckpt.get("files"), dict) else {}
            entry: dict[str, Any] = {
                "model": model, "path": prefix, "size_bytes": sum(f.get("size", 0) for f in files.values()),
                "num_files": len(files), "global_step": step.get("global_step"),
                "steps_done": ckpt.get("global_step"), "epoch": step.get("epoch"),
                "epoch_step": step.get("epoch_step"), "world_size": ckpt.get("world_size"),
                "strategy": ckpt.get("strategy"), "io_mode": ckpt.get("io_mode"),
                "commit_time": committed_infos[-1][2].get("commit_time"),
                "age_s": _age(committed_infos[-1][2].get("commit_time"), now), "mtime": None,
                "checksum": "unknown", "valid": False, "problems": [],
            }
            hint = f"the recover checkpoint is damaged; {start_fresh(layout.recover_info_dir)}"
            try:
                check_files(prefix, files, infos.uri(newest, CHECKPOINT_INFO), hint, data=verify,
                            storage_options=storage_options)
                entry.update(checksum="ok" if verify else "not verified", valid=True)
            except CheckpointCorruptError as exc:
                entry["checksum"] = "corrupt" if verify else "broken"
                entry["problems"].append(str(exc))
                errors.append(f"recover checkpoint: {exc}")
            recover["checkpoints"].append(entry)
        if not recover["checkpoints"]:
            msg = f"{infos.uri(newest)} is committed but no model folder has {RECOVER_CHECKPOINT}/{newest}/"
            errors.append(msg)
            info_report["problems"].append(msg)
    for item in leftovers:
        warnings.append(f"leftover {item['kind']} {item['path']}: left by an interrupted save; the next commit "
                        "removes it")
    for key in list_uploads(trial_dir, storage_options):
        warnings.append(f"incomplete multipart upload of {key}: left by an interrupted save; the next commit "
                        "aborts it")
    if not exports and not recover["present"] and not leftovers:
        warnings.append(f"{trial_dir} holds no HF export and no recover checkpoint")
    return {
        "trial_dir": trial_dir, "fileroot": fileroot, "user": user, "experiment_name": experiment,
        "trial_name": trial, "models": models, "exports": exports, "recover": recover,
        "recover_info": info_report, "leftovers": leftovers, "lock": None, "verified": verify,
        "warnings": warnings, "errors": errors, "valid": not errors,
    }


def inspect_remote(path: str, verify: bool = False, user: str | None = None, experiment: str | None = None,
                   trial: str | None = None, storage_options: Any = None) -> list[dict[str, Any]]:
    """Inspect every trial at or below the object-store ``path``."""
    return [inspect_remote_trial(t, verify, storage_options)
            for t in find_remote_trials(path, user, experiment, trial, storage_options)]
