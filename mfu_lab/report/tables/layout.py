"""A job run in its own layout (steps 1, 3 and 7): the layout, its loss check, each rank, the collectives
counted against their closed form, and the pipeline bubble."""

from __future__ import annotations

from typing import Any

from markupsafe import Markup

from mfu_lab.report.templating import macros


def layout_table(layout: dict[str, Any] | None) -> Markup:
    """The layout part of a result (``result.layout``, the step's summary of a :class:`LayoutRun`); a line saying
    the job ran in one process when it is empty."""
    return macros("tables_layout.html.j2").layout_table(layout or {})
