"""mfu-lab: a guided workbook that measures and raises the MFU of a PyTorch training job.

Plain-Python entry points (no Jupyter needed)::

    from mfu_lab import load_job
    from mfu_lab.steps import baseline
    result = baseline.run(load_job("parameters/default.yaml"))
"""

__version__ = "0.1.0"

from .errors import DeviceError, JobError, MfuLabError, StepError  # noqa: E402
from .flops import hardware_flops_per_token, mfu, transformer_flops_per_token  # noqa: E402
from .job import Job, load_job  # noqa: E402

__all__ = ["DeviceError", "Job", "JobError", "MfuLabError", "StepError", "__version__",
           "hardware_flops_per_token", "load_job", "mfu", "transformer_flops_per_token"]
