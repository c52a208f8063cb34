"""Plots drawn from results (never from live state). Each returns a matplotlib Figure.

:mod:`.base` holds the figure class, colours, data URIs and the cross-step figures (ledger, MFU
progression and trend); one module per workbook step holds that step's figures. Every name is
re-exported here, so callers keep using ``plots.step_times``, ``plots.ReportFigure`` and so on.
"""

from __future__ import annotations

from mfu_lab.plots.attention_comm import (  # noqa: F401 - re-exported
    HOOK_COLORS,
    allreduce_bandwidth,
    attention_times,
    comm_sweep,
    race,
)
from mfu_lab.plots.base import (  # noqa: F401 - re-exported
    COLORS,
    ReportFigure,
    ledger_before_after,
    ledger_waterfall,
    mfu_progression,
    mfu_trend,
    to_data_uri,
)
from mfu_lab.plots.baseline import step_times  # noqa: F401
from mfu_lab.plots.compile import MODE_COLORS, break_even, compile_modes  # noqa: F401
from mfu_lab.plots.fp8 import fp8_losses, fp8_sensitivity, precision  # noqa: F401
from mfu_lab.plots.kernels import (  # noqa: F401 - re-exported
    BREAKDOWN_COLORS,
    CATEGORY_COLORS,
    fusion_candidates,
    time_breakdown,
    top_kernels,
)
from mfu_lab.plots.monitor import Unavailable  # noqa: F401
from mfu_lab.plots.monitor import gpu_health as monitor_gpu_health  # noqa: F401
from mfu_lab.plots.monitor import operations_loss as monitor_operations  # noqa: F401
from mfu_lab.plots.monitor import overview as monitor_overview  # noqa: F401
from mfu_lab.plots.monitor import step_by_rank as monitor_step_by_rank  # noqa: F401
from mfu_lab.plots.placement import (  # noqa: F401 - re-exported
    TERM_COLORS,
    TERM_NAMES,
    gang_timeline,
    model_check,
    placement_map,
    placement_strategies,
    size_sweep,
    term_bars,
)
from mfu_lab.plots.placement_layouts import node_layouts  # noqa: F401
from mfu_lab.plots.verify import RUNG_COLORS, rung_color, staircase, verify_loss  # noqa: F401
