"""Commit: the ``recover_hf/{digest}/`` folders of a trial (what ``convert --to hf`` needs
besides the weights: config, generation config, tokenizer, model class; see
:mod:`areal_lightning.capture.hf_meta`). Each folder is written aside and renamed into place,
named by the digest of its files: written once per trial unless the config or the tokenizer
change, and a resumed run finds it written."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from areal_lightning.capture.hf_meta import MODEL_FILE, HFModelEntry
from areal_lightning.capture.hf_weights import model_class, model_dtype
from areal_lightning._torch_internals import PEFT_LOADED_FLAG
from areal_lightning.commit.atomic import write_json
from areal_lightning.layout import RECOVER_HF, tmp_sibling
from areal_lightning.write.hf import save_hf_metadata
from areal_lightning.write.durable import fsync_dir

__all__ = ["HFMetaRecorder"]

log = logging.getLogger(__name__)


def _write_files(entry: HFModelEntry, folder: Path) -> None:
    model = entry.model
    if getattr(model, PEFT_LOADED_FLAG, False):  # save_pretrained would write the adapter's config
        model.config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None and callable(getattr(model, "can_generate", None)) and model.can_generate():
            generation.save_pretrained(folder)
    else:
        # as an export writes them: save_pretrained stamps the config with the model's dtype and
        # class first, so a config written from the live one before the first export differs
        # from one written after it (a second folder, and convert's config.json not the export's)
        save_hf_metadata(model, folder)
    if entry.tokenizer is not None:
        entry.tokenizer.save_pretrained(folder)
    cls = model_class(model)
    dtype = model_dtype(model)
    write_json(folder / MODEL_FILE, {"class": f"{cls.__module__}.{cls.__qualname__}",
                                     "dtype": str(dtype).removeprefix("torch.")})


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _key(entry: HFModelEntry) -> tuple[Any, ...]:
    """What the files of ``entry``'s folder are made from: its config, its tokenizer."""
    return (entry.model.config.to_json_string(), id(entry.tokenizer),
            len(entry.tokenizer) if entry.tokenizer is not None else None)


class HFMetaRecorder:
    """Writes the ``recover_hf/{digest}/`` folders of a trial (rank 0) and describes them."""

    def __init__(self, trial_dir: Path) -> None:
        self.root = Path(trial_dir) / RECOVER_HF
        self._known: dict[str, tuple[Any, str]] = {}  # name -> (what was recorded, its digest)

    def record(self, entries: list[HFModelEntry]) -> dict[str, dict[str, Any]]:
        """``checkpoint_info.json``'s ``hf_models`` for a save taken now; writes new folders."""
        described: dict[str, dict[str, Any]] = {}
        for entry in entries:
            known = self._known.get(entry.name)
            if known is not None and known[0] == _key(entry):
                digest = known[1]
            else:  # (the key read after the write: save_pretrained stamps the config while it writes)
                digest = self._write(entry)
                self._known[entry.name] = (_key(entry), digest)
            described[entry.name] = {"attr": entry.attr, "prefix": entry.prefix,
                                     "max_shard_size": entry.max_shard_size,
                                     "files": f"{RECOVER_HF}/{digest}"}
        return described

    def _write(self, entry: HFModelEntry) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = tmp_sibling(self.root / entry.name)
        tmp.mkdir()
        try:
            _write_files(entry, tmp)
            digest = _digest(tmp)
            final = self.root / digest
            if final.is_dir():  # recorded by an earlier run of the trial
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, final)
                fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.debug("RecoverCallback: HF config and tokenizer of %r in %s", entry.name, final)
        return digest
