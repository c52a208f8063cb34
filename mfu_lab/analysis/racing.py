"""Racing: measure every candidate briefly, then measure longer only those that could still win.

A sweep (step 2's attention implementations and DDP configurations, step 4's compile modes, step 5's precisions)
runs in rounds. The first round times every candidate for a few steps. A candidate goes on to the next round when

- it is a reference (DDP's default, the job's own configuration): references are never dropped, so the final
  comparison always has them; or
- it is inside the leader's noise band: its fastest sample is no slower than the leader's slowest sample, or its
  median is within ``floor`` (3%) of the leader's median; and, of those, it ranks in the best ``keep_share``
  (a third, at least two and at most four) by median: successive halving's cut, so a flat field still shrinks.

The final round measures the survivors side by side with the full protocol, and the step's usual rule picks among
them. With ``exhaustive`` (``--thorough``) every candidate goes to the final round. A budget that runs out cuts the
survivors to the leader and the references (:func:`survivors` with ``keep_share=0``), said in the log.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from mfu_lab.core.thresholds import RACE_KEEP_SHARE, RACE_MAX_FINALISTS, RACE_NOISE_FLOOR


@dataclass
class RoundLog:
    """One round: the steps each candidate ran, every candidate's median, who went on and who was dropped why."""

    number: int
    steps: int
    medians: dict[str, float | None]
    kept: list[str]
    dropped: dict[str, str] = field(default_factory=dict)
    seconds: float | None = None


@dataclass
class RaceLog:
    """How a sweep ran: ``racing`` or ``exhaustive``, its rounds, and the references that were never dropped."""

    mode: str  # racing | exhaustive
    references: list[str]
    rounds: list[RoundLog] = field(default_factory=list)
    note: str = ""  # shortened to fit the budget, a failure in a round...

    def text(self) -> str:
        if self.mode == "exhaustive":
            n = len(self.rounds[0].medians) if self.rounds else 0
            return f"exhaustive: all {n} candidates measured in full" + (f"; {self.note}" if self.note else "")
        if not self.rounds:
            return "racing: nothing to race" + (f"; {self.note}" if self.note else "")
        first = self.rounds[0]
        out = (f"racing: {len(first.medians)} candidates screened for {first.steps} steps each, "
               f"{len(first.kept)} went on to the final round ({', '.join(first.kept)})")
        if first.dropped:
            out += f"; {len(first.dropped)} dropped after round 1"
        return out + (f"; {self.note}" if self.note else "")

    def to_plot(self) -> dict[str, Any]:
        """Candidates against rounds (the medians each reached), for the report's race plot."""
        names = list(self.rounds[0].medians) if self.rounds else []
        return {"names": names, "rounds": [[r.medians.get(n) for n in names] for r in self.rounds],
                "dropped_after": {n: r.number for r in self.rounds for n in r.dropped}}


def survivors(samples: dict[str, list[float]], references: list[str] | tuple[str, ...] = (),
              keep_share: float = RACE_KEEP_SHARE, floor: float = RACE_NOISE_FLOOR) -> tuple[list[str], dict[str, str]]:
    """(the candidates that go on, fastest first, then the references; {dropped: why}) from one round's samples.

    Candidates without samples (failed, refused) are neither kept nor dropped here: the caller records them."""
    timed = {k: v for k, v in samples.items() if v}
    if not timed:
        return [k for k in references if k in samples], {}
    med = {k: statistics.median(v) for k, v in timed.items()}
    leader = min(med, key=med.get)
    lead_med, lead_max = med[leader], max(timed[leader])
    order = sorted(med, key=med.get)
    room = max(2, min(RACE_MAX_FINALISTS, math.ceil(len(order) * keep_share)))  # two in each other's noise go on
    kept, dropped = [], {}
    for name in order:
        inside = min(timed[name]) <= lead_max or med[name] <= lead_med * (1 + floor)
        if name in references:
            continue  # added below, whatever their times
        if not inside:
            dropped[name] = (f"outside the leader's noise band: fastest sample {min(timed[name]) * 1e3:.1f} ms > the "
                             f"leader's ({leader}) slowest {lead_max * 1e3:.1f} ms, median "
                             f"{med[name] / lead_med - 1:+.1%} (band {floor:.0%})")
        elif len(kept) < room:
            kept.append(name)
        else:
            dropped[name] = (f"inside the leader's noise band but not among the best {room} of {len(order)} by "
                             f"median ({med[name] * 1e3:.1f} ms vs the leader's {lead_med * 1e3:.1f} ms): a toss-up "
                             "with the candidates kept")
    if leader not in kept and leader not in references:
        kept.insert(0, leader)
    kept += [r for r in references if r in samples and r not in kept]
    return kept, dropped


def log_round(number: int, steps: int, samples: dict[str, list[float]], kept: list[str], dropped: dict[str, str],
              seconds: float | None = None) -> RoundLog:
    return RoundLog(number, steps, {k: statistics.median(v) if v else None for k, v in samples.items()}, kept,
                    dropped, seconds)
