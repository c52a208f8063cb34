"""Step 1 (baseline) on the index page: headline cards, the ledger, step times, health, environment."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab import plots
from mfu_lab.report.templating import macros
from mfu_lab.steps.baseline.step import BaselineResult


def baseline_section(d: dict[str, Any]) -> Markup:
    """Step 1's section of the index page, from its result dict."""
    r = BaselineResult.from_dict(d)
    return macros("tables_baseline.html.j2").section(
        r, d["metrics"], d["environment"], plots.to_data_uri(plots.ledger_waterfall(r.ledger)),
        plots.to_data_uri(plots.step_times(r)))
