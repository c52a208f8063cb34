"""Step 5 (FP8): its tables and its section of the index page."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab import plots
from mfu_lab.report.templating import macros
from mfu_lab.steps.fp8 import Fp8Result

TEMPLATE = "tables_fp8.html.j2"


def sensitivity_table(r) -> Markup:
    """Each layer group's worst FP8 signal-to-noise and under/overflow, per scaling recipe (emulated)."""
    return macros(TEMPLATE).sensitivity_table(r)


def policies_table(r) -> Markup:
    """Each FP8 policy: its groups, recipe, FLOPs share, and its loss against bf16's (emulated)."""
    return macros(TEMPLATE).policies_table(r)


def fp8_section(d: dict[str, Any]) -> Markup:
    """Step 5's section of the index page, from its result dict."""
    r = Fp8Result.from_dict(d)
    uris = {"sensitivity": plots.to_data_uri(plots.fp8_sensitivity(r)),
            "losses": plots.to_data_uri(plots.fp8_losses(r))}
    return macros(TEMPLATE).section(r, d["metrics"], uris)
