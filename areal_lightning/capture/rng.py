"""RNG state of one process: Python ``random``, NumPy's global generator, torch CPU and CUDA.

The captured state holds only tensors, ints, strings and lists, so it round-trips through
DCP and ``torch.load(weights_only=True)`` (no NumPy arrays, no pickled objects).
:func:`raw_state` / :func:`set_raw_state` are the CPU part in a form that is cheap to pickle
(DataLoader workers send it with every batch); :func:`to_saved` / :func:`from_saved` convert
it to and from the saved form.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "raw_state", "set_raw_state", "to_saved", "from_saved"]


def raw_state() -> tuple[bytes, Any, Any]:
    """This process's torch CPU, ``random`` and NumPy RNG states, cheap to pickle (no tensors:
    they would go through shared memory between processes)."""
    return torch.get_rng_state().numpy().tobytes(), random.getstate(), np.random.get_state()


def set_raw_state(state: tuple[bytes, Any, Any]) -> None:
    """Set this process's CPU RNGs to a :func:`raw_state`."""
    torch_bytes, py, npst = state
    torch.set_rng_state(torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8))
    random.setstate(py)
    np.random.set_state(npst)


def to_saved(state: tuple[bytes, Any, Any]) -> dict[str, Any]:
    """A :func:`raw_state` as checkpoint content (tensors, ints, strings; loads with ``weights_only``)."""
    torch_bytes, (version, internal, gauss), (kind, keys, pos, has_gauss, cached) = state
    return {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                       "gauss": gauss if gauss is not None else "none"},
            "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8).clone()}


def from_saved(saved: dict[str, Any]) -> tuple[bytes, Any, Any]:
    """The :func:`raw_state` of a :func:`to_saved` dict (or of a :func:`capture_rng` one)."""
    py, npst = saved["python"], saved["numpy"]
    gauss = None if py["gauss"] == "none" else py["gauss"]
    return (saved["torch"].to(torch.uint8).cpu().numpy().tobytes(),
            (py["version"], tuple(int(x) for x in py["state"].tolist()), gauss),
            (npst["kind"], npst["keys"].numpy().astype(np.uint32), int(npst["pos"]), int(npst["has_gauss"]),
             float(npst["cached_gaussian"])))


def capture_rng() -> dict[str, Any]:
    """The current RNG states of this process."""
    state = to_saved(raw_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNGs to a state from :func:`capture_rng`."""
    set_raw_state(from_saved(state))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])
