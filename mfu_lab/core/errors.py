"""Exceptions raised by mfu-lab. Every one derives from :class:`MfuLabError`."""

from __future__ import annotations


class MfuLabError(Exception):
    """Root of every error mfu-lab raises on purpose."""


class JobError(MfuLabError):
    """One or more invalid values in a job's parameters.

    ``problems`` holds one :class:`JobProblem` per bad key, so a user fixes them
    all in one go rather than one per run.
    """

    def __init__(self, source: str, problems: list[JobProblem]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} invalid value(s)"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


def short_repr(value: object, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length said: a bad value is shown, never echoed
    whole (a value can be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


class JobProblem:
    """One invalid key: what was given and what is allowed."""

    def __init__(self, key: str, value: object, expected: str):
        self.key, self.value, self.expected = key, value, expected

    def __str__(self) -> str:
        return f"key '{self.key}' = {short_repr(self.value)}: {self.expected}"

    def __repr__(self) -> str:
        return f"JobProblem({self.key!r}, {self.value!r}, {self.expected!r})"


class DeviceError(MfuLabError):
    """The device asked for is absent, or its peak FLOP/s is not known."""


class StepError(MfuLabError):
    """A step could not produce its result (e.g. a user's model is unusable)."""


class StepExecutionError(MfuLabError):
    """A notebook failed while ``mfu-lab run`` executed it.

    Carries the step, the executed (partial) notebook path, and the failing
    cell's error name and value as papermill reported them.
    """

    def __init__(self, step: str, notebook: str, ename: str, evalue: str):
        self.step, self.notebook, self.ename, self.evalue = step, notebook, ename, evalue
        super().__init__(f"step '{step}' failed: {ename}: {evalue} (executed notebook kept at {notebook})")
