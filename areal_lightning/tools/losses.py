"""The loss log: one JSON line per optimizer step, used by ``certify``, the demo and the tests.

A line is ``{"step": int, "loss": float.hex() | JSON value, ...}`` (other keys such as ``"rank"``,
``"epoch"``, ``"pid"`` or an ``"event"`` line may be present); every line is appended with one
``write`` on an ``O_APPEND`` file, so a SIGKILL never leaves half a line and several ranks may
share a file. Losses are stored as ``float.hex()``: bitwise comparable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ENV_LOSSES", "loss_value", "append_line", "record_loss", "read_losses", "LossRecorder"]

ENV_LOSSES = "AREAL_LIGHTNING_CERTIFY_LOSSES"
"""The loss log ``record_loss`` appends to (set by ``certify`` for the runs it starts)."""


def loss_value(loss: Any) -> Any:
    """A loss as the log stores it: floats and 0-d tensors as ``float.hex()``, any other JSON value as is."""
    if hasattr(loss, "item"):
        loss = loss.item()
    return loss.hex() if isinstance(loss, float) else loss


def append_line(path: str | Path, row: dict[str, Any]) -> None:
    """Append ``row`` as one JSON line with one ``write`` (``O_APPEND``)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def record_loss(step: int, loss: Any, rank: int = 0) -> None:
    """Append ``{"step", "loss", "rank"}`` to ``$AREAL_LIGHTNING_CERTIFY_LOSSES`` (no-op when unset)."""
    path = os.environ.get(ENV_LOSSES)
    if path:
        append_line(path, {"step": int(step), "loss": loss_value(loss), "rank": int(rank)})


def read_losses(path: Path) -> dict[tuple[int, int], set[Any]]:
    """``{(rank, step): {loss, ...}}`` of a loss log (a step replayed after a resume adds to the
    set; lines without a ``"step"``, such as event lines, are skipped). A line that is not a loss
    record is a ``ValueError`` naming the file and the line."""
    out: dict[tuple[int, int], set[Any]] = {}
    if not Path(path).is_file():
        return out
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "event" in row and "step" not in row:
                continue
            key = (int(row.get("rank", 0)), int(row["step"]))
            loss = json.dumps(row["loss"], sort_keys=True)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{n}: not a loss record {{\"step\", \"loss\"[, \"rank\"]}}: "
                             f"{line[:200]!r}") from exc
        out.setdefault(key, set()).add(loss)
    return out


_LOSS_RECORDER: type | None = None


def _loss_recorder_class() -> type:
    global _LOSS_RECORDER
    if _LOSS_RECORDER is None:
        import lightning.pytorch as pl

        class LossRecorder(pl.Callback):
            """Records the training loss of every optimizer step for ``areal-lightning certify``.

            Add it to the Trainer's callbacks; it writes nothing unless the run is started by
            ``certify`` (``$AREAL_LIGHTNING_CERTIFY_LOSSES`` set). The step is
            ``trainer.global_step`` after the step (1-based), the rank ``trainer.global_rank``,
            the loss the one ``training_step`` returned (divided by ``accumulate_grad_batches``,
            as Lightning reports it; with gradient accumulation the last micro-batch's).
            It runs before ``RecoverCallback`` saves the step (that callback runs last).
            """

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                   batch_idx: int) -> None:
                loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
                if loss is not None:
                    record_loss(trainer.global_step, loss, trainer.global_rank)

        LossRecorder.__module__ = "areal_lightning.tools.certify"  # where users import it from
        _LOSS_RECORDER = LossRecorder
    return _LOSS_RECORDER


def __getattr__(name: str) -> Any:  # LossRecorder without importing Lightning for the CLI
    if name == "LossRecorder":
        return _loss_recorder_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
