"""mfu-lab: a guided workbook that measures and raises the MFU of a PyTorch training job.

Plain-Python entry points (no Jupyter needed)::

    from mfu_lab import load_job
    from mfu_lab.steps import baseline
    result = baseline.run(load_job("parameters/default.yaml"))
"""

from mfu_lab.core import __version__
from mfu_lab.core.errors import DeviceError, JobError, MfuLabError, StepError  # noqa: E402
from mfu_lab.core.flops import hardware_flops_per_token, mfu, transformer_flops_per_token  # noqa: E402
from mfu_lab.core.job import Job, from_namespace, load_job  # noqa: E402

__all__ = ["DeviceError", "Job", "JobError", "MfuLabError", "StepError", "__version__",
           "from_namespace", "hardware_flops_per_token", "load_job", "mfu", "transformer_flops_per_token"]
