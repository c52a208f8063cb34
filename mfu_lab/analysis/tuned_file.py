"""The tuned job as a file, ``tuned.yaml``: every key of the job with the adopted changes applied
(:func:`mfu_lab.analysis.tuning.tuned_job`), each changed line commented with its step, evidence and label, each value
the command line gave commented as such, and the changes not adopted listed in the header with why. Text read from a
result stays on its comment's one line."""

from __future__ import annotations

from typing import Any

import yaml

from mfu_lab.analysis.tuning import TUNED_SUFFIX, Change, tuned_job
from mfu_lab.core.job import overrides as ov
from mfu_lab.core.job.schema import FIELDS, Job


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def _one_line(text: str) -> str:
    """A comment's text on its one line: a line break or other unprintable character (text read from a result)
    becomes a space, so that no comment starts a key line of its own."""
    return "".join(ch if ch.isprintable() else " " for ch in text)


def tuned_yaml(job: Job, chosen: list[Change], source: str, run_id: str = "", overrides: dict | None = None) -> str:
    """The tuned job as a YAML file: every key, each changed line commented with its step, gain and label, each
    value that came from the command line (``overrides``; default: the run's,
    :func:`mfu_lab.core.job.overrides.from_env`) commented as such; changes not adopted listed in the header with
    why."""
    tuned = tuned_job(job, chosen)
    by_key = {c.key: c for c in chosen if c.adopted}
    given = {k: v for k, v in (ov.from_env() if overrides is None else overrides).items() if k in FIELDS}
    with_flags = f" as the command line changed it ({ov.flags(given)})" if given else ""
    lines = [_one_line(f"# The tuned job: {source}{with_flags} with the changes the workbook's steps measured and "
                       "adopted" + (f" (run {run_id})" if run_id else "") + "."),
             "# Validate: mfu-lab validate THIS_FILE    Run: mfu-lab run THIS_FILE    Refuse a change: keep: [KEY] in "
             "the original job, or --keep KEY",
             f"# job_name gets '{TUNED_SUFFIX}' so that its results stay beside, not over, the original's."]
    refused = [c for c in chosen if not c.adopted]
    if not by_key:
        lines.append("# No change was adopted: every step kept the job as it is (or the changes are pinned).")
    for c in refused:
        key = c.key if isinstance(c.key, str) else _flow(c.key)
        lines.append(_one_line(f"# not adopted: {key}: {_flow(c.old)} -> {_flow(c.new)} ({c.rung}): {c.reason}"))
    for key, value in tuned.to_dict().items():
        c, notes = by_key.get(key), []
        if c:
            notes.append(f"{c.rung}, {c.evidence}; was {_flow(c.old)}")
        elif key == "job_name" and value != job.job_name:
            notes.append(f"was {_flow(job.job_name)}")
        if key in given:
            what = "from the command line" if value == getattr(job, key) else "the value it replaced came from the " \
                "command line"
            notes.append(f"{what} ({ov.flag(key, given[key])}), not {source}")
        lines.append(f"{key}: {_flow(value)}" + (f"  # {_one_line('; '.join(notes))}" if notes else ""))
    return "\n".join(lines) + "\n"
