"""Fault-injection points for the checkpoint path (testing only).

Enabled only by the environment variable ``AREAL_LIGHTNING_FAULT``; otherwise each
:func:`fault_point` call is one dictionary lookup. The variable holds comma-separated
``point[:action]`` entries; ``action`` is ``raise`` (default: raise :class:`InjectedFault`)
or ``kill`` (SIGKILL this process, as a power cut or OOM killer would).
"""

from __future__ import annotations

import os
import signal

ENV_VAR = "AREAL_LIGHTNING_FAULT"


class InjectedFault(RuntimeError):
    """Raised at a fault point named in ``AREAL_LIGHTNING_FAULT`` with action ``raise``."""


def fault_point(name: str) -> None:
    """Fail here if ``AREAL_LIGHTNING_FAULT`` names this point; do nothing otherwise."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    for entry in spec.split(","):
        point, _, action = entry.strip().partition(":")
        if point != name:
            continue
        if action in ("", "raise"):
            raise InjectedFault(f"fault injected at {name!r} ({ENV_VAR}={spec!r})")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"{ENV_VAR}: unknown action {action!r} for point {name!r}; allowed: raise, kill")
