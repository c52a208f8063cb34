"""Results: labelled metrics, the environment they were measured in, and the round trip through JSON.

Every number carries its source (README, "What the numbers mean"):
measured | counted | analytic | datasheet | emulated | modelled.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import subprocess
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from mfu_lab.core.errors import MfuLabError

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


class ResultFormatError(MfuLabError):
    """A stored result this version of mfu-lab cannot read: another result format, or a missing field."""


@dataclass
class StepResult:
    """What every step's result ends with: what was skipped and why, how long the step took, its status, and
    the format it is stored in. Keyword-only, so each step's own fields come first.

    ``FORMAT`` is the version of a step's result.json layout: raise it when a field changes meaning or goes
    away, so that an older file is named and refused rather than misread. A file without ``result_format``
    predates the field and is format 1.
    """

    FORMAT: ClassVar[int] = 1
    _: dataclasses.KW_ONLY
    skipped: list[dict[str, str]] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0
    status: str = "ok"
    result_format: int = 1
    budget: dict[str, Any] = dataclasses.field(default_factory=dict)  # core.process.budget.Clock.record()

    def __post_init__(self):
        self.result_format = type(self).FORMAT

    def metric(self, name: str) -> float | None:
        return self.metrics[name].value

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """The typed result from its result.json, field by field by name (see :func:`rebuild`)."""
        found = d.get("result_format", 1)
        if found != cls.FORMAT:
            raise ResultFormatError(f"{cls.__name__}: stored in result format {found}, this version of mfu-lab "
                                    f"reads format {cls.FORMAT}; rerun the step to replace it")
        return rebuild(cls, d)


def rebuild(cls, data: dict[str, Any]):
    """A dataclass, and every dataclass its type hints name inside it, from JSON: each field by its name,
    never by position. A field absent from ``data`` takes its default; one without a default is an error."""
    if not isinstance(data, dict):
        raise ResultFormatError(f"{cls.__name__}: expected a JSON object, found {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _value(hints.get(f.name, Any), data[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ResultFormatError(f"{cls.__name__}: field {f.name!r} is missing")
    return cls(**kwargs)


def _value(tp, v):
    if v is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], v) if len(inner) == 1 else v
    if dataclasses.is_dataclass(tp) and isinstance(v, dict):
        return rebuild(tp, v)
    if origin is list and args:
        return [_value(args[0], x) for x in v]
    if origin is dict and len(args) == 2:
        return {k: _value(args[1], x) for k, x in v.items()}
    if origin is tuple and isinstance(v, list):
        return tuple(v)
    return v


_NUMBER = (int, float)
_METRIC_KEYS = {f.name for f in dataclasses.fields(Metric)}
_BASE_TYPES = {"status": (str,), "elapsed_s": _NUMBER, "result_format": (int,), "skipped": (list,),
               "metrics": (dict,), "job": (dict,), "environment": (dict,), "budget": (dict,)}


def _kind(v: Any) -> str:
    return {str: "text", bool: "true/false", dict: "an object", list: "a list"}.get(type(v), type(v).__name__)


def _metric_problem(where: str, m: Any) -> str | None:
    if not isinstance(m, dict):
        return f"{where} is {_kind(m)}, not a metric object"
    v = m.get("value")
    if v is not None and (isinstance(v, bool) or not isinstance(v, _NUMBER)):
        return f"{where}.value is {_kind(v)} ({v!r:.40}), not a number or null"
    for field in ("unit", "source", "note"):
        if field in m and not isinstance(m[field], str):
            return f"{where}.{field} is {_kind(m[field])}, not text"
    return None


def result_type_problem(data: dict[str, Any]) -> str | None:
    """What in a stored result has the wrong type, in words, or None: the fields every result has, and every
    metric (an object of a :class:`Metric`'s fields) anywhere in it. A report formats these as numbers and text,
    so a file with a wrong type is treated as damaged, like a truncated one, rather than crash the report."""
    for key, types_ in _BASE_TYPES.items():
        if key in data and not (isinstance(data[key], types_) and not isinstance(data[key], bool)):
            return f"field {key!r} is {_kind(data[key])}"
    for name, m in (data.get("metrics") or {}).items():
        if (why := _metric_problem(f"metrics.{name}", m)) is not None:
            return why
    stack: list[tuple[str, Any]] = [(k, v) for k, v in data.items() if k != "metrics"]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            if {"value", "unit", "source"} <= v.keys() <= _METRIC_KEYS and (why := _metric_problem(where, v)):
                return why
            stack += [(f"{where}.{k}", x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{where}[{i}]", x) for i, x in enumerate(v)]
    return None


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


@functools.cache
def source_digest() -> str:
    """12 hex digits of the workbook's own source: every file of the package (code and templates) and the step
    notebooks. Two checkouts with the same digest run the same code, committed or not."""
    package = Path(__file__).resolve().parents[2]  # the mfu_lab folder (this is mfu_lab/core/store/results.py)
    files = sorted(p for p in package.rglob("*") if p.is_file() and p.suffix in (".py", ".j2", ".css", ".json"))
    from mfu_lab.core.job.paths import workbook_file  # the checkout's notebooks, or those installed with the package

    notebooks = workbook_file("notebooks")
    files += sorted(notebooks.glob("*.ipynb")) if notebooks.is_dir() else []
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(package.parent).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


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
