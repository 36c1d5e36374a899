"""``notebooks/quickstart.ipynb`` executes headless (nbclient) with a short configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_notebook_is_stored_without_outputs() -> None:
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, cell["source"][:80]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quickstart_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # Short run: 12 steps, crash after 7, recover checkpoints every 3 steps, exports every 5.
    for key, value in {"QS_STEPS": "12", "QS_CRASH_AT": "7", "QS_RECOVER_EVERY": "3", "QS_EXPORT_EVERY": "5",
                       "QS_HIDDEN": "32", "QS_WORKDIR": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this environment
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on any failing cell (the asserts included)

    outputs = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "bit-for-bit identical per-step losses: True" in outputs
    assert "exit code -9" in outputs and "2 trial(s), 0 invalid" in outputs
    assert "weights identical to the uninterrupted run" in outputs
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1 and (tmp_path / "loss.png").stat().st_size > 1000
    # the resumed run really resumed (and the crashed attempt wrote a recover checkpoint first)
    assert "resumed from" in outputs
