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

A pick is then confirmed (:func:`confirm`), in both modes: each candidate above was measured once, as one block of
steps (one slot of a launch, one fresh process), and on a shared or small machine the drift between blocks (10% on
a 2-core CPU) is larger than the spread inside one, so a p10-p90 that clears the reference's can be luck. The pick
and the reference are measured again in alternating turns (reference, pick, reference, pick...), and the pick
stands only when the bootstrap interval of its speedup over the reference lies above 1.0
(:func:`mfu_lab.core.measure.sidebyside.bootstrap_speedup`). Otherwise the reference stays, and the log says why.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from mfu_lab.core.measure.sidebyside import bootstrap_speedup
from mfu_lab.core.measure.timed import stats
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
class Confirmation:
    """The sweep's pick measured again beside the reference, in alternating turns; it stands only when proven."""

    candidate: str
    reference: str
    status: str = "ok"  # ok | failed | skipped (the budget, one rank...)
    reason: str = ""
    turns: int = 0  # alternations: each runs the reference, then the candidate
    steps: int = 0  # timed steps per candidate per turn
    order: list[str] = field(default_factory=list)  # who ran, in the order run
    reference_median_s: float | None = None
    candidate_median_s: float | None = None
    speedup: float | None = None  # the reference's median / the candidate's (above 1: the candidate is faster)
    low: float | None = None
    high: float | None = None
    seconds: float | None = None

    @property
    def proven(self) -> bool:
        """The candidate is faster beyond the noise: its speedup's interval lies above 1.0."""
        return self.status == "ok" and self.low is not None and self.low > 1.0

    def text(self) -> str:
        if self.status != "ok":
            return f"{self.candidate} not confirmed against {self.reference} ({self.reason}): {self.reference} stays"
        verdict = (f"confirmed: {self.candidate} stands" if self.proven else
                   f"slower: {self.reference} stays" if self.high < 1.0 else
                   f"not proven (the interval includes 1.0): {self.reference} stays")
        return (f"{self.candidate} against {self.reference}, {self.turns} alternating turns of {self.steps} steps: "
                f"{self.reference_median_s * 1e3:.1f} -> {self.candidate_median_s * 1e3:.1f} ms per step, "
                f"{self.speedup:.2f}x [{self.low:.2f}, {self.high:.2f}] (measured side by side); {verdict}")


def confirm_seconds(turns: int, steps_per_turn: int, step_s: float) -> float:
    """A confirmation's estimated time: both candidates' turns, each ``steps_per_turn`` steps (warm-up included)
    at ``step_s`` (the slower one's median step)."""
    return 2 * turns * steps_per_turn * step_s


def confirm(candidate: str, reference: str, reference_s: list[float], candidate_s: list[float], turns: int,
            steps: int, order: list[str], seconds: float | None = None) -> Confirmation:
    """The confirmation of ``candidate`` over ``reference`` from their pooled per-step times of the turns."""
    if not reference_s or not candidate_s:
        return Confirmation(candidate, reference, "failed", "a turn returned no steps", turns, steps, order,
                            seconds=seconds)
    sp = bootstrap_speedup(reference_s, candidate_s)
    return Confirmation(candidate, reference, "ok", "", turns, steps, order, statistics.median(reference_s),
                        statistics.median(candidate_s), sp.value, sp.low, sp.high, seconds)


@dataclass
class RaceLog:
    """How a sweep ran: ``racing`` or ``exhaustive``, its rounds, and the references that were never dropped."""

    mode: str  # racing | exhaustive
    references: list[str]
    rounds: list[RoundLog] = field(default_factory=list)
    note: str = ""  # shortened to fit the budget, a failure in a round...
    confirmation: Confirmation | None = None  # the pick measured again beside the reference, when one was picked

    def text(self) -> str:
        tail = (f"; {self.note}" if self.note else "") + (f"; {self.confirmation.text()}" if self.confirmation
                                                          else "")
        if self.mode == "exhaustive":
            n = len(self.rounds[0].medians) if self.rounds else 0
            return f"exhaustive: all {n} candidates measured in full" + tail
        if not self.rounds:
            return "racing: nothing to race" + tail
        first = self.rounds[0]
        timed = [k for k, v in first.medians.items() if v is not None]
        dropped = [k for k in first.dropped if k in timed]  # the others were ruled out untimed, said in the note
        n = len(timed)
        out = (f"racing: {n} candidate{'' if n == 1 else 's'} screened for {first.steps} steps each, "
               f"{len(first.kept)} went on to the final round ({', '.join(first.kept)})")
        if dropped:
            out += f"; {len(dropped)} dropped after round 1"
        return out + tail

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


def beyond_noise(figures: dict, reference) -> Any:
    """The step's pick from each candidate's (median, p10, p90) step time: the fastest by median, but only when its
    p90 lies below the reference's p10 (the ranges do not overlap); else the reference. With no reference (None, or
    not among ``figures``) the fastest; None for no candidates."""
    if not figures:
        return None
    fastest = min(figures, key=lambda k: figures[k][0])
    if reference is None or reference not in figures:
        return fastest
    return fastest if fastest != reference and figures[fastest][2] < figures[reference][1] else reference


def exposure_bound(reference: str, sync_s: list[float], no_sync_s: list[float],
                   floor: float = RACE_NOISE_FLOOR) -> str:
    """Why no DDP configuration can beat ``reference`` ('' when one might): the bound of a sweep a probe rules out.

    A bucket size, a communication hook or a bucket view changes how the gradients travel, not the model's
    compute, so no DDP configuration takes a step below the same step with no communication at all (``no_sync``).
    When the reference's exposed communication, (median step - median no_sync step) / median step, is at most
    ``floor`` (the race's noise band), the most any of them could give back lies inside the noise, and none is
    screened. FSDP2 candidates shard the optimizer's work as well, so this bound does not hold for them."""
    if not sync_s or not no_sync_s:
        return ""
    s, n = stats(sync_s), stats(no_sync_s)
    exposed = (s.median - n.median) / s.median
    if exposed > floor:
        return ""
    return (f"cannot be faster here: {reference} steps at {s.median * 1e3:.1f} ms (p10-p90 {s.p10 * 1e3:.1f}-"
            f"{s.p90 * 1e3:.1f}), and the same steps with no communication at all (no_sync) at {n.median * 1e3:.1f} "
            f"ms ({n.p10 * 1e3:.1f}-{n.p90 * 1e3:.1f}): communication exposes {exposed:+.1%} of the step, within the "
            f"race's {floor:.0%} noise band, and no bucket size, hook or bucket view takes a step below no "
            "communication (measured; not screened; --thorough measures every configuration)")


def finalists(samples: dict[str, list[float]], references: list[str], spent_s: float, full_factor: float,
              seconds_left: float | None, measured: set[str] | frozenset[str] = frozenset()
              ) -> tuple[list[str], dict[str, str], list[str]]:
    """(who goes to the final round, {dropped: why}, who the budget cut) after a first round that took ``spent_s``.

    ``measured``: candidates already measured in full (the references, first), whose samples count in the noise
    band but which the final round does not measure again. The final round is estimated at the first round's
    seconds per screened candidate x ``full_factor`` (a full measurement's steps over a screening's) per finalist
    still to measure; when that ends past ``seconds_left`` (None: no budget), the final round keeps only the
    leader and the references. The launcher and a worker that races inside one launch both decide with this
    function."""
    kept, dropped = survivors(samples, references)
    per_config = spent_s / max(1, len([k for k in samples if k not in measured]))
    cut: list[str] = []
    todo = [k for k in kept if k not in measured]
    if seconds_left is not None and len(todo) * per_config * full_factor > seconds_left:
        timed = [k for k in kept if samples.get(k)]
        leader = min(timed, key=lambda k: statistics.median(samples[k])) if timed else None
        cut = [k for k in kept if k != leader and k not in references]
        for k in cut:
            dropped[k] = "budget: the final round measures the leader and the references only"
        kept = [k for k in kept if k not in cut]
    return kept, dropped, cut


def log_round(number: int, steps: int, samples: dict[str, list[float]], kept: list[str], dropped: dict[str, str],
              seconds: float | None = None) -> RoundLog:
    return RoundLog(number, steps, {k: statistics.median(v) if v else None for k, v in samples.items()}, kept,
                    dropped, seconds)
