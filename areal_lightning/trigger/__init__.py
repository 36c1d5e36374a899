"""Trigger: when to save (frequencies, step gating, the save schedule, the epoch position, step names)."""

from areal_lightning.trigger.freq import EpochPosition, FreqController
from areal_lightning.trigger.gate import StepGate
from areal_lightning.trigger.schedule import Save, SavePoint, SaveSchedule
from areal_lightning.trigger.step import StepInfo

__all__ = ["EpochPosition", "FreqController", "Save", "SavePoint", "SaveSchedule", "StepGate", "StepInfo"]
