"""Step 4 (compile): its tables and its section of the index page."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab import plots
from mfu_lab.report.templating import macros
from mfu_lab.steps.compile.step import CompileResult

TEMPLATE = "tables_compile.html.j2"


def audit_table(r) -> Markup:
    """The shapes the data loader produces over an epoch: batch sizes, lengths, padding."""
    return macros(TEMPLATE).audit_table(r.audit)


def recompile_table(r) -> Markup:
    """Recompiles each way of feeding shapes caused, with the guard failures, and the graph breaks."""
    return macros(TEMPLATE).recompile_table(r)


def trials_table(r) -> Markup:
    """Each compile mode against eager: step time, speedup, MFU, compile time, break-even, loss drift."""
    return macros(TEMPLATE).trials_table(r)


def loss_race_table(r) -> Markup:
    """loss_impl raced side by side (steps.compile.loss_race): each implementation's step and final loss."""
    return macros(TEMPLATE).loss_race_table(r.loss_race)


def step3_table(r) -> Markup:
    """Kernels (or operators) per step after compiling, against step 3's eager trace."""
    return macros(TEMPLATE).step3_table(r.step3)


def compile_section(d: dict[str, Any]) -> Markup:
    """Step 4's section of the index page, from its result dict."""
    r = CompileResult.from_dict(d)
    ok = any(t.status == "ok" for t in r.trials)
    uris = {"modes": plots.to_data_uri(plots.compile_modes(r)) if ok else None,
            "break_even": plots.to_data_uri(plots.break_even(r)) if ok else None}
    return macros(TEMPLATE).section(r, d["metrics"], uris)
