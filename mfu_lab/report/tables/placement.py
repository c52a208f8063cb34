"""Step 6 (placement): its tables and its section of the index page."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab import plots
from mfu_lab.report.templating import macros
from mfu_lab.steps.placement.step import PlacementResult

TEMPLATE = "tables_placement.html.j2"


def calibration_table(r) -> Markup:
    """The placement model's inputs: each value, its source label and where it came from."""
    return macros(TEMPLATE).calibration_table(r)


def strategies_table(r) -> Markup:
    """Each placement strategy's predicted step, MFU and communication, against topology-aware (modelled)."""
    return macros(TEMPLATE).strategies_table(r)


def shared_totals(r) -> list[tuple[str, float, float, int]]:
    """Per partition of the shared cluster: (partition, goodput in tokens/s, MFU over the GPUs in use, GPUs)."""
    good: dict[str, list[dict]] = {}
    for x in r.shared:
        if x.get("status") == "ok":
            good.setdefault(x["partition"], []).append(x)
    out = []
    for k, v in good.items():
        n = sum(y["layout"]["tp"] * y["layout"]["pp"] * y["layout"]["dp"] for y in v)
        flops = sum(y["mfu"] * y["layout"]["tp"] * y["layout"]["pp"] * y["layout"]["dp"] for y in v)
        out.append((k, sum(y["tokens_per_s"] for y in v), flops / n, n))
    return out


def shared_table(r) -> Markup:
    """Several jobs placed on the cluster at once, sharing uplinks, and each partition's goodput (modelled)."""
    return macros(TEMPLATE).shared_table(r, shared_totals(r))


def sweep_table(r) -> Markup:
    """The job at each size: predicted step, MFU, throughput per GPU-hour, marginal efficiency, memory."""
    return macros(TEMPLATE).sweep_table(r)


def check_table(r) -> Markup:
    """The co-location experiment, and the model's predictions against step 2's measured DDP step."""
    return macros(TEMPLATE).check_table(r)


def layouts_table(r) -> Markup:
    """Every layout of this node: status and, per term, the model's figure, the observed one, their ratio and the
    source (counted or measured)."""
    return macros(TEMPLATE).layouts_table(r)


def gang_table(r) -> Markup:
    """The simulated queue under each scheduling policy: idle GPU-hours, makespan, deadlocks (modelled)."""
    return macros(TEMPLATE).gang_table(r)


def hints_html(r) -> Markup:
    """Slurm and Kueue hints for the chosen layout, and the health gate to run before it."""
    return macros(TEMPLATE).hints_html(r)


def _uri(fig) -> str | None:
    return plots.to_data_uri(fig) if fig else None  # an Unavailable (falsy) says in the notebook why


def placement_section(d: dict[str, Any]) -> Markup:
    """Step 6's section of the index page, from its result dict."""
    r = PlacementResult.from_dict(d)
    uris = {"check": _uri(plots.model_check(r)), "sweep": _uri(plots.size_sweep(r)),
            "layouts": _uri(plots.node_layouts(r)),
            "strategies": _uri(plots.placement_strategies(r) if r.chosen else None),
            "map": _uri(plots.placement_map(r)), "gang": _uri(plots.gang_timeline(r) if r.gang else None)}
    return macros(TEMPLATE).section(r, d["metrics"], shared_totals(r), uris)
