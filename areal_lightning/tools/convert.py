"""Tools: a recover checkpoint as an HF folder or as one Lightning checkpoint file.

``areal-lightning convert PATH --to hf --out DIR`` writes the HF folder an ``HFSaverCallback`` would
have exported at the checkpoint's step (the same ``save_pretrained`` on a parameter-less twin of
the model, built from the config and class ``RecoverCallback`` recorded: see
:mod:`areal_lightning.capture.hf_meta`; the tokenizer files as recorded). ``--to lightning --out
FILE.ckpt`` writes the checkpoint dict ``TorchCheckpointIO`` writes, optimizer states keyed by
position, for ``MyModule.load_from_checkpoint`` and ``trainer.fit(model, ckpt_path=FILE)``.
``--to dcp --out DIR`` copies the checkpoint into torch's own DCP layout (tensors as
``torch.save`` items) for a stock ``dcp.load``, which refuses our raw tensor items by name.

Both run on one CPU process without a process group, whatever strategy and world size wrote the
checkpoint: each tensor is read whole (from every rank's shard), verified against its CRC32C,
into a memory map of a scratch file beside the output (unlinked at once), so the process's own
memory holds about one tensor at a time plus what the writer buffers (``save_pretrained``: one
safetensors shard, ``max_shard_size``). The output is written under a temporary name and
renamed into place when complete; an existing non-empty output is never overwritten.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from areal_lightning.capture.hf_meta import MODEL_FILE, recorded_model
from areal_lightning.capture.optimizer_names import is_by_name
from areal_lightning.errors import AreaLightningError, ConfigError
from areal_lightning.layout import CHECKPOINT_INFO, COMMIT_MARKER, RECOVER_CHECKPOINT, TMP_PREFIX
from areal_lightning.write.durable import fsync_dir

__all__ = ["convert", "CONVERT_TARGETS", "ConvertError"]

log = logging.getLogger(__name__)

CONVERT_TARGETS = ("hf", "lightning", "dcp")
"""What ``convert`` writes: an HF model folder, one Lightning checkpoint file, or a DCP folder
in torch's own layout (for a stock ``dcp.load``; ours stores tensors as raw bytes)."""

_NOT_TOKENIZER = {"config.json", "generation_config.json", MODEL_FILE}
_ALIGN = 64


class ConvertError(AreaLightningError, ValueError):
    """``convert`` cannot make the output from what it was given (the message says why and what to pass)."""


@dataclass
class _Source:
    ckpt_dir: Path | str
    trial_dir: Path | str | None
    info: dict[str, dict[str, Any]]


def _remote_source(uri: str) -> _Source:
    """The newest committed recover checkpoint of the one trial at or below ``uri`` (an object
    store: ``s3://``, ``gs://``, ``az://``), or the checkpoint at ``uri`` itself (a committed
    generation, or a folder ``DCPCheckpointIO`` wrote there); read in place, item by item."""
    from areal_lightning.commit.generations import Generations
    from areal_lightning.commit.object_recover_store import ObjectRecoverStore
    from areal_lightning.layout import TrialLayout
    from areal_lightning.objectstore import filesystem, join, strip
    from areal_lightning.tools.inspect_remote import find_remote_trials

    uri = uri.rstrip("/")
    fs = filesystem(uri)
    if fs.exists(strip(fs, join(uri, COMMIT_MARKER))):  # a checkpoint folder itself
        return _Source(uri, None, {})
    generations = Generations(uri)
    newest = generations.newest()
    if newest is not None and fs.exists(strip(fs, join(generations.uri(newest[0]), COMMIT_MARKER))):
        return _Source(generations.uri(newest[0]), None, {})  # a checkpoint path: its newest generation
    trials = find_remote_trials(uri)
    if len(trials) != 1:
        raise ConvertError(f"{uri} holds {len(trials)} trials ({', '.join(trials[:5])}); pass one trial "
                           "{fileroot}/checkpoints/{user}/{experiment}/{trial}")
    trial = trials[0]
    fileroot, user, experiment, name = trial.rsplit("/", 4)[0], *trial.split("/")[-3:]
    layout = TrialLayout(fileroot, user, experiment, name)
    models = sorted(base for entry in fs.ls(strip(fs, trial), detail=True, refresh=True)
                    if entry.get("type") == "directory" and fs.exists(strip(fs, join(
                        trial, base := entry["name"].rstrip("/").rsplit("/", 1)[-1], RECOVER_CHECKPOINT))))
    store = ObjectRecoverStore(layout, "default" if "default" in models or not models else models[0])
    if not store.exists():
        raise ConvertError(f"{trial} has no committed recover checkpoint ({store.info_dir})")
    info = store.read_info()
    store.verify(info[CHECKPOINT_INFO], data=None)  # presence, sizes, .metadata; items as they are read
    return _Source(store.checkpoint_path(), trial, info)


def _export_files(source: _Source, name: str) -> Path | None:
    """For a checkpoint on an object store (which records no HF model files): the config and
    tokenizer files of the trial's newest committed HF export of model ``name`` (downloaded,
    weights left out), as ``hf_config``; ``None``: the trial has no such export."""
    from areal_lightning.commit.generations import MARKER
    from areal_lightning.commit.upload import committed_exports
    from areal_lightning.objectstore import filesystem, join, strip

    if not isinstance(source.trial_dir, str):
        return None
    exports = committed_exports(join(source.trial_dir, name))
    if not exports:
        return None
    uri = exports[-1][1]
    fs = filesystem(uri)
    folder = Path(tempfile.mkdtemp(prefix="areal-convert-hf-files-"))
    atexit.register(shutil.rmtree, folder, True)
    for entry in fs.ls(strip(fs, uri), detail=True, refresh=True):
        base = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        weights = "safetensors" in base or base.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack"))
        if entry.get("type") == "file" and base != MARKER and not weights:  # config, generation config, tokenizer
            fs.get_file(entry["name"], str(folder / base))
    log.info("convert: %s records no HF model files (an object store): the config and tokenizer of its export %s",
             source.trial_dir, uri)
    return folder


def _source(path: str | os.PathLike[str]) -> _Source:
    """The recover checkpoint at ``path``: a ``recover_checkpoint/`` folder, a trial folder, or a
    fileroot (or folder below it) holding exactly one trial; checked against its manifest. (A
    trial has one, in the folder of the ``RecoverCallback``'s name, ``default/`` unless named.)
    Or a trial's memory tier folder (``{root}/{user}/{experiment}/{trial}/{name}``): its newest
    step every rank sealed, every rank's slot merged as the shared tier's checkpoint of it."""
    from areal_lightning.commit.memory_tier import is_tier_folder, newest_complete_step
    from areal_lightning.commit.recover_store import RecoverStore, check_info
    from areal_lightning.write.persist import merged_view
    from areal_lightning.objectstore import is_remote
    from areal_lightning.tools.inspect import find_trials, layout_of, pending_swap

    if is_remote(path):
        return _remote_source(str(path))
    given = Path(path)
    if is_tier_folder(given):  # a memory tier: its newest step every rank sealed, merged as the shared tier's
        newest = newest_complete_step(given)
        if newest is None:
            raise ConvertError(f"{given} is a memory tier folder but holds no step that every rank sealed")
        step, seals = newest
        view = Path(tempfile.mkdtemp(prefix="areal-convert-view-"))
        atexit.register(shutil.rmtree, view, True)
        log.info("convert: %s: the memory tier's global step %d (every rank's slot verified as it is read)",
                 given, step)
        return _Source(merged_view([s.path for s in seals], view), None, seals[0].info)
    if (given / COMMIT_MARKER).is_file():
        trial = given.parent.parent if given.name == RECOVER_CHECKPOINT else None
        if trial is None or not (trial / "recover_info").is_dir():
            return _Source(given, None, {})
        trials = [trial]
    else:
        if not given.is_dir():
            raise ConvertError(f"{given} does not exist")
        trials = find_trials(given)
        if len(trials) != 1:
            found = ", ".join(str(t) for t in trials[:5]) or "none"
            raise ConvertError(f"{given} holds {len(trials)} trials ({found}); pass one trial folder "
                               "{fileroot}/checkpoints/{user}/{experiment}/{trial} or its recover_checkpoint/")
    layout = layout_of(trials[0])
    folders = sorted(p.name for p in layout.trial_dir.iterdir() if (p / RECOVER_CHECKPOINT).is_dir())
    name = "default" if "default" in folders or not folders else folders[0]
    store = RecoverStore(layout, name)
    pending = pending_swap(layout, name)
    if pending is not None:  # a crash inside the swap: the pair the next start rolls forward to
        _gen, store.info_dir, store.ckpt_dir = pending
    if not store.exists() and pending is None:
        raise ConvertError(f"{layout.trial_dir} has no recover checkpoint ({store.ckpt_dir} with {store.info_dir})")
    info = check_info(store.read_info(), store.info_dir)
    store.verify(info[CHECKPOINT_INFO], data=None)  # presence, sizes, .metadata; items as they are read
    return _Source(store.ckpt_dir, layout.trial_dir, info)


def _mapped(entries: Mapping[str, tuple[tuple[int, ...], torch.dtype]], scratch: Path) -> dict[str, torch.Tensor]:
    """Zero tensors of the given sizes in shared memory maps of scratch files (one per dtype, as
    ``torch.save`` wants one type per storage), unlinked at once: the pages are the page cache's,
    written back to the disk under memory pressure rather than held by the process."""
    out: dict[str, torch.Tensor] = {}
    for dtype in dict.fromkeys(dtype for _size, dtype in entries.values()):
        group = {key: size for key, (size, d) in entries.items() if d == dtype}
        offsets, total = {}, 0
        for key, size in group.items():
            offsets[key] = total
            total += -(-max(torch.Size(size).numel(), 1) * dtype.itemsize // _ALIGN) * _ALIGN // dtype.itemsize
        path = scratch.with_name(f"{scratch.name}-{str(dtype).removeprefix('torch.')}")
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=max(total * dtype.itemsize, _ALIGN))
        path.unlink()
        out.update({key: torch.empty(0, dtype=dtype).set_(storage, offsets[key], size) for key, size in group.items()})
    return {key: out[key] for key in entries}


def _fresh_output(out: Path) -> Path:
    """``out``'s temporary sibling; refuses an existing non-empty ``out``."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"{out} already exists; give a new path (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.parent / f"{TMP_PREFIX}{out.name}-{uuid.uuid4().hex[:8]}"


def _publish(tmp: Path, out: Path) -> None:
    if out.is_dir():
        out.rmdir()  # empty (checked before writing)
    os.rename(tmp, out)
    fsync_dir(out.parent)


def _hf_model(source: _Source, name: str, model_attr: str | None,
              hf_config: str | os.PathLike[str] | None) -> tuple[Any, str, Path, int | str]:
    """The parameter-less model to write with, the state-dict prefix of its weights, the folder of
    its config and tokenizer files, and ``max_shard_size``."""
    from areal_lightning.write.hf import DEFAULT_MAX_SHARD_SIZE

    recorded = source.info.get(CHECKPOINT_INFO, {}).get("hf_models", {})
    if hf_config is not None:
        from transformers import AutoConfig

        files = Path(hf_config)
        if not (files / "config.json").is_file():
            raise ConfigError("hf_config", f"{files} has no config.json (a folder as save_pretrained writes it)")
        config = AutoConfig.from_pretrained(files)
        if (files / MODEL_FILE).is_file():
            cls, dtype = recorded_model(files)
        else:
            import transformers

            arch = (config.architectures or [None])[0]
            cls = getattr(transformers, arch, None) if arch else None
            if cls is None:
                raise ConfigError("hf_config", f"{files / 'config.json'} names no model class transformers has "
                                  f"(architectures={config.architectures!r})")
            dtype = None
        prefix = f"{model_attr or (recorded.get(name, {}).get('attr')) or 'model'}."
        max_shard = recorded.get(name, {}).get("max_shard_size", DEFAULT_MAX_SHARD_SIZE)
    elif name in recorded:
        entry = recorded[name]
        files = source.trial_dir / entry["files"]  # type: ignore[operator]
        cls, dtype = recorded_model(files)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(files)
        prefix = f"{model_attr}." if model_attr else entry["prefix"]
        max_shard = entry["max_shard_size"]
    else:
        where = f"{source.trial_dir}/recover_info/{CHECKPOINT_INFO}" if source.trial_dir else str(source.ckpt_dir)
        raise ConvertError(
            f"{where} records no HF model named {name!r} (recorded: {sorted(recorded) or 'none'}: the run had no "
            "HFSaverCallback of that name and no PreTrainedModel attribute, or it was written before 0.2.0). Pass "
            "hf_config (--hf-config DIR: a folder with the model's config.json and tokenizer files) and model_attr "
            "(--model-attr ATTR: the LightningModule attribute holding the model)")
    with torch.device("meta"):
        model = cls(config)
    if dtype is not None:
        model.to(dtype=dtype)
    if (files / "generation_config.json").is_file() and getattr(model, "generation_config", None) is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(files)
    return model, prefix, files, max_shard


def _tied(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the names of one tied parameter (GPT-2's ``lm_head.weight`` and
    ``transformer.wte.weight``) on one tensor, as in the live model: ``save_pretrained`` writes a
    tied weight once, as it does for the live model's export."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for group in names.values():
        present = [name for name in group if name in state]
        for name in present[1:]:
            state[name] = state[present[0]]
    return state


def _to_hf(source: _Source, out: Path, name: str, model_attr: str | None,
           hf_config: str | os.PathLike[str] | None) -> None:
    from areal_lightning.write.offline import read_tensors, tensor_entries
    from areal_lightning.write.hf import write_hf

    model, prefix, files, max_shard = _hf_model(source, name, model_attr, hf_config)
    head = f"state_dict.{prefix}"
    entries = {key: value for key, value in tensor_entries(source.ckpt_dir).items() if key.startswith(head)}
    if not entries:
        some = sorted(k[len("state_dict."):] for k in tensor_entries(source.ckpt_dir) if k.startswith("state_dict."))
        raise ConvertError(f"{source.ckpt_dir} holds no weights under {prefix!r} (model keys: {some[:4]} ...); "
                           "pass model_attr (--model-attr) naming the attribute that holds the model")
    tmp = _fresh_output(out)
    tmp.mkdir()
    try:
        tensors = _mapped(entries, tmp.parent / f"{TMP_PREFIX}{out.name}-scratch-{uuid.uuid4().hex[:8]}")
        read = read_tensors(source.ckpt_dir, tensors)
        state = _tied(model, {key[len(head):]: tensor for key, tensor in tensors.items()})
        write_hf(model, tmp, None, state_dict=state, max_shard_size=max_shard)
        for item in sorted(files.iterdir()):
            if item.is_file() and item.name not in _NOT_TOKENIZER:
                shutil.copyfile(item, tmp / item.name)  # the tokenizer files, as its save_pretrained wrote them
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("convert: %s -> %s (%d tensors, %.1f MB read and verified)", source.ckpt_dir, out, len(state),
             read.nbytes / 1e6)


def _positional(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name in ``Optimizer.state_dict()``'s positional form
    (positions in the order of the saved groups' parameter lists, the optimizer's own order)."""
    if not is_by_name(state):
        return state
    index_of = {fqn: i for i, fqn in enumerate(p for group in state["param_groups"] for p in group["params"])}
    return {**state, "state": {index_of[fqn]: value for fqn, value in state["state"].items()},
            "param_groups": [{**group, "params": [index_of[p] for p in group["params"]]}
                             for group in state["param_groups"]]}


def _to_lightning(source: _Source, out: Path, weights_only: bool) -> None:
    from areal_lightning.write.dcp import DCPEngine
    from areal_lightning.write.offline import tensor_entries

    if out.exists():
        raise ConvertError(f"{out} already exists; give a new path (nothing was written)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        tensors = _mapped(tensor_entries(source.ckpt_dir), out.parent / f"{tmp.name}-scratch")
        checkpoint = DCPEngine().load(source.ckpt_dir, template=tensors, weights_only=weights_only, read_threads=1)
        checkpoint["optimizer_states"] = [_positional(s) for s in checkpoint.get("optimizer_states", [])]
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("convert: %s -> %s (Lightning checkpoint of global step %s)", source.ckpt_dir, out,
             checkpoint.get("global_step"))


def _to_dcp(source: _Source, out: Path) -> None:
    from areal_lightning.write.offline import write_stock_copy

    tmp = _fresh_output(out)
    try:
        write_stock_copy(source.ckpt_dir, tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("convert: %s -> %s (DCP checkpoint in torch's FileSystemWriter layout)", source.ckpt_dir, out)


def convert(path: str | os.PathLike[str], to: str, out: str | os.PathLike[str], *, name: str = "default",
            model_attr: str | None = None, hf_config: str | os.PathLike[str] | None = None,
            weights_only: bool = True) -> Path:
    """Write the recover checkpoint at ``path`` as an HF folder (``to="hf"``), one Lightning
    checkpoint file (``to="lightning"``) or a DCP folder that a stock ``dcp.load`` reads
    (``to="dcp"``) at ``out``; returns ``out``.

    Args:
        path: a fileroot holding one trial, a trial folder, or a ``recover_checkpoint/`` folder
            (``dcp`` also: any checkpoint folder ``DCPCheckpointIO`` wrote); local, or on an object
            store (``s3://``, ``gs://``, ``az://``: read in place, item by item, each verified; an
            HF export of the trial gives ``--to hf`` its config and tokenizer files).
        to: one of :data:`CONVERT_TARGETS`.
        out: the folder (``hf``, ``dcp``) or file (``lightning``) to create; must not exist (or be empty).
        name: the HF model to write (``HFSaverCallback(name=...)``, e.g. ``"critic"``);
            ``"default"``: the one of ``HFSaverCallback()`` or the module's ``model`` attribute.
        model_attr: the LightningModule attribute holding the HF model, where the checkpoint
            records none or another one is wanted (e.g. ``"critic"``).
        hf_config: a folder with ``config.json`` (and tokenizer files) for a checkpoint that
            records no HF model (written before 0.2.0, or a model no callback knew).
        weights_only: unpickle the checkpoint's non-tensor state with ``weights_only`` (pass
            ``False`` only for checkpoints from trusted storage that hold other objects).

    Example:
        >>> convert("runs/checkpoints/me/exp/trial0", "hf", "export/step1000")  # doctest: +SKIP
    """
    if to not in CONVERT_TARGETS:
        raise ConfigError("to", f"unknown target {to!r}; allowed: {', '.join(CONVERT_TARGETS)}")
    source = _source(path)
    target = Path(out)
    if to == "hf" and hf_config is None and name not in source.info.get(CHECKPOINT_INFO, {}).get("hf_models", {}):
        hf_config = _export_files(source, name)
    if to == "hf":
        _to_hf(source, target, name, model_attr, hf_config)
    elif to == "dcp":
        _to_dcp(source, target)
    else:
        _to_lightning(source, target, weights_only)
    return target
