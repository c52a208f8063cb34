"""A job from a notebook's parameters cell: papermill injects top-level names (``-p key value``, ``-f JOB``), and
the notebook's ``job = from_namespace(globals(), _names_before_parameters)`` turns them into a validated
:class:`mfu_lab.core.job.schema.Job`, a misspelt injected name refused rather than ignored."""

from __future__ import annotations

from typing import Any

from mfu_lab.core.job.schema import FIELDS, Job, validate

_LITERALS = (str, int, float, bool, list, dict, type(None))  # what papermill can inject


def from_namespace(namespace: dict[str, Any], before: set[str] | None = None,
                   source: str = "notebook parameters") -> Job:
    """Build a Job from a notebook's globals after its parameters cell ran.

    ``before`` is the set of global names that existed before the parameters
    cell: any other new, public name is a parameter papermill injected and is
    checked, so a misspelt ``-p micro_bacth 4`` fails instead of being ignored.
    """
    values = {k: namespace[k] for k in FIELDS if k in namespace}
    if before is not None:
        for name in set(namespace) - set(before) - set(FIELDS):
            if not name.startswith("_") and isinstance(namespace[name], _LITERALS):
                values[name] = namespace[name]
    return validate(values, source)

