"""Step 0 (the production monitor): the notebook's views (tables and plots, built on report.views) and its section of a
job's index page. Beside report/tables/, not in it: those are plain tables, and these views use report.views."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab.core.store.results import jsonable
from mfu_lab.report.templating import macros
from mfu_lab.report.views import Html, _part
from mfu_lab.steps import monitor

TEMPLATE = "tables_monitor.html.j2"


def _d(summary) -> dict[str, Any]:
    return summary if isinstance(summary, dict) else jsonable(summary)


def verdict_view(summary) -> Html:
    """Where to start, and the headline figures of the job in production, each with its label."""
    return _part(macros(TEMPLATE).verdict(_d(summary)))


def shares_view(summary) -> Html:
    """The shares of the step (compute, communication, data, host, waiting for the slowest) with how each was
    measured, and the profiler windows' breakdown."""
    return _part(macros(TEMPLATE).shares_table(_d(summary)))


def operations_view(summary) -> Html:
    """The operations loss's parts, each measured or named as unknown with the reason."""
    return _part(macros(TEMPLATE).operations_table(_d(summary)))


def advice_view(summary) -> Html:
    """What to do first, with the figures behind it."""
    from mfu_lab.analysis.monitor.summary import MonitorSummary
    from mfu_lab.core.store.results import rebuild

    s = rebuild(MonitorSummary, summary) if isinstance(summary, dict) else summary
    return Html(macros("views.html.j2").advice(jsonable(monitor.advise(s)), []))


def stragglers_view(summary) -> Html:
    return _part(macros(TEMPLATE).stragglers_table(_d(summary)))


def launches_view(summary) -> Html:
    """Each launch (restarts are new launches) with whether it ended cleanly and what the scheduler said."""
    return _part(macros(TEMPLATE).launches_table(_d(summary)))


def monitor_section(d: dict[str, Any], link: str | None) -> Markup:
    """The monitor's section of a job's index page, from its ``summary.json``."""
    from mfu_lab import plots
    from mfu_lab.analysis.monitor.summary import MonitorSummary
    from mfu_lab.core.store.results import rebuild

    s = rebuild(MonitorSummary, d)
    fig = plots.monitor_overview(s)
    uris = {"overview": plots.to_data_uri(fig) if fig else None}
    return macros(TEMPLATE).section(d, monitor.advise(s), uris, link)
