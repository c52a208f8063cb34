"""Step 3's figures read from a trace, as labelled metrics: the top-N share, the time breakdown (the idle share
against the step without the profiler), categories, bandwidth, fusion and the optimizer; and this run's step time
against step 1's."""

from __future__ import annotations

from typing import Any

from mfu_lab.analysis.trace import breakdown as tr
from mfu_lab.core.store.results import Metric


def compare_with_step1(ref: dict[str, Any] | None, median_s: float, profiled_s: float) -> dict[str, Any]:
    """This run's step time against step 1's, when step 1 ran on this device."""
    compare: dict[str, Any] = {"this_median_s": median_s, "profiled_median_s": profiled_s}
    if ref:
        compare |= {k: ref[k] for k in ("source", "median_s", "p10_s", "p90_s", "mfu")}
        compare["consistent"] = ref["p10_s"] <= median_s <= ref["p90_s"] or abs(median_s / ref["median_s"] - 1) <= 0.05
        compare["difference"] = median_s / ref["median_s"] - 1
    return compare


def trace_metrics(a: tr.TraceAnalysis, bandwidth: float, bw_note: str, whose: str = "",
                   step_s: float | None = None) -> dict[str, Metric]:
    """The figures read from the trace: top-N share, the breakdown, categories, bandwidth, fusion, optimizer. The
    idle share of a GPU trace is against ``step_s``, the median step without the profiler, when there is one."""
    b = a.breakdown
    # a GPU's kernels run as fast under the profiler as without it, so their busy time carries over to the real
    # step; a CPU trace's operators are the host's own, slowed by the profiler too: its window is the basis
    idle, _, idle_how = tr.idle_share(a, step_s if a.kind == "gpu" else None)
    best = a.fusion[0] if a.fusion else None
    est_total = sum(c.est_saving_per_step_s or 0.0 for c in a.fusion)
    mem = sum(a.category_share[c] for c in tr.MEMORY_BOUND)
    window = f"over {a.steps} profiled steps{whose}"
    return {
        "top_n_share": Metric(a.top_share, "fraction", "measured",
                              f"self time of the top {len(a.top)} {'kernels' if a.kind == 'gpu' else 'operators'} "
                              f"/ profiled window ({window})"),
        "computing_share": Metric(b.computing, "fraction", "measured", "device computing / profiled window" + whose),
        "exposed_comm_share": Metric(b.communicating, "fraction", "measured", "communication outside compute" + whose),
        "copying_share": Metric(b.copying, "fraction", "measured", "memory copies outside compute" + whose),
        "data_wait_share": Metric(b.waiting_for_data, "fraction", "measured", "idle while the host loads data" + whose),
        "idle_share": Metric(idle, "fraction", "measured", idle_how + whose),
        "profiled_idle_share": Metric(b.idle, "fraction", "measured", "the same over the profiled window" + whose),
        "matmul_attention_share": Metric(a.category_share["matmul"] + a.category_share["attention"], "fraction",
                                         "measured", "self time of matmul and attention / profiled window" + whose),
        "memory_bound_share": Metric(mem, "fraction", "measured",
                                     "self time of elementwise, normalisation, reduction and memory copy / window"
                                     + whose),
        "memory_bandwidth_bytes_per_s": Metric(bandwidth, "bytes/s", "measured", bw_note),
        "ops_per_step": Metric(a.ops_per_step, "kernels" if a.kind == "gpu" else "operators", "counted",
                               "kernels and copies (GPU) / operators (CPU) in the trace, per profiled step; step 4 "
                               "compares its compiled count with this" + whose),
        "fusion_candidates": Metric(float(len(a.fusion)), "patterns", "counted",
                                    "distinct runs of 2+ adjacent memory-bound operations in the trace" + whose),
        "fusion_saving_per_step_s": Metric(est_total, "s", "analytic",
                                           "sum over candidates of 2 x intermediate bytes / measured bandwidth"),
        "top_candidate_share": Metric(best.share_of_step if best else 0.0, "fraction", "measured",
                                      f"measured time of '{best.pattern}' runs / step" if best else "no candidate"),
        "optimizer_share": Metric(a.optimizer.get("share_of_step", 0.0), "fraction", "measured",
                                  "Optimizer.step span / profiled step" + whose),
    }
