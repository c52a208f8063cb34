"""One recommended change of the tuned job (:class:`Change`, a job key on a rung of the staircase), the rungs in the
workflow's order, and the tuned job the adopted changes make (:func:`tuned_job`, under :func:`tuned_name`).
:mod:`mfu_lab.analysis.tuning` reads the steps' results into changes; :mod:`mfu_lab.analysis.together` decides
which of them may stand together and builds step 7's staircase."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mfu_lab.core.job.schema import Job, validate

RUNGS = ("attention", "communication", "layout", "data", "optimizer", "batch", "compile", "loss", "precision",
         "fp8")
TUNED_SUFFIX = "-tuned"
JOB_NAME_MAX = 64  # job_name's length limit (core.job.rules.JOB_NAME_RE)


@dataclass
class Change:
    rung: str  # one of RUNGS: where it sits on the staircase
    step: str  # the registry key of the step that recommended it
    key: str
    old: Any
    new: Any
    evidence: str  # the figure behind it, in words, with its label
    label: str  # measured | proposed | emulated
    lossy: bool = False
    adopted: bool = True
    reason: str = ""  # why not adopted, or what to know when adopted

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tuned_job(job: Job, chosen: list[Change], source: str = "the tuned job") -> Job:
    """The job with every adopted change applied, under its own name (:func:`tuned_name`) so that its results do
    not overwrite the original's."""
    values = job.to_dict()
    for c in chosen:
        if c.adopted:
            values[c.key] = c.new
    values["job_name"] = tuned_name(job.job_name)
    return validate(values, source)


def tuned_name(name: str) -> str:
    """``<name>-tuned``, the name cut first where it would pass job_name's 64 characters: always another name than
    ``name`` (a tuned job's own tuned job is ``<name>-tuned-tuned``), so their results never share a folder."""
    out = name[:JOB_NAME_MAX - len(TUNED_SUFFIX)] + TUNED_SUFFIX
    return out if out != name else name[:JOB_NAME_MAX - len(TUNED_SUFFIX) - 1] + TUNED_SUFFIX
