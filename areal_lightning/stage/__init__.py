"""Stage: host copies and the one-in-flight background worker."""

from areal_lightning.stage.host import HostStager
from areal_lightning.stage.worker import BackgroundWorker

__all__ = ["BackgroundWorker", "HostStager"]
