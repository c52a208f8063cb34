"""Step 5, precision: the step (step.py), the precision ladder (precision_ladder.py: its rungs in rungs.py, their
timed rounds in ladder_timing.py, what a budget's share holds in ladder_share.py), and FP8 in four ideas: the
sensitivity study (sensitivity.py), the policy trials (policies.py), torchao's real speed (torchao_speed.py) and
each layer group's own speed (group_speed.py).

The step contract, for the notebook and the registry: ``run``, ``advise``, ``save`` and ``Result``."""

from mfu_lab.steps.fp8.step import Result, advise, run, save

__all__ = ["Result", "advise", "run", "save"]
