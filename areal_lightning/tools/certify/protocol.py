"""The protocol between ``certify`` and the training command it runs: environment variables,
placeholders, the resume line it reads, its usage error."""

from __future__ import annotations

import re

from areal_lightning.errors import AreaLightningError


ENV_MODE = "AREAL_LIGHTNING_CERTIFY_MODE"
ENV_ROOT = "AREAL_LIGHTNING_CERTIFY_ROOT"
PLACEHOLDERS = ("{root}", "{mode}", "{losses}")
END_CHECK = "after the last run: "
_RESUMED = re.compile(r"RecoverCallback: resumed from (\S+) after global step (\d+)")


class CertifyUsageError(AreaLightningError, ValueError):
    """Bad arguments to ``certify`` (exit code 2)."""
