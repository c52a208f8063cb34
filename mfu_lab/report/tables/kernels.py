"""Step 3 (kernels): its tables, the comparison with step 1, and its section of the index page."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab import plots
from mfu_lab.core.registry import BY_KEY
from mfu_lab.report.format import ms
from mfu_lab.report.templating import macros
from mfu_lab.steps.kernels.step import OPEN_TRACE, KernelsResult

TEMPLATE = "tables_kernels.html.j2"


def top_table(a) -> Markup:
    """The top-N kernels/operators, with what the rest and the idle time add up to."""
    return macros(TEMPLATE).top_table(a)


def breakdown_table(a) -> Markup:
    """The profiled step split into computing, exposed communication, copies, data wait and idle."""
    return macros(TEMPLATE).breakdown_table(a)


def ranks_table(result, prefix: str = "") -> Markup:
    """One row per rank's trace: the job in its own layout (each collective kind a category, and each rank's top
    rows), or the data-parallel profile, or why there is none."""
    if result.layout:
        return macros(TEMPLATE).layout_ranks_table(result.layout, prefix)
    return macros(TEMPLATE).ranks_table(result.ddp, prefix)


def races_table(r) -> Markup:
    """Step 3's races on the job itself: AdamW's implementations and the micro-batch against accumulation."""
    return macros(TEMPLATE).races_table(r)


def fusion_table(a) -> Markup:
    """Runs of adjacent memory-bound operations worth fusing, with the traffic and time a fusion would save."""
    return macros(TEMPLATE).fusion_table(a)


def compare_line(result) -> str:
    """Step 3's step time against step 1's, in one sentence."""
    c, lay = result.compare, result.layout
    mine = (f"this run {ms(c['this_median_s'])} without the profiler, {ms(c['profiled_median_s'])} with it "
            f"(median step)")
    if lay:
        mine = (f"this run of {lay['name']} {ms(c['this_median_s'])} without the profiler (median step, the slowest "
                f"rank per step), rank {lay['most_exposed_rank']}'s traced step {ms(c['profiled_median_s'])}")
    if "median_s" not in c:
        where = f" in the layout {lay['name']}" if lay else ""
        return f"Step 1 has not run{where} on this device; {mine}."
    verdict = ("the same as step 1 within its spread" if c["consistent"]
               else f"{c['difference']:+.1%} against step 1, outside its spread")
    return (f"Step 1 median {ms(c['median_s'])} (p10–p90 {ms(c['p10_s'])}–{ms(c['p90_s'])}); {mine}: "
            f"{verdict}.")


def kernels_section(d: dict[str, Any]) -> Markup:
    """Step 3's section of the index page, from its result dict."""
    r = KernelsResult.from_dict(d)
    a = r.analysis
    uris = {
        "top": plots.to_data_uri(plots.top_kernels(r)),
        "breakdown": plots.to_data_uri(plots.time_breakdown(r)),
        "ledger": plots.to_data_uri(plots.ledger_waterfall(r.ledger, r.ledger_title())),
        "per_rank": (plots.to_data_uri(plots.time_breakdown(r, per_rank=True))
                     if r.ddp.get("ranks") or r.layout.get("profiles") else None),
        "fusion": plots.to_data_uri(plots.fusion_candidates(r)) if a.fusion else None,
    }
    return macros(TEMPLATE).section(r, d["metrics"], compare_line(r), BY_KEY["kernels"].folder, OPEN_TRACE, uris)
