"""The run's time budget (``budget_min``, ``mfu-lab run --budget``), spread over the steps by one stated rule.

Rule: each step gets the budget times its weight over the sum of the weights of steps 1-7. The weights are each
step's wall time in a ``--thorough`` run of the default job on a 2-core Intel CPU (``benchmarks/bench_cost.py``,
2026-12-01: step 1 15 s, step 2 155 s, step 3 25 s, step 4 96 s, step 5 110 s, step 6 23 s, step 7 39 s), so a
budget cuts every step in the same proportion. A step run alone gets the same share it would get in a whole run.

A step that measures in rounds (steps 2, 4 and 5) checks its clock at each round's start: when the next round would
end past the step's share, it shortens the round (fewer candidates, fewer steps, no warm-cache compile) and records
what it left out, with the planned and the used seconds. Steps 1, 3 and 6 take the time their measurement needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

WEIGHTS = {"baseline": 15, "attention_comm": 155, "kernels": 25, "compile": 96, "fp8": 110, "placement": 23,
           "verify": 39}


def plan(budget_min: float, keys: list[str] | None = None) -> dict[str, float]:
    """Seconds per step by the rule above (all steps, or those in ``keys``); {} without a budget."""
    if not budget_min:
        return {}
    total = sum(WEIGHTS.values())
    return {k: budget_min * 60.0 * w / total for k, w in WEIGHTS.items() if keys is None or k in keys}


def plan_text(budget_min: float, keys: list[str], numbers: dict[str, int]) -> str:
    """The plan as one line the runner prints before the first step."""
    p = plan(budget_min, keys)
    if not p:
        return ""
    parts = ", ".join(f"step {numbers.get(k, '?')} {s:.0f} s" for k, s in p.items())
    return (f"budget {budget_min:g} min, spread by each step's share of a thorough run (README, 'Cost'): {parts}; "
            f"{sum(p.values()) / 60:.1f} min planned for the steps selected")


@dataclass
class Clock:
    """One step's share of the budget and what the step left out to keep to it."""

    planned_s: float | None  # None: no budget
    started: float = field(default_factory=time.perf_counter)
    shortened: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def for_step(cls, job, key: str) -> Clock:
        return cls(plan(getattr(job, "budget_min", 0.0) or 0.0).get(key))

    @property
    def used_s(self) -> float:
        return time.perf_counter() - self.started

    def left_s(self) -> float | None:
        return None if self.planned_s is None else self.planned_s - self.used_s

    def fits(self, estimate_s: float) -> bool:
        """Whether work of ``estimate_s`` seconds ends inside the step's share (always, without a budget)."""
        left = self.left_s()
        return left is None or estimate_s <= left

    def shorten(self, what: str, why: str) -> None:
        self.shortened.append({"what": what, "reason": f"budget: {why}"})

    def record(self) -> dict:
        """What the step's result keeps: planned and used seconds, and what was left out."""
        return {"planned_s": self.planned_s, "used_s": self.used_s, "shortened": list(self.shortened)}
