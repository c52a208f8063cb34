"""The production monitor: measure the job the user actually runs, from inside its training loop.

``Monitor`` (:mod:`mfu_lab.monitor.recorder`) appends one JSON-lines record per interval and rank; the
workbook reads a monitor folder with ``mfu-lab monitor report DIR`` or the ``00_monitor`` notebook.
Adapters for the loops people already use: :mod:`mfu_lab.monitor.lightning` (PyTorch Lightning) and
:mod:`mfu_lab.monitor.hf` (Hugging Face ``transformers.Trainer``), each an optional import.
"""

from mfu_lab.monitor.recorder import Monitor

__all__ = ["Monitor"]
