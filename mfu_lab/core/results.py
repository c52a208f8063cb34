"""Results: labelled metrics, the environment they were measured in, atomic JSON files.

Every number carries its source (DESIGN.md, "Honesty of every number"):
measured | counted | analytic | datasheet | emulated | modelled.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mfu_lab.core import __version__

SOURCES = ("measured", "counted", "analytic", "datasheet", "emulated", "modelled")


@dataclass
class Metric:
    value: float | None
    unit: str
    source: str
    note: str = ""

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"metric source must be one of {SOURCES}, got {self.source!r}")
        if self.value is not None and not math.isfinite(self.value):
            raise ValueError(f"metric value must be finite or None, got {self.value!r}")


@dataclass
class StepResult:
    """What every step's result ends with: what was skipped and why, how long the step took, its status.
    Keyword-only, so each step's own fields come first and positionally."""

    _: dataclasses.KW_ONLY
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0
    status: str = "ok"

    def metric(self, name: str) -> float | None:
        return self.metrics[name].value

    @staticmethod
    def tail(d: dict[str, Any]) -> dict[str, Any]:
        """The shared fields of a result read back from JSON."""
        return {"skipped": d.get("skipped", []), "elapsed_s": d.get("elapsed_s", 0.0), "status": d.get("status", "ok")}


def git_commit(path: Path | None = None) -> str:
    """Commit of the workbook's checkout, '+dirty' when it has uncommitted changes; 'unknown' outside git."""
    here = path or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device_name: str, device_type: str) -> dict[str, Any]:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mfu_lab": __version__,
        "git_commit": git_commit(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "device_type": device_type,
        "device_name": device_name,
        "torch_threads": torch.get_num_threads(),
        "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
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
    return env


def jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # JSON has no NaN/inf; null means "no value"
    if isinstance(obj, Path):
        return str(obj)
    return obj
