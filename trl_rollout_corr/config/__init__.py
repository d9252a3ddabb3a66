"""The correction's fields, presets, TRL's and verl's names, and the plan (where pi_old comes from)."""

from .correction import RolloutCorrectionConfig

__all__ = ["RolloutCorrectionConfig"]
