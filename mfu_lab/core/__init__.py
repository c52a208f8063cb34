"""The core layer: the job, the device, the workload, FLOPs, measurement, the ledger, results and their store."""

__version__ = "0.1.0"  # the workbook's version, recorded in every result (pyproject.toml repeats it)
