"""What the commands share: their exit codes, and the job keys the command line sets (``-p KEY=VALUE``,
``--keep``, ``--budget``, ``--thorough``)."""

from __future__ import annotations

from mfu_lab.core.errors import JobError, JobProblem
from mfu_lab.core.job import yamlfile
from mfu_lab.core.job.schema import validate

EXIT_OK, EXIT_STEP_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def parse_overrides(pairs: list[str]) -> dict:
    """``key=value`` pairs; values parsed as YAML scalars (``4`` -> int, ``true`` -> bool)."""
    out, problems = {}, []
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            problems.append(JobProblem(pair, pair, "expected key=value, e.g. -p micro_batch=4"))
            continue
        try:
            out[key.strip()] = yamlfile.loads(text) if text.strip() else ""
        except yamlfile.YamlProblem as e:
            problems.append(JobProblem(key, text, f"is not a valid value: {e}"))
    if problems:
        raise JobError("command line (-p)", problems)
    return out


def with_keep(job, keep: list[str] | None):
    """The job with ``--keep`` keys added to its ``keep:`` list (checked like any job key)."""
    keys = [k.strip() for arg in keep or [] for k in arg.split(",") if k.strip()]
    if not keys:
        return job
    return validate(job.to_dict() | {"keep": list(dict.fromkeys([*job.keep, *keys]))}, "command line (--keep)")


def cost_overrides(args, overrides: dict) -> dict:
    """``--budget MIN`` and ``--thorough`` as the job keys they set (budget_min, thorough)."""
    if getattr(args, "budget", None) is not None:
        if not args.budget >= 0:
            raise JobError("command line", [JobProblem("--budget", args.budget, "must be minutes >= 0 (0: no budget)")])
        overrides["budget_min"] = args.budget
    if getattr(args, "thorough", False):
        overrides["thorough"] = True
    return overrides
