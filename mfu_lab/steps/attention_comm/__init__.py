"""Step 2, attention and communication: the step (step.py), the attention race (attention_race.py) and the
DDP and FSDP2 race (comm_race.py).

The step contract, for the notebook and the registry: ``run``, ``advise``, ``save`` and ``Result``."""

from mfu_lab.steps.attention_comm.step import Result, advise, run, save

__all__ = ["Result", "advise", "run", "save"]
