"""What the notebooks show: each table of a step's result as HTML that Jupyter renders, and a plain-text
summary for the terminal.

Every ``*_view`` takes a step's result (the dataclass a step's ``run`` returns; the first three also take its
dict) and returns :class:`Html`, styled with the index page's CSS scoped to ``.mfu``.
"""

from __future__ import annotations

from typing import Any

from markupsafe import Markup, escape

from mfu_lab.core.job import overrides as ov
from mfu_lab.core.store.results import jsonable
from mfu_lab.report.format import badge, fmt
from mfu_lab.report.tables.attention_comm import attention_table, comm_table
from mfu_lab.report.tables.compile import audit_table, loss_race_table, recompile_table, step3_table, trials_table
from mfu_lab.report.tables.fp8 import policies_table, precision_table, sensitivity_table
from mfu_lab.report.tables.kernels import breakdown_table, fusion_table, races_table, ranks_table, top_table
from mfu_lab.report.tables.layout import layout_table
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
from mfu_lab.report.templating import macros, wrap_cells

VIEWS = "views.html.j2"


class Html(str):
    """HTML that Jupyter renders (``_repr_html_``) and a terminal prints as markup."""

    def _repr_html_(self) -> str:
        return str(self)

    def __html__(self) -> str:  # already HTML: a template prints it as it is
        return str(self)


def _as_dict(result) -> dict[str, Any]:
    return result if isinstance(result, dict) else jsonable(result)


def _part(inner: Markup) -> Html:
    return Html(wrap_cells(str(macros(VIEWS).part(inner))))


# ------------------------------------------------------------------ any step's result
def metrics_view(result) -> Html:
    """Every metric of a result with its value, source label and how it was obtained."""
    return _part(macros("parts.html.j2").metrics_table(_as_dict(result)["metrics"]))


def ledger_view(result) -> Html:
    """The ledger as a table: each part, its share of peak, its source and how it was computed."""
    items = _as_dict(result)["ledger"]["items"]
    return _part(macros("parts.html.j2").ledger_table(items, sum(i["fraction"] for i in items), "part"))


def layout_view(result) -> Html:
    """Steps 1, 3 and 7: the job in its own layout (loss check, ranks, collectives, bubble), or a line saying it
    ran in one process."""
    d = _as_dict(result)
    return _part(layout_table(d.get("layout")) + fit_line(d.get("fit")))


def loader_race_view(result) -> Html:
    """Step 1: the loader race, when the device waited on data (steps.baseline.data_race), or a line saying none ran."""
    d = _as_dict(result)
    return _part(macros("tables_baseline.html.j2").loader_race(d.get("loader_race") or {}))


def fit_line(fit: dict | None) -> Markup:
    """Step 1's memory check before the run, in one sentence."""
    if not fit:
        return Markup("")
    if not fit.get("checked"):
        return Markup("<p>Memory before the run: {}</p>").format(fit.get("reason", "not checked"))
    text = "<p>Memory before the run {} ({}): {} per rank for {}, against {} available per rank ({}).</p>"
    return Markup(text).format(
        Markup(badge("analytic")), fit["formula"], fmt(fit["bytes_per_rank"], "bytes"), fit["layout"],
        fmt(fit["available_per_rank"], "bytes"), fit["available_how"])


def advice_view(result) -> Html:
    """What to do next, most pressing first as the step ordered it, and what the step skipped, and why."""
    d = _as_dict(result)
    return Html(macros(VIEWS).advice(d.get("advice", []), d.get("skipped", [])))


def text_summary(result) -> str:
    """A plain-text table of a result's metrics, for the terminal."""
    d = _as_dict(result)
    rows = [(k, fmt(v["value"], v["unit"]), v["source"]) for k, v in d["metrics"].items()]
    w = max(len(r[0]) for r in rows)
    lines = [f"{k:<{w}}  {v:>14}  [{s}]" for k, v, s in rows]
    for a in d.get("advice", []):
        lines.append(f"- {a['severity']}: {a['message']} ({a['because']})")
    for s in d.get("skipped", []):
        lines.append(f"- skipped {s['what']}: {s['reason']}")
    if given := ov.recorded(d):
        lines.append(f"- measured with overrides from the command line, not the job file's values: {ov.flags(given)}")
    return "\n".join(lines)


# ------------------------------------------------------------------ step 2
def attention_view(result) -> Html:
    """Step 2: each attention implementation side by side (:func:`attention_table`)."""
    return _part(attention_table(result.attention))


def comm_view(result) -> Html:
    """Step 2: the DDP communication sweep (:func:`comm_table`) and how each sweep ran (exhaustive or racing)."""
    how = "".join(f"<p><small>How the {k} sweep ran: {escape(log.text())}.</small></p>"
                  for k, log in (getattr(result, "races", None) or {}).items() if log)
    return _part(comm_table(result.comm) + Markup(how))


# ------------------------------------------------------------------ step 3
def top_view(result) -> Html:
    """Step 3: the top kernels or operators of the profiled step (:func:`top_table`)."""
    return _part(top_table(result.analysis))


def breakdown_view(result) -> Html:
    """Step 3: where the profiled step's time goes (:func:`breakdown_table`)."""
    return _part(breakdown_table(result.analysis))


def races_view(result) -> Html:
    """Step 3: the optimizer and batch races on the job itself (:func:`races_table`)."""
    return _part(races_table(result))


def fusion_view(result) -> Html:
    """Step 3: fusion candidates (:func:`fusion_table`)."""
    return _part(fusion_table(result.analysis))


def ranks_view(result) -> Html:
    """Step 3: the data-parallel profile, one trace per rank (:func:`ranks_table`)."""
    return _part(ranks_table(result))


# ------------------------------------------------------------------ step 4
def audit_view(result) -> Html:
    """Step 4: the shapes the data produces (:func:`audit_table`)."""
    return _part(audit_table(result))


def recompile_view(result) -> Html:
    """Step 4: recompiles and graph breaks (:func:`recompile_table`)."""
    return _part(recompile_table(result))


def trials_view(result) -> Html:
    """Step 4: each compile mode against eager (:func:`trials_table`)."""
    return _part(trials_table(result))


def loss_race_view(result) -> Html:
    """Step 4: the loss's implementations raced side by side (:func:`loss_race_table`)."""
    return _part(loss_race_table(result))


def step3_view(result) -> Html:
    """Step 4: kernels after compiling, against step 3's eager trace (:func:`step3_table`)."""
    return _part(step3_table(result))


# ------------------------------------------------------------------ step 5
def precision_view(result) -> Html:
    """Step 5: the precision ladder, rung by rung, then the choice (:func:`precision_table`)."""
    return _part(precision_table(result))


def sensitivity_view(result) -> Html:
    """Step 5: each layer group's sensitivity to FP8 (:func:`sensitivity_table`)."""
    return _part(sensitivity_table(result))


def policies_view(result) -> Html:
    """Step 5: each FP8 policy's loss against bf16 (:func:`policies_table`)."""
    return _part(policies_table(result))


# ------------------------------------------------------------------ step 6
def calibration_view(result) -> Html:
    """Step 6: the placement model's inputs (:func:`calibration_table`)."""
    return _part(calibration_table(result))


def check_view(result) -> Html:
    """Step 6: co-location and the model against this machine (:func:`check_table`)."""
    return _part(check_table(result))


def layouts_view(result) -> Html:
    """Step 6: this node's layouts, each term against the model (:func:`layouts_table`)."""
    return _part(layouts_table(result))


def sweep_view(result) -> Html:
    """Step 6: the job at each size (:func:`sweep_table`)."""
    return _part(sweep_table(result))


def strategies_view(result) -> Html:
    """Step 6: placement strategies against topology-aware (:func:`strategies_table`)."""
    return _part(strategies_table(result))


def shared_view(result) -> Html:
    """Step 6: several jobs sharing the cluster (:func:`shared_table`)."""
    return _part(shared_table(result))


def gang_view(result) -> Html:
    """Step 6: the queue under each scheduling policy (:func:`gang_table`)."""
    return _part(gang_table(result))


def hints_view(result) -> Html:
    """Step 6: Slurm and Kueue hints for the chosen layout (:func:`hints_html`)."""
    return _part(hints_html(result))


# ------------------------------------------------------------------ step 7
def headline_view(result) -> Html:
    """Step 7: the headline, MFU before and after with the speedup and its interval, in one line."""
    return _part(Markup("<p><b>{}</b></p>").format(result.headline["text"]))


def staircase_view(result) -> Html:
    """Step 7: each rung of the staircase (:func:`staircase_table`)."""
    return _part(staircase_table(result))


def adopted_view(result) -> Html:
    """Step 7: every recommended change, adopted or not (:func:`adopted_table`)."""
    return _part(adopted_table(result))


def tuned_file_view(result) -> Html:
    """Step 7: the tuned job file as written."""
    from pathlib import Path

    p = Path(result.tuned_file)
    text = p.read_text() if p.is_file() else f"(not written: {p} does not exist; run with write=True)"
    return _part(Markup("<pre>{}</pre>").format(text))

