"""Step 1, the baseline: the step (step.py), the job in its own layout (layout.py) and the loader race (data_race.py).

The step contract, for the notebook and the registry: ``run``, ``advise``, ``save`` and ``Result``."""

from mfu_lab.steps.baseline.step import Result, advise, run, save

__all__ = ["Result", "advise", "run", "save"]
