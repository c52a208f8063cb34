"""Step 7 (verify): its tables and its section of the index page."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab import plots
from mfu_lab.report.templating import macros
from mfu_lab.steps.verify.step import VerifyResult

TEMPLATE = "tables_verify.html.j2"


def staircase_table(r) -> Markup:
    """Each rung of the staircase: step time, tokens/s, MFU, speedup over the original and its own gain."""
    return macros(TEMPLATE).staircase_table(r)


def adopted_table(r) -> Markup:
    """Every change the steps recommended, adopted or not (and why), with its evidence and label."""
    return macros(TEMPLATE).adopted_table(r.changes, r.tuned_file)


def verify_section(d: dict[str, Any]) -> Markup:
    """Step 7's section of the index page, from its result dict."""
    r = VerifyResult.from_dict(d)
    figs = {"staircase": plots.staircase(r), "loss": plots.verify_loss(r)}
    uris = {k: plots.to_data_uri(f) if f else None for k, f in figs.items()}  # Unavailable is falsy
    return macros(TEMPLATE).section(r, d["metrics"], uris)
