"""The README's Python blocks run, in order, in one namespace (like a doctest session)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_python_blocks_run(tmp_path, monkeypatch, capsys) -> None:
    blocks = python_blocks((REPO / "README.md").read_text())
    assert len(blocks) >= 5
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the message names the block
            raise AssertionError(f"README python block {i + 1} failed: {exc!r}\n{block}") from exc
    out = capsys.readouterr().out
    assert "resumed after step 3" in out  # the crash-and-resume block resumed after its 4th step
    assert (tmp_path / "dcp" / "epoch1" / ".metadata").exists()
    assert os.path.isdir(tmp_path / "ckpt" / "checkpoints" / "alice" / "quickstart" / "run1" / "default")


def test_docstring_examples_run() -> None:
    """The examples in the public docstrings are doctests."""
    import doctest

    import areal_lightning.commit.atomic as atomic
    import areal_lightning.config as config
    import areal_lightning.layout as layout
    import areal_lightning.lightning as callbacks
    import areal_lightning.lightning.hf_saver as hf_saver
    import areal_lightning.lightning.recover as recover
    import areal_lightning.trigger.freq as freq
    import areal_lightning.trigger.gate as gate
    import areal_lightning.trigger.preempt as preempt
    import areal_lightning.trigger.step as step

    for module in (config, freq, layout, callbacks, hf_saver, recover, atomic, gate, step, preempt):
        failed, attempted = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert failed == 0, module.__name__
        assert attempted > 0, module.__name__
