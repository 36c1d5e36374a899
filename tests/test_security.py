"""Nothing this plugin writes itself is a pickle; torch.load is always called with weights_only.

Recover checkpoints are DCP directories: DCP's ``.metadata`` and the checkpoint's
non-tensor state are pickles written by torch.distributed.checkpoint (documented in the
README's security note); everything else is JSON, safetensors or plain text.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from safetensors import safe_open

from areal_lightning import HFSaverCallback, RecoverCallback
from tests.conftest import LMModule, make_trainer, tiny_llama, token_loader

PACKAGE = Path(__file__).resolve().parents[1] / "areal_lightning"
PICKLE_OR_ZIP = (b"\x80", b"PK\x03\x04")


def test_no_pickle_outside_dcp_files(tmp_path, tokenizer) -> None:
    common = dict(fileroot=tmp_path, experiment_name="e", trial_name="t", user="u", freq_steps=2)
    make_trainer([HFSaverCallback(mode="async", **common), RecoverCallback(**common)], max_epochs=1).fit(
        LMModule(tiny_llama(), tokenizer=tokenizer), token_loader(n_batches=4))
    trial = tmp_path / "checkpoints" / "u" / "e" / "t"
    checked = 0
    for path in sorted(p for p in trial.rglob("*") if p.is_file()):
        if path.parent.name == "recover_checkpoint":
            continue  # DCP's own format (see the module doc)
        head = path.read_bytes()[:4]
        assert not head.startswith(PICKLE_OR_ZIP), path
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                assert list(f.keys())
        elif path.name == ".lock":
            assert path.read_text().strip().isdigit()
        else:
            raise AssertionError(f"unexpected file written: {path}")
        checked += 1
    assert checked >= 6 + 2 * 4  # recover_info + two exports (config, generation config, weights, tokenizer)


def test_every_torch_load_passes_weights_only() -> None:
    calls = []
    for source in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                base = node.func.value
                if isinstance(base, ast.Name) and base.id == "torch":
                    calls.append((source.name, node.lineno, [k.arg for k in node.keywords]))
    assert calls, "expected torch.load calls in the engine"
    for name, line, keywords in calls:
        assert "weights_only" in keywords, f"{name}:{line} calls torch.load without weights_only"
