"""Step 7's share of one GPU per rung (steps/verify/memory_share.py): by each rung's need, or, where the rungs do
not fit together, no bound and the caches freed between turns. The figures are the first H200 run's: GPT-2 124M
at micro_batch 16 peaked at 17.2 GB (tests/data/h200's history, measured)."""

from __future__ import annotations

import pytest

from mfu_lab.core.measure.device import resolve_device
from mfu_lab.steps.verify import memory_share as ms

PEAK = 17_228_754_432.0  # step 1's peak_memory_bytes on the H200 (max_memory_allocated, measured)
H200, H100 = 150_000_000_000.0, 85_000_000_000.0  # total_memory of each, bytes (about 139.7 and 79.2 GiB)


def test_rungs_that_fit_each_get_their_needs_share_and_at_least_their_need():
    p = ms.plan({"original": 16, "data": 64}, 16, PEAK, H200)
    assert not p.release and p.needs == {"original": PEAK, "data": 4 * PEAK}
    assert p.fractions["data"] == pytest.approx(4 * p.fractions["original"])
    assert sum(p.fractions.values()) == pytest.approx(ms.USABLE)
    for name, need in p.needs.items():  # an equal share (0.46) would hold the 64 x 1 rung's 69 GB only just
        assert p.fractions[name] * H200 >= need
    assert "analytic, an upper bound" in p.note and "data 64.2 GiB" in p.note


def test_rungs_that_do_not_fit_together_are_unbounded_and_free_their_caches_between_turns():
    """On an H100 (80 GB) the original and three rungs of the 64 x 1 split need about 223 GB: four equal shares
    of 20 GB would fail every tuned rung; instead none is bounded, and the note says so and why."""
    p = ms.plan({"original": 16, "data": 64, "compile": 64, "precision": 64}, 16, PEAK, H100)
    assert p.release and p.fractions == {}
    assert sum(p.needs.values()) == pytest.approx(13 * PEAK)  # 1 + 3 x 4
    assert "no rung is bounded" in p.note and "untimed step" in p.note


def test_cuda_graph_pools_that_cannot_be_freed_are_counted_and_the_risk_said():
    """Freeing caches between turns does not free a CUDA-graph rung's pool: on an H200 (about 129 GiB usable),
    two reduce-overhead rungs of the 64 x 1 split hold about 128 GiB, and with the 64 GiB eager one a rung may fail."""
    rungs = {"original": 16, "data": 64, "compile": 64, "precision": 64}
    p = ms.plan(rungs, 16, PEAK, H200, frozenset({"compile", "precision"}))
    assert p.release and "may fail for memory" in p.note and "compile, precision: about 128 GiB" in p.note
    # an H100: 16 + 32 + 32 GiB do not fit together, but the 32 GiB pool beside the largest other rung does
    calm = ms.plan({"original": 16, "data": 32, "compile": 32}, 16, PEAK, H100, frozenset({"compile"}))
    assert calm.release and "stay held throughout" in calm.note and "may fail" not in calm.note
    assert "CUDA-graph" not in ms.plan(rungs, 16, PEAK, H100).note.split("next")[-1]  # none compiled that way


def test_a_smaller_split_is_not_given_less_than_step_1s_peak():
    p = ms.plan({"original": 16, "data": 8}, 16, PEAK, H200)
    assert p.needs["data"] == PEAK  # the parameters, gradients and optimizer state do not shrink with it


def test_without_a_measured_peak_the_shares_are_equal_and_said_so():
    for peak in (None, 0.0):
        p = ms.plan({"original": 16, "data": 64, "compile": 64}, 16, peak, H200)
        assert p.fractions == {n: pytest.approx(ms.USABLE / 3) for n in ("original", "data", "compile")}
        assert not p.release and "step 1 measured no peak memory" in p.note
    assert ms.plan({}, 16, PEAK, H200).fractions == {}


def test_a_cpu_run_gets_no_plan():
    assert ms.for_device(resolve_device("cpu"), {"original": 4}, 4, {"metrics": {}}) is None
