"""Step 5, precision: the step (step.py), the precision ladder (precision_ladder.py), and FP8 in three ideas: the
sensitivity study (sensitivity.py), the policy trials (policies.py) and torchao's real speed (torchao_speed.py).

The step contract, for the notebook and the registry: ``run``, ``advise``, ``save`` and ``Result``."""

from mfu_lab.steps.fp8.step import Result, advise, run, save

__all__ = ["Result", "advise", "run", "save"]
