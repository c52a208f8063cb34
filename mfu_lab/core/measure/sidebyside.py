"""Side by side: candidates timed in interleaved rounds, and the bootstrap interval of a speedup.

A comparison measured as "all of A, then all of B" lets machine drift (a neighbour starting, a
clock settling, caches warming) land on one candidate. Here every round runs every candidate once,
in the same order, for the same number of steps: A B C, A B C, ... so drift hits each alike. The
order actually run is recorded, so a test (or a reader) can check the alternation.

The speedup of B over A is median(A) / median(B) of their per-step times. Its interval is a
percentile bootstrap: both samples resampled with replacement (seeded, so a result reproduces), the
ratio of medians taken each time, the 2.5th and 97.5th percentiles kept. An interval that contains
1.0 means the change is not proven faster (or slower) on this evidence.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mfu_lab.core.measure.timed import percentile

BOOTSTRAP_SAMPLES = 2000
CONFIDENCE = 0.95


@dataclass
class Series:
    """One candidate's measured steps, in the order run (warm-up excluded)."""

    wall_s: list[float] = field(default_factory=list)
    data_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    round_medians_s: list[float] = field(default_factory=list)

    def extend(self, chunk: Mapping[str, list[float]]) -> None:
        walls = list(chunk["wall_s"])
        if not walls:
            raise ValueError("a round returned no steps")
        self.wall_s += walls
        self.data_s += list(chunk.get("data_s", [0.0] * len(walls)))
        self.compute_s += list(chunk.get("compute_s", walls))
        self.loss += list(chunk.get("loss", []))
        self.round_medians_s.append(statistics.median(walls))


@dataclass
class Interleaved:
    order: list[tuple[int, str]]  # (round, candidate) in the order they ran
    series: dict[str, Series]
    rounds: int
    steps_per_round: int


def interleave(runners: Mapping[str, Callable[[int], Mapping[str, list[float]]]], rounds: int, steps: int,
               progress: Callable[[str], None] | None = None, abba: bool = False) -> Interleaved:
    """Run ``rounds`` rounds; in each, every runner once for ``steps`` steps, in the mapping's order (with ``abba``,
    reversed every other round: A B, B A, A B... so a steady drift favours no runner).

    A runner takes a step count and returns that many steps' ``wall_s`` (and optionally ``data_s``,
    ``compute_s``, ``loss``), continuing its own training from where its last round stopped. A runner that
    returns None has dropped out (its caller records why): it is not run again, and the rest go on.
    """
    if rounds < 1 or steps < 1:
        raise ValueError(f"rounds and steps must be >= 1 (got {rounds}, {steps})")
    series = {name: Series() for name in runners}
    order: list[tuple[int, str]] = []
    out: set[str] = set()
    for r in range(1, rounds + 1):
        turn = list(runners.items())
        for name, run in (turn[::-1] if abba and r % 2 == 0 else turn):
            if name in out:
                continue
            chunk = run(steps)
            if chunk is None:
                out.add(name)
                continue
            series[name].extend(chunk)
            order.append((r, name))
            if progress:
                progress(f"round {r}/{rounds}: {name} {statistics.median(series[name].wall_s[-steps:]) * 1e3:.1f} "
                         "ms per step")
    return Interleaved(order, series, rounds, steps)


@dataclass(frozen=True)
class Speedup:
    value: float  # median(before) / median(after)
    low: float
    high: float
    confidence: float
    samples: int

    @property
    def proven(self) -> bool:
        """The interval lies entirely above 1 (faster) or entirely below it (slower)."""
        return self.low > 1.0 or self.high < 1.0

    def text(self) -> str:
        return f"{self.value:.2f}x [{self.low:.2f}, {self.high:.2f}]"


def bootstrap_speedup(before_s: list[float], after_s: list[float], samples: int = BOOTSTRAP_SAMPLES,
                      seed: int = 0, confidence: float = CONFIDENCE) -> Speedup:
    """median(before) / median(after) with a percentile-bootstrap interval (both samples resampled)."""
    if not before_s or not after_s:
        raise ValueError("both samples need at least one step time")
    rng = random.Random(seed)
    med = statistics.median
    ratios = []
    for _ in range(samples):
        a = med(rng.choices(before_s, k=len(before_s)))
        b = med(rng.choices(after_s, k=len(after_s)))
        ratios.append(a / b)
    tail = (1 - confidence) / 2 * 100
    return Speedup(med(before_s) / med(after_s), percentile(ratios, tail), percentile(ratios, 100 - tail),
                   confidence, samples)
