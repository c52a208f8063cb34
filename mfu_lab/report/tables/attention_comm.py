"""Step 2 (attention and communication): its tables and its section of the index page."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab import plots
from mfu_lab.report.templating import macros
from mfu_lab.steps.attention_comm.step import AttentionCommResult

TEMPLATE = "tables_attention_comm.html.j2"


def attention_table(rows) -> Markup:
    """Each attention implementation: status, error against the job's own, time, share of the step, MFU."""
    return macros(TEMPLATE).attention_table(rows)


def comm_table(rows) -> Markup:
    """Each DDP configuration of the sweep: step time and spread, communication shares, MFU, errors."""
    return macros(TEMPLATE).comm_table(rows)


def attention_comm_section(d: dict[str, Any]) -> Markup:
    """Step 2's section of the index page, from its result dict."""
    r = AttentionCommResult.from_dict(d)
    uris = {
        "attention": plots.to_data_uri(plots.attention_times(r)) if any(a.status == "ok" for a in r.attention)
        else None,
        "comm": plots.to_data_uri(comm) if (comm := plots.comm_sweep(r)) else None,
        "bandwidth": plots.to_data_uri(plots.allreduce_bandwidth(r)) if r.allreduce else None,
        "race": plots.to_data_uri(race) if (race := plots.race(r)) else None,
        "ledger": plots.to_data_uri(plots.ledger_waterfall(
            r.ledger, "MFU ledger, data-parallel with the recommended configuration")) if r.ledger else None,
    }
    return macros(TEMPLATE).section(r, d["metrics"], uris)
