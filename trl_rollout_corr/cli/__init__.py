"""The ``trl-rollout-corr`` command: train, recipes, probe, the demo's entry."""

from .main import main

__all__ = ["main"]
