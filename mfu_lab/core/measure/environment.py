"""The environment a result was measured in: Python, torch, the workbook's version and source, the machine, the device
and its threads, the command line's overrides, and on a GPU its driver and health facts. Every step's result keeps it
(``StepResult.environment``), so two results are comparable only when their environments say so."""

from __future__ import annotations

import datetime as _dt
import platform
from typing import Any

import torch

from mfu_lab.core import __version__
from mfu_lab.core.job import overrides
from mfu_lab.core.store.results import git_commit, source_digest


def environment(device_name: str, device_type: str) -> dict[str, Any]:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mfu_lab": __version__,
        "git_commit": git_commit(),
        "source_digest": source_digest(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "device_type": device_type,
        "device_name": device_name,
        "torch_threads": torch.get_num_threads(),
        "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "overrides": overrides.from_env(),  # the command line's -p KEY=VALUE (core.job.overrides); {} for none
    }
    if device_type == "cuda":  # pragma: no cover - GPU only
        env["cuda"] = torch.version.cuda
        env["hip"] = getattr(torch.version, "hip", None)
        env["gpu_count"] = torch.cuda.device_count()
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception as e:
            env["driver"] = f"unknown ({e})"
        from mfu_lab.core.measure.health import gpu_environment

        env["gpu"] = gpu_environment(torch.cuda.current_device())
    return env
