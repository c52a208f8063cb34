"""Advice: what a step's figures say to do. Each step computes its own with ``advise(result)``; every item
says which figure triggered it. Thresholds live in :mod:`mfu_lab.core.thresholds`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Advice:
    severity: str  # "act" (do this), "look" (worth a look), "info"
    message: str
    because: str  # the figures that triggered it
