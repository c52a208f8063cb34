"""Reports: each executed notebook as offline HTML, and the job's index page across steps.

Both open with no network: the notebook export uses a template with every external script removed
(:mod:`.export`), and the index embeds its plots as PNG data URIs with inline CSS (:mod:`.index`). HTML is
rendered from Jinja2 templates in ``templates/`` with autoescaping (:mod:`.templating`), so everything taken
from results or job files is escaped.

Modules, one concern each:

* :mod:`.format`: units, source badges, the comparison of two runs as text
* :mod:`.templating`: the Jinja2 environment
* :mod:`.tables`: each step's tables and its section of the index page, one module per step; :mod:`.monitor_views`:
  step 0's views
* :mod:`.summary`: the job's story across steps (pure functions of the results)
* :mod:`.index`: the index page; :mod:`.export`: notebooks as HTML, results first; :mod:`.found`: the block a step
  report opens with; :mod:`.views`: what the notebooks show
* :mod:`.browser`: pages checked in headless Chromium
"""

from __future__ import annotations

from mfu_lab.core.store.files import load_results
from mfu_lab.report.export import export_html
from mfu_lab.report.format import badge, fmt
from mfu_lab.report.index import (
    SECTIONS,
    changes_table,
    environment_html,
    history_html,
    recommendations_list,
    write_index,
)
from mfu_lab.report.tables.attention_comm import attention_table, comm_table
from mfu_lab.report.tables.compile import audit_table, loss_race_table, recompile_table, step3_table, trials_table
from mfu_lab.report.tables.fp8 import policies_table, precision_table, sensitivity_table
from mfu_lab.report.tables.kernels import (
    breakdown_table,
    compare_line,
    fusion_table,
    races_table,
    ranks_table,
    top_table,
)
from mfu_lab.report.tables.placement import (
    calibration_table,
    check_table,
    gang_table,
    hints_html,
    layouts_table,
    shared_table,
    strategies_table,
    sweep_table,
)
from mfu_lab.report.tables.verify import adopted_table, staircase_table
from mfu_lab.report.templating import TEMPLATES
from mfu_lab.report.views import (
    Html,
    adopted_view,
    advice_view,
    attention_view,
    audit_view,
    breakdown_view,
    calibration_view,
    check_view,
    comm_view,
    fusion_view,
    gang_view,
    headline_view,
    hints_view,
    layout_view,
    layouts_view,
    ledger_view,
    loader_race_view,
    loss_race_view,
    metrics_view,
    policies_view,
    precision_view,
    races_view,
    ranks_view,
    recompile_view,
    sensitivity_view,
    shared_view,
    staircase_view,
    step3_view,
    strategies_view,
    sweep_view,
    text_summary,
    top_view,
    trials_view,
    tuned_file_view,
)

__all__ = [
    "SECTIONS", "TEMPLATES", "Html", "advice_view", "attention_table", "attention_view", "audit_table", "audit_view",
    "badge", "breakdown_table", "breakdown_view", "calibration_table", "calibration_view", "changes_table",
    "check_table", "check_view", "comm_table", "comm_view", "compare_line", "environment_html", "export_html", "fmt",
    "fusion_table", "fusion_view", "races_table", "races_view", "gang_table", "gang_view", "hints_html",
    "hints_view", "history_html",
    "layout_view", "ledger_view", "loader_race_view", "load_results", "loss_race_table", "loss_race_view",
    "metrics_view", "policies_table",
    "policies_view", "ranks_table", "ranks_view",
    "recommendations_list", "recompile_table", "recompile_view", "sensitivity_table", "sensitivity_view",
    "shared_table", "shared_view", "step3_table", "step3_view", "strategies_table", "strategies_view", "sweep_table",
    "sweep_view", "text_summary", "top_table", "top_view", "trials_table", "trials_view", "write_index",
    "precision_table", "precision_view", "adopted_table", "adopted_view", "headline_view", "staircase_table",
    "staircase_view", "tuned_file_view", "layouts_table", "layouts_view",
]
