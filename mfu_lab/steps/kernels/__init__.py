"""Step 3, kernels: the step (step.py) and the job profiled in its own layout (layout.py).

The step contract, for the notebook and the registry: ``run``, ``advise``, ``save`` and ``Result``."""

from mfu_lab.steps.kernels.step import Result, advise, run, save

__all__ = ["Result", "advise", "run", "save"]
