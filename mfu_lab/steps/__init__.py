"""The workbook's steps, one module per notebook, each with the same contract:
``run(job, progress=None, write=True) -> Result`` and ``advise(result) -> list[Advice]``.

The registry (keys, numbers, folders, titles) is :mod:`mfu_lab.core.registry`.
"""

from mfu_lab.core.registry import BY_KEY, STEPS, StepInfo

__all__ = ["BY_KEY", "STEPS", "StepInfo"]
