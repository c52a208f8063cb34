"""Step 5's FP8 sensitivity study (emulated): how much each linear-layer group loses to FP8, before any trial.

On the job's first ``fp8_sensitivity_batches`` batches, every linear layer's input and output gradient is
recorded and each layer group's FP8 error is measured against float32 (signal-to-noise in dB, underflow and
saturation) under tensorwise, rowwise and no scaling (:func:`mfu_lab.analysis.fp8_numerics.sensitivity`). The
column of the job's own recipe names the most sensitive group: the one the policy trials keep in high precision
first (:mod:`mfu_lab.steps.fp8.policies`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mfu_lab.analysis import fp8_numerics as f8
from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.engine.workload import build_train_step
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev


@dataclass
class Study:
    by_scaling: dict[str, list[f8.GroupSensitivity]]  # scaling -> each group's errors, as the result stores them
    scaling: str  # the column that matches the job's recipe
    most: str  # that column's most sensitive group (lowest worst-case SNR)

    @property
    def worst_snr_db(self) -> float:
        """The most sensitive group's SNR, worst of output, input-gradient and weight-gradient, in dB."""
        return min(g.worst_snr_db for g in self.by_scaling[self.scaling])

    @property
    def no_scaling_underflow(self) -> float:
        """The largest share of nonzero output gradients that a plain cast to e5m2 flushes to zero."""
        return max(g.grad_underflow for g in self.by_scaling["none"])


def study(job: Job, model: nn.Module, batches: list, device: dev.DeviceInfo, say) -> Study:
    """Every layer group's FP8 error on the job's model (built from its seed), under the three scalings."""
    say(f"sensitivity: {len(f8.linear_groups(model))} layer groups on {job.fp8_sensitivity_batches} batches, "
        "3 scalings")
    ts = build_train_step(job, model, device.type, fp8=False)
    to = device.torch_device
    by_scaling = f8.sensitivity(model, lambda m, x, y: ts.loss(to_device(x, to), to_device(y, to)),
                                batches[:job.fp8_sensitivity_batches])
    scaling = f8.RECIPES[job.fp8_recipe][0]
    return Study(by_scaling, scaling, min(by_scaling[scaling], key=lambda g: g.worst_snr_db).group)
