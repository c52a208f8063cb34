"""Step 5, precision: the step (step.py) and the precision ladder (precision_ladder.py).

The step contract, for the notebook and the registry: ``run``, ``advise``, ``save`` and ``Result``."""

from mfu_lab.steps.fp8.step import Result, advise, run, save

__all__ = ["Result", "advise", "run", "save"]
