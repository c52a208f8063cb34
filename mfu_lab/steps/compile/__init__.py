"""Step 4, compile: the step (step.py), the confirmation of its leading mode (confirm.py) and its trial processes
(worker.py).

The step contract, for the notebook and the registry: ``run``, ``advise``, ``save`` and ``Result``."""

from mfu_lab.steps.compile.step import Result, advise, run, save

__all__ = ["Result", "advise", "run", "save"]
