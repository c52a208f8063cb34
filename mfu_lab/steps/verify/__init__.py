"""Step 7, verify: the step (step.py), the tuned job built from the earlier results (tuned.py), the rungs measured
side by side (rungs.py), the staircase's figures (staircase.py), the DDP rung under torchrun (ddp.py) and the
layout change's check (layout.py).

The step contract, for the notebook and the registry: ``run``, ``advise``, ``save`` and ``Result``."""

from mfu_lab.steps.verify.step import Result, advise, run, save

__all__ = ["Result", "advise", "run", "save"]
