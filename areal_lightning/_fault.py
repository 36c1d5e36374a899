"""Fault-injection points for the checkpoint path (testing only).

Enabled only by the environment variable ``AREAL_LIGHTNING_FAULT``; otherwise each
:func:`fault_point` call is one dictionary lookup. The variable holds comma-separated
``point[:action][@N]`` entries; ``action`` is ``raise`` (default: raise :class:`InjectedFault`)
or ``kill`` (SIGKILL this process, as a power cut or OOM killer would); ``@N`` fires at the
N-th time this process reaches the point (default: every time).
"""

from __future__ import annotations

import collections
import os
import signal

ENV_VAR = "AREAL_LIGHTNING_FAULT"
_hits: collections.Counter[str] = collections.Counter()


class InjectedFault(RuntimeError):
    """Raised at a fault point named in ``AREAL_LIGHTNING_FAULT`` with action ``raise``."""


def fault_point(name: str) -> None:
    """Fail here if ``AREAL_LIGHTNING_FAULT`` names this point; do nothing otherwise."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    _hits[name] += 1
    for entry in spec.split(","):
        entry, _, nth = entry.strip().partition("@")
        point, _, action = entry.partition(":")
        if point != name or (nth and _hits[name] != int(nth)):
            continue
        if action in ("", "raise"):
            raise InjectedFault(f"fault injected at {name!r} ({ENV_VAR}={spec!r})")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"{ENV_VAR}: unknown action {action!r} for point {name!r}; allowed: raise, kill")


def reset_fault_counts() -> None:
    """Forget how often each point was reached (for in-process tests using ``@N``)."""
    _hits.clear()
