"""Step 6, placement: the step (step.py), the co-located copies (coloc.py) and the node's layouts (layouts.py).

The step contract, for the notebook and the registry: ``run``, ``advise``, ``save`` and ``Result``."""

from mfu_lab.steps.placement.step import Result, advise, run, save

__all__ = ["Result", "advise", "run", "save"]
