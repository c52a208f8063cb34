"""mfu-lab: a guided workbook that measures and raises the MFU of a PyTorch training job.

Plain-Python entry points (no Jupyter needed)::

    from mfu_lab import load_job
    from mfu_lab.steps import baseline
    result = baseline.run(load_job("parameters/default.yaml"))

The package is in layers, each a folder, imports only going down (``lint-imports`` checks it):
core < analysis < workers / monitor < steps < plots < report / explore < publish < runner / lab < commands < cli.
Inside core and analysis, rooms by concern (docs/code-layout.md).
"""

from pathlib import Path

from mfu_lab.core import __version__
from mfu_lab.core.errors import DeviceError, JobError, MfuLabError, StepError
from mfu_lab.core.job.notebook import from_namespace
from mfu_lab.core.job.schema import Job, load_job
from mfu_lab.core.measure.flops import hardware_flops_per_token, mfu, transformer_flops_per_token
from mfu_lab.core.store import step_results as store


def refresh_index(job_root: Path) -> None:
    """After each save, rewrite the job's summary page. Registered here, in the facade, so that the core never
    imports the presentation layer; the import is lazy so that workers and plain-Python steps do not load
    matplotlib until a result is saved. Inside a notebook that ``mfu-lab run`` executes (``MFU_LAB_INDEX_BY_RUNNER``
    set), the runner rewrites the page right after the step, so the kernel leaves it to the runner."""
    import os

    if os.environ.get("MFU_LAB_INDEX_BY_RUNNER"):
        return
    from mfu_lab.report import write_index

    write_index(job_root)


if refresh_index not in store.AFTER_SAVE:
    store.AFTER_SAVE.append(refresh_index)

__all__ = ["DeviceError", "Job", "JobError", "MfuLabError", "StepError", "__version__",
           "from_namespace", "hardware_flops_per_token", "load_job", "mfu", "refresh_index",
           "transformer_flops_per_token"]
